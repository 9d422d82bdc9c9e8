"""The off-policy pairs, SAC and TD3: each eager script and its torch.compile twin, on the CPU."""

import copy
import math
import subprocess

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import (
    MISSING_SIMULATOR, assert_rejected, assert_rejected_on_the_command_line, load_script, run_main, run_script, summary_of,
)
from tensordict import from_modules

SAC, SAC_TWIN = "sac_continuous_action", "sac_continuous_action_torchcompile"
TD3, TD3_TWIN = "td3_continuous_action", "td3_continuous_action_torchcompile"
ALL = [SAC, SAC_TWIN, TD3, TD3_TWIN]
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
        (SAC_TWIN, []),
        (SAC_TWIN, ["--compile"]),
        (SAC_TWIN, ["--compile", "--cudagraphs"]),
        (SAC_TWIN, ["--compile", "--no-autotune", "--alpha", "0.1"]),
        (TD3, []),
        (TD3_TWIN, []),
        (TD3_TWIN, ["--compile", "--cudagraphs"]),
        (TD3_TWIN, ["--cudagraphs", "--policy-frequency", "3"]),
    ],
)
def test_short_run(script, flags, workdir):
    proc = run_main(script, *SHORT, *flags, cwd=workdir)
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


@pytest.mark.parametrize("script", [SAC, TD3])
def test_diverged_run_still_ends_with_valid_json(script, workdir):
    """A learning rate of 1e30 turns a loss non-finite within a few updates: the run stops at the next
    read of the losses with one line naming the loss and the step, exit code 1, and a valid summary
    that says null where a number is not finite."""
    lr_flags = ["--q-lr", "1e30", "--policy-lr", "1e30"] if script == SAC else ["--learning-rate", "1e30"]
    proc = run_main(script, *SHORT, *lr_flags, cwd=workdir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith("the run diverged; no checkpoint was saved"), proc.stderr
    # the rest of the summary contract holds as for a clean exit
    summary = summary_of(subprocess.CompletedProcess(proc.args, 0, proc.stdout, proc.stderr), workdir)
    assert summary["diverged"] is True and summary["exit_code"] == 1 and summary["eval_return"] is None
    loss, step = errors[0].split()[1], int(errors[0].split("at global step ")[1].split(":")[0])  # error: <loss> is nan at global step <step>: ...
    assert summary["losses"][loss] is None and summary["global_step"] == step < 400


def test_track_logs_to_wandb_offline(workdir):
    proc = run_main(SAC_TWIN, *SHORT, "--track", cwd=workdir, env={"WANDB_MODE": "offline"})
    summary_of(proc, workdir)
    assert list((workdir / "wandb").glob("offline-run-*")), "no offline wandb run was written"


@pytest.mark.parametrize("script", ALL)
@pytest.mark.parametrize("env_id", ["Pendulum-v1", "InvertedPendulum-v5"])
def test_transition_rows_store_true_last_observation(script, env_id):
    """Same-step autoreset: an episode that ends stores its real last observation (infos["final_obs"],
    not the reset observation the step returns); only terminations are stored as dones; and the next
    stored transition starts from the reset observation. Pendulum only truncates (time limit 5 here);
    InvertedPendulum under random actions terminates within a few steps."""
    module = load_script(script)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(env_id, max_episode_steps=5)] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.action_space.seed(0)
    obs, _ = envs.reset(seed=0)
    n_obs = obs.shape[1]
    ended = {"terminated": 0, "truncated": 0}
    for _ in range(40):
        actions = envs.action_space.sample()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        rows = module.transition_rows(obs, actions, rewards, next_obs, terminations, infos)
        assert rows.dtype == np.float32 and rows.shape == (2, 2 * n_obs + actions.shape[1] + 2)
        np.testing.assert_allclose(rows[:, :n_obs], obs, rtol=1e-6)
        np.testing.assert_allclose(rows[:, -1], terminations.astype(np.float32))  # truncations still bootstrap
        for i in range(2):
            if terminations[i] or truncations[i]:
                np.testing.assert_allclose(rows[i, -1 - n_obs : -1], infos["final_obs"][i], rtol=1e-6)
                assert not np.allclose(rows[i, -1 - n_obs : -1], next_obs[i])
                ended["terminated" if terminations[i] else "truncated"] += 1
            else:
                np.testing.assert_allclose(rows[i, -1 - n_obs : -1], next_obs[i], rtol=1e-6)
        obs = next_obs
    if env_id == "Pendulum-v1":
        assert ended == {"terminated": 0, "truncated": 16}  # 40 steps, episodes of 5, two envs
    else:
        assert ended["terminated"] > 0


SPACE_LOW, SPACE_HIGH = [-1.0, -2.0, 0.0], [1.0, 2.0, 3.0]  # an asymmetric action Box
MODES = [
    pytest.param("twin", id="twin"),
    pytest.param("compile", id="twin-compile"),
    pytest.param(
        "cudagraphs", id="twin-compile-cudagraphs",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
    ),
]


def wrap(fns, mode):
    """The twin's update functions as main() wraps them for --compile [--cudagraphs]."""
    if mode == "twin":
        return fns
    from tensordict.nn import CudaGraphModule

    return [CudaGraphModule(torch.compile(f), warmup=3) if mode == "cudagraphs" else torch.compile(f) for f in fns]


def batches(device, rounds):
    """Replay batches (obs, actions, rewards, next_obs, dones) for obs of 5 and actions in SPACE."""
    gen = torch.Generator().manual_seed(1)
    low, high = torch.tensor(SPACE_LOW), torch.tensor(SPACE_HIGH)
    for _ in range(rounds):
        batch = (
            torch.randn(64, 5, generator=gen), torch.rand(64, 3, generator=gen) * (high - low) + low,
            torch.randn(64, 1, generator=gen), torch.randn(64, 5, generator=gen), (torch.rand(64, 1, generator=gen) < 0.1).float(),
        )
        yield tuple(x.to(device) for x in batch)


def build(module, algo, twin, mode="twin", device="cpu", seed=0):
    """One script's learner from fixed weights: (actor, actor target or None, per-critic parameter
    dicts, per-target parameter dicts, log_alpha or None, update functions)."""
    torch.manual_seed(seed)
    space = gym.spaces.Box(low=np.array(SPACE_LOW), high=np.array(SPACE_HIGH), dtype=np.float32)
    n_obs, n_act = 5, 3
    qnet_cls = module.SoftQNetwork if algo == "sac" else module.QNetwork
    actor = module.Actor(n_obs, space, device=device)
    qf1, qf2 = qnet_cls(n_obs, n_act, device=device), qnet_cls(n_obs, n_act, device=device)
    actor_target = copy.deepcopy(actor) if algo == "td3" else None
    log_alpha = torch.zeros((), device=device, requires_grad=True) if algo == "sac" else None
    extra = {"cudagraphs": mode == "cudagraphs", "compile": mode != "twin"} if twin else {}
    args = module.Args(batch_size=64, tau=0.05, **extra)
    if twin:
        qnet_params = from_modules(qf1, qf2, as_module=True)
        qnet_target = qnet_params.data.clone()
        qnet = qnet_cls(n_obs, n_act, device="meta")
        nets = (qnet, qnet_params, qnet_target, log_alpha, -float(n_act)) if algo == "sac" else (qnet, qnet_params, actor_target, qnet_target)
        q = [{".".join(k): v for k, v in qnet_params[i].items(True, True)} for i in range(2)]
        q_target = [{".".join(k): v for k, v in qnet_target[i].items(True, True)} for i in range(2)]
    else:
        qf1_target, qf2_target = copy.deepcopy(qf1), copy.deepcopy(qf2)
        nets = (qf1, qf2, qf1_target, qf2_target, log_alpha, -float(n_act)) if algo == "sac" else (qf1, qf2, actor_target, qf1_target, qf2_target)
        q = [dict(qf.named_parameters()) for qf in (qf1, qf2)]
        q_target = [dict(qf.named_parameters()) for qf in (qf1_target, qf2_target)]
    _, updates = module.make_updates(args, actor, *nets)
    return actor, actor_target, q, q_target, log_alpha, wrap(updates, mode) if twin else updates


def assert_same_learners(eager, twin):
    for i in (0, 1):  # actor, actor target
        if eager[i] is not None:
            twin_params = dict(twin[i].named_parameters())
            for name, p in eager[i].named_parameters():
                torch.testing.assert_close(twin_params[name].data, p.data, rtol=1e-4, atol=1e-5)
    for i in (2, 3):  # critics, critic targets
        for member in range(2):
            for name, p in eager[i][member].items():
                torch.testing.assert_close(twin[i][member][name].data, p.data, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_sac_twin_computes_the_eager_update(mode, no_tf32):
    """Same weights, same batch, same noise: same losses and alpha, and the same actor, critics,
    targets and log_alpha after rounds of critic, actor-and-alpha and target updates (six rounds
    with CUDA graphs: two warm-ups, the capture, then replays, as main() wraps them)."""
    import torch._inductor.config

    device = "cuda" if mode == "cudagraphs" else "cpu"
    # compiled code draws its own random numbers unless told to use eager's generator
    with torch._inductor.config.patch(fallback_random=True):
        eager = build(load_script(SAC), "sac", twin=False, device=device)
        twin = build(load_script(SAC_TWIN), "sac", twin=True, mode=mode, device=device)
        for step, batch in enumerate(batches(device, 6 if mode == "cudagraphs" else 3)):
            results = []
            for critic, actor_step, targets in (eager[5], twin[5]):
                torch.manual_seed(100 + step)  # the same policy noise on both sides
                qf_loss = critic(*batch)
                actor_loss, alpha = actor_step(batch[0])
                targets()
                results.append(torch.stack([qf_loss, actor_loss, alpha]))
            torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert_same_learners(eager, twin)
    torch.testing.assert_close(twin[4], eager[4])
    assert eager[4].item() != 0.0  # alpha was tuned: the comparisons above compared moved values


@pytest.mark.parametrize("mode", MODES)
def test_td3_twin_computes_the_eager_update(mode, no_tf32):
    """Same weights, same batch, same smoothing noise: same losses, and the same actor, critics and
    all targets after rounds of critic and (delayed) actor-and-target updates."""
    import torch._inductor.config

    device = "cuda" if mode == "cudagraphs" else "cpu"
    with torch._inductor.config.patch(fallback_random=True):
        eager = build(load_script(TD3), "td3", twin=False, device=device)
        twin = build(load_script(TD3_TWIN), "td3", twin=True, mode=mode, device=device)
        for step, batch in enumerate(batches(device, 6 if mode == "cudagraphs" else 3)):
            results = []
            for critic, actor_step in (eager[5], twin[5]):
                torch.manual_seed(100 + step)  # the same smoothing noise on both sides
                results.append(torch.stack([critic(*batch), actor_step(batch[0])]))
            torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert_same_learners(eager, twin)
    assert not torch.equal(eager[1].fc1.weight, build(load_script(TD3), "td3", twin=False)[1].fc1.weight)  # targets moved


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


# The twins' checks are slow (3-5 minutes each on 2 cores) and left out of the default run: the
# equivalence tests above show that a twin computes what its eager script computes, and
# `python -m pytest tests -m slow` runs them
@pytest.mark.parametrize(
    "script, flags, steps",
    [
        pytest.param(SAC, [], 12_000, id="sac"),
        pytest.param(SAC_TWIN, ["--compile"], 12_000, id="sac-twin-compile", marks=pytest.mark.slow),
        pytest.param(TD3, [], 15_000, id="td3"),
        pytest.param(TD3_TWIN, ["--compile"], 15_000, id="td3-twin-compile", marks=pytest.mark.slow),
    ],
)
def test_learns_pendulum(script, flags, steps, workdir):
    """Reference implementations on a 2-core CPU: SAC reaches about -150 by 8,000 steps, TD3 about
    -200 by 10,000 steps (learning from step 1,000). A random policy scores about -1,200."""
    proc = run_script(script, "--env-id", "Pendulum-v1", "--learning-starts", "1000", "--total-timesteps", steps, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert summary["episodes"] == steps // 200
    assert summary["episodic_return"] >= -300, summary


@pytest.mark.parametrize("script", ALL)
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
        (["--seed", "-1"], "--seed must lie in [0, 2**31)"),
        (["--gamma", "nan"], "must lie in [0, 1]"),
        (["--env-id", MISSING_SIMULATOR], f"cannot make {MISSING_SIMULATOR}: the simulator of this env is not installed"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(script, flags, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert_rejected(script, flags, message, capsys)


@pytest.mark.parametrize("script", ALL)
def test_bad_input_on_the_command_line(script, workdir):
    assert_rejected_on_the_command_line(
        script, ["--env-id", "HalfCheeta-v5"], "error: unknown env id 'HalfCheeta-v5': did you mean HalfCheetah-v5", workdir
    )


@pytest.mark.parametrize("script", ALL)
def test_help(script, workdir):
    proc = run_main(script, "--help", cwd=workdir)
    assert proc.returncode == 0
    for flag in ("--env-id", "--total-timesteps", "--learning-starts", "--measure-burnin", "--track", "--capture-video"):
        assert flag in proc.stdout
    assert ("--no-autotune" in proc.stdout) == script.startswith(SAC)
    assert ("--policy-noise" in proc.stdout) == script.startswith(TD3)
    assert ("--cudagraphs" in proc.stdout) == script.endswith("_torchcompile")
