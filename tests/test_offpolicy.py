"""The off-policy pairs, SAC and TD3: each eager script and its torch.compile twin, on the CPU."""

import copy
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import load_script, run_script, summary_of
from tensordict import from_modules

SAC, TD3 = "sac_continuous_action", "td3_continuous_action"
SUMMARY_KEYS = {
    "script", "env_id", "seed", "compile", "cudagraphs", "device", "global_step", "wall_seconds",
    "compile_seconds", "sps", "episodic_return", "episodes",
}
# 300 update steps past --learning-starts on Pendulum-v1, whose episodes last 200 steps
SHORT = ["--env-id", "Pendulum-v1", "--learning-starts", "100", "--total-timesteps", "400", "--batch-size", "32", "--log-every", "50"]


@pytest.mark.parametrize(
    "script, flags",
    [
        (SAC, []),
        (SAC, ["--no-autotune"]),
        (SAC, ["--num-envs", "2"]),
        (SAC + "_torchcompile", []),
        (SAC + "_torchcompile", ["--compile"]),
        (SAC + "_torchcompile", ["--compile", "--cudagraphs"]),
        (SAC + "_torchcompile", ["--compile", "--no-autotune", "--alpha", "0.1"]),
        (TD3, []),
        (TD3 + "_torchcompile", []),
        (TD3 + "_torchcompile", ["--compile", "--cudagraphs"]),
        (TD3 + "_torchcompile", ["--cudagraphs", "--policy-frequency", "3"]),
    ],
)
def test_short_run(script, flags, workdir):
    proc = run_script(script, *SHORT, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["script"] == f"{script}.py"
    assert summary["global_step"] == 400
    assert summary["compile"] == ("--compile" in flags)
    assert summary["cudagraphs"] == ("--cudagraphs" in flags and torch.cuda.is_available())
    assert summary["episodes"] == 2 and summary["episodic_return"] < 0
    assert summary["sps"] > 0 and summary["compile_seconds"] >= 0 and summary["wall_seconds"] > 0
    losses = summary["losses"]
    assert math.isfinite(losses["qf_loss"]) and math.isfinite(losses["actor_loss"])
    if script.startswith(SAC) and "--no-autotune" in flags:  # a fixed alpha stays where it was set
        expected = 0.1 if "--alpha" in flags else 0.2
        assert losses["alpha"] == pytest.approx(expected)
    elif script.startswith(SAC):  # autotune starts alpha at 1 and 300 updates move it
        assert losses["alpha"] < 0.99
    if "--cudagraphs" in flags and not torch.cuda.is_available():
        assert proc.stderr.count("--cudagraphs needs CUDA") == 1


def test_track_logs_to_wandb_offline(workdir):
    proc = run_script(SAC + "_torchcompile", *SHORT, "--track", cwd=workdir, env={"WANDB_MODE": "offline"})
    summary_of(proc, workdir)
    assert list((workdir / "wandb").glob("offline-run-*")), "no offline wandb run was written"


@pytest.mark.parametrize("script", [SAC, SAC + "_torchcompile", TD3, TD3 + "_torchcompile"])
def test_transition_rows_store_true_last_observation(script):
    """Same-step autoreset: a truncated episode stores its real last observation (not the reset one)
    and is not marked done, and the next stored transition starts from the reset observation."""
    module = load_script(script)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("Pendulum-v1", max_episode_steps=5)] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs, _ = envs.reset(seed=0)
    n_obs = obs.shape[1]
    stored = []
    for _ in range(12):
        actions = envs.action_space.sample()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        rows = module.transition_rows(obs, actions, rewards, next_obs, terminations, infos)
        stored.append((rows, truncations, next_obs))
        obs = next_obs
    for t, (rows, truncations, next_obs) in enumerate(stored):
        row_obs, row_next_obs, row_done = rows[:, :n_obs], rows[:, -1 - n_obs : -1], rows[:, -1]
        assert not row_done.any()  # Pendulum never terminates: truncations must keep bootstrapping
        for i in range(2):
            if truncations[i]:  # the stored next obs ends the episode; next_obs is the reset one
                assert not np.allclose(row_next_obs[i], next_obs[i])
            else:
                assert np.allclose(row_next_obs[i], next_obs[i])
            if t + 1 < len(stored):  # transitions chain: next row's obs is what the env returned
                assert np.allclose(stored[t + 1][0][i, :n_obs], next_obs[i])
    assert sum(tr.sum() for _, tr, _ in stored) == 4  # 12 steps, episodes of 5: two truncations per env


def build_sac(module, twin, seed=0):
    """The learner of one script from fixed weights: (actor, Q parameters, target parameters,
    log_alpha, update functions)."""
    torch.manual_seed(seed)
    space = gym.spaces.Box(low=np.array([-1.0, -2.0, 0.0]), high=np.array([1.0, 2.0, 3.0]), dtype=np.float32)
    n_obs, n_act = 5, 3
    actor = module.Actor(n_obs, space)
    qf1, qf2 = module.SoftQNetwork(n_obs, n_act), module.SoftQNetwork(n_obs, n_act)
    log_alpha = torch.zeros((), requires_grad=True)
    args = module.Args(batch_size=64, tau=0.05)
    if twin:
        qnet_params = from_modules(qf1, qf2, as_module=True)
        qnet_target = qnet_params.data.clone()
        qnet = module.SoftQNetwork(n_obs, n_act, device="meta")
        _, updates = module.make_updates(args, actor, qnet, qnet_params, qnet_target, log_alpha, -float(n_act))
        q = [qnet_params[i] for i in range(2)]
        q_target = [qnet_target[i] for i in range(2)]
    else:
        qf1_target, qf2_target = copy.deepcopy(qf1), copy.deepcopy(qf2)
        _, updates = module.make_updates(args, actor, qf1, qf2, qf1_target, qf2_target, log_alpha, -float(n_act))
        q = [dict(qf.named_parameters()) for qf in (qf1, qf2)]
        q_target = [dict(qf.named_parameters()) for qf in (qf1_target, qf2_target)]
    return actor, q, q_target, log_alpha, updates


@pytest.mark.parametrize("compile", [False, True], ids=["twin", "twin-compile"])
def test_sac_twin_computes_the_eager_update(compile):
    """Same weights, same batch, same noise: same losses and the same parameters after three rounds of
    critic, actor (with alpha) and target updates."""
    import torch._inductor.config

    # compiled code draws its own random numbers unless told to use eager's generator
    with torch._inductor.config.patch(fallback_random=True):
        compare_sac_updates(compile)


def compare_sac_updates(compile):
    eager = build_sac(load_script(SAC), twin=False)
    twin = build_sac(load_script(SAC + "_torchcompile"), twin=True)
    twin_critic, twin_actor, twin_targets = twin[4]
    if compile:
        twin_critic, twin_actor = torch.compile(twin_critic), torch.compile(twin_actor)
    batch_gen = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = (
            torch.randn(64, 5, generator=batch_gen),
            torch.rand(64, 3, generator=batch_gen) * torch.tensor([2.0, 4.0, 3.0]) + torch.tensor([-1.0, -2.0, 0.0]),
            torch.randn(64, 1, generator=batch_gen),
            torch.randn(64, 5, generator=batch_gen),
            (torch.rand(64, 1, generator=batch_gen) < 0.1).float(),
        )
        results = []
        for (critic, actor_step, targets) in (eager[4], (twin_critic, twin_actor, twin_targets)):
            torch.manual_seed(100 + step)  # the same policy noise on both sides
            qf_loss = critic(*batch)
            actor_loss, alpha = actor_step(batch[0])
            targets()
            results.append(torch.stack([qf_loss, actor_loss, alpha]))
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    # updated parameters: actor, both critics, both targets, log_alpha
    for name, p in eager[0].named_parameters():
        torch.testing.assert_close(dict(twin[0].named_parameters())[name], p, rtol=1e-4, atol=1e-5)
    for i in range(2):
        for name, p in eager[1][i].items():
            key = tuple(name.split("."))
            torch.testing.assert_close(twin[1][i][key].data, p.data, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(twin[2][i][key].data, eager[2][i][name].data, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(twin[3], eager[3])
    assert eager[3].item() != 0.0  # alpha was tuned: the comparison above compared moved values


def build_td3(module, twin, seed=0):
    """The learner of one TD3 script from fixed weights: (actor, actor target, Q parameters, target
    parameters, update functions)."""
    torch.manual_seed(seed)
    space = gym.spaces.Box(low=np.array([-1.0, -2.0, 0.0]), high=np.array([1.0, 2.0, 3.0]), dtype=np.float32)
    n_obs, n_act = 5, 3
    actor = module.Actor(n_obs, space)
    qf1, qf2 = module.QNetwork(n_obs, n_act), module.QNetwork(n_obs, n_act)
    actor_target = copy.deepcopy(actor)
    args = module.Args(batch_size=64, tau=0.05)
    if twin:
        qnet_params = from_modules(qf1, qf2, as_module=True)
        qnet_target = qnet_params.data.clone()
        qnet = module.QNetwork(n_obs, n_act, device="meta")
        _, updates = module.make_updates(args, actor, qnet, qnet_params, actor_target, qnet_target)
        q = [qnet_params[i] for i in range(2)]
        q_target = [qnet_target[i] for i in range(2)]
    else:
        qf1_target, qf2_target = copy.deepcopy(qf1), copy.deepcopy(qf2)
        _, updates = module.make_updates(args, actor, qf1, qf2, actor_target, qf1_target, qf2_target)
        q = [dict(qf.named_parameters()) for qf in (qf1, qf2)]
        q_target = [dict(qf.named_parameters()) for qf in (qf1_target, qf2_target)]
    return actor, actor_target, q, q_target, updates


@pytest.mark.parametrize("compile", [False, True], ids=["twin", "twin-compile"])
def test_td3_twin_computes_the_eager_update(compile):
    """Same weights, same batch, same smoothing noise: same losses, and the same actor, critics and
    targets after three rounds of critic and (delayed) actor-and-target updates."""
    import torch._inductor.config

    with torch._inductor.config.patch(fallback_random=True):
        eager = build_td3(load_script(TD3), twin=False)
        twin = build_td3(load_script(TD3 + "_torchcompile"), twin=True)
        twin_critic, twin_actor = twin[4]
        if compile:
            twin_critic, twin_actor = torch.compile(twin_critic), torch.compile(twin_actor)
        batch_gen = torch.Generator().manual_seed(1)
        for step in range(3):
            batch = (
                torch.randn(64, 5, generator=batch_gen),
                torch.rand(64, 3, generator=batch_gen) * torch.tensor([2.0, 4.0, 3.0]) + torch.tensor([-1.0, -2.0, 0.0]),
                torch.randn(64, 1, generator=batch_gen),
                torch.randn(64, 5, generator=batch_gen),
                (torch.rand(64, 1, generator=batch_gen) < 0.1).float(),
            )
            results = []
            for critic, actor_step in (eager[4], (twin_critic, twin_actor)):
                torch.manual_seed(100 + step)  # the same smoothing noise on both sides
                results.append(torch.stack([critic(*batch), actor_step(batch[0])]))
            torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    for i in (0, 1):  # actor, actor target
        twin_params = dict(twin[i].named_parameters())
        for name, p in eager[i].named_parameters():
            torch.testing.assert_close(twin_params[name], p, rtol=1e-4, atol=1e-5)
    for i in range(2):
        for name, p in eager[2][i].items():
            key = tuple(name.split("."))
            torch.testing.assert_close(twin[2][i][key].data, p.data, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(twin[3][i][key].data, eager[3][i][name].data, rtol=1e-4, atol=1e-5)


def test_td3_explore_stays_in_asymmetric_bounds():
    td3 = load_script(TD3)
    torch.manual_seed(0)
    space = gym.spaces.Box(low=np.array([-1.0, 0.0]), high=np.array([3.0, 0.5]), dtype=np.float32)
    actor = td3.Actor(4, space)
    with torch.no_grad():
        actions = actor.explore(torch.randn(4096, 4) * 10, noise_scale=1.0)
    assert (actions >= torch.tensor([-1.0, 0.0])).all() and (actions <= torch.tensor([3.0, 0.5])).all()
    # the noise reaches both bounds of each dimension: the clip, not the tanh, keeps actions inside
    assert (actions == torch.tensor([-1.0, 0.0])).any(0).all() and (actions == torch.tensor([3.0, 0.5])).any(0).all()


@pytest.mark.parametrize(
    "script, flags, steps",
    [(SAC, [], 12_000), (SAC + "_torchcompile", ["--compile"], 12_000), (TD3, [], 15_000), (TD3 + "_torchcompile", ["--compile"], 15_000)],
    ids=["sac", "sac-twin-compile", "td3", "td3-twin-compile"],
)
def test_learns_pendulum(script, flags, steps, workdir):
    """Reference implementations on a 2-core CPU: SAC reaches about -150 by 8,000 steps, TD3 about
    -200 by 10,000 steps (learning from step 1,000). A random policy scores about -1,200."""
    proc = run_script(script, "--env-id", "Pendulum-v1", "--learning-starts", "1000", "--total-timesteps", steps, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert summary["episodes"] == steps // 200
    assert summary["episodic_return"] >= -300, summary


@pytest.mark.parametrize("script", [SAC, SAC + "_torchcompile", TD3, TD3 + "_torchcompile"])
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "HalfCheeta-v5"], "unknown env id 'HalfCheeta-v5': did you mean HalfCheetah-v5"),
        (["--env-id", "CartPole-v1"], "continuous (Box) action space"),
        (["--total-timesteps", "1000", "--learning-starts", "1000"], "must be larger than --learning-starts"),
        (["--batch-size", "512", "--buffer-size", "256"], "is larger than --buffer-size"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--buffer-size", "-1"], "--buffer-size must be positive"),
        (["--total-timesteps", "0"], "--total-timesteps must be positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(script, flags, message, workdir):
    proc = run_script(script, *flags, cwd=workdir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("script", [SAC, SAC + "_torchcompile", TD3, TD3 + "_torchcompile"])
def test_help(script, workdir):
    proc = run_script(script, "--help", cwd=workdir)
    assert proc.returncode == 0
    for flag in ("--env-id", "--total-timesteps", "--learning-starts", "--measure-burnin", "--track", "--capture-video"):
        assert flag in proc.stdout
    assert ("--no-autotune" in proc.stdout) == script.startswith(SAC)
    assert ("--policy-noise" in proc.stdout) == script.startswith(TD3)
    assert ("--cudagraphs" in proc.stdout) == script.endswith("_torchcompile")
