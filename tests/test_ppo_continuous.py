"""PPO for continuous actions: the eager script and its torch.compile twin, on the CPU."""

import math
import subprocess

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import (
    MISSING_SIMULATOR, assert_rejected, assert_rejected_on_the_command_line, load_script, run_main, run_script, summary_of,
)

PPO, PPO_TWIN = "ppo_continuous_action", "ppo_continuous_action_torchcompile"
SUMMARY_KEYS = {
    "script", "env_id", "seed", "compile", "cudagraphs", "device", "global_step", "wall_seconds",
    "compile_seconds", "sps", "episodic_return", "episodes", "gradient_steps",
}
# rollouts of 64 steps, each 2 epochs of 2 minibatches; Pendulum's episodes last 200 steps, so 512
# steps finish 2 episodes with one env (8 rollouts) or with two (4 rollouts)
SHORT = ["--env-id", "Pendulum-v1", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "512"]
MODES = [
    pytest.param("twin", id="twin"),
    pytest.param("compile", id="twin-compile"),
    pytest.param(
        "cudagraphs", id="twin-compile-cudagraphs",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
    ),
]


@pytest.mark.parametrize(
    "script, flags",
    [
        (PPO, []),
        (PPO, ["--num-envs", "2"]),
        (PPO, ["--no-anneal-lr", "--no-clip-vloss", "--no-norm-adv", "--ent-coef", "0.01"]),
        (PPO_TWIN, []),
        (PPO_TWIN, ["--compile"]),
        (PPO_TWIN, ["--compile", "--cudagraphs", "--num-envs", "2"]),
        (PPO_TWIN, ["--cudagraphs"]),
    ],
)
def test_short_run(script, flags, workdir):
    proc = run_main(script, *SHORT, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["script"] == f"{script}.py"
    assert summary["compile"] == ("--compile" in flags)
    assert summary["cudagraphs"] == ("--cudagraphs" in flags and torch.cuda.is_available())
    iterations = 512 // (64 * (2 if "--num-envs" in flags else 1))
    assert summary["global_step"] == 512
    assert summary["gradient_steps"] == iterations * 2 * 2  # every epoch of every rollout ran
    assert summary["episodes"] == 2 and summary["episodic_return"] < 0
    assert summary["sps"] > 0 and summary["compile_seconds"] >= 0 and summary["wall_seconds"] > 0
    losses = summary["losses"]
    assert all(math.isfinite(losses[k]) for k in ("value_loss", "policy_loss", "entropy", "approx_kl", "clipfrac"))
    # the last rollout's learning rate: annealed linearly to 1/iterations of the start, or constant
    expected_lr = 3e-4 if "--no-anneal-lr" in flags else 3e-4 / iterations
    assert losses["learning_rate"] == pytest.approx(expected_lr)
    if "--cudagraphs" in flags and not torch.cuda.is_available():
        assert proc.stderr.count("--cudagraphs needs CUDA") == 1


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
def test_diverged_run_still_ends_with_valid_json(script, workdir):
    """A learning rate of 1e30 turns the weights into inf and NaN after the first update: the run stops
    with exit code 1 and one line saying so, and the summary says null where a number is not finite."""
    proc = run_main(script, *SHORT, "--learning-rate", "1e30", cwd=workdir)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: value_loss is nan at global step 64: the run diverged; no checkpoint was saved"], proc.stderr
    summary = summary_of(subprocess.CompletedProcess(proc.args, 0, proc.stdout, proc.stderr), workdir)  # the JSON, summary.json and metrics.csv contract of a finished run; the exit code is checked above
    assert summary["losses"]["value_loss"] is None and summary["diverged"] is True and summary["exit_code"] == 1


def test_nan_explained_variance_is_not_a_divergence(workdir):
    """One step per rollout: the returns' variance is nan, so is the explained variance; the losses are finite and
    the run ends normally, with null for that value in the summary."""
    flags = ["--env-id", "Pendulum-v1", "--num-steps", "1", "--num-minibatches", "1", "--no-norm-adv"]
    summary = summary_of(run_main(PPO, *flags, "--total-timesteps", "8", cwd=workdir), workdir)
    assert summary["global_step"] == 8 and summary["diverged"] is False
    assert summary["losses"]["explained_variance"] is None and math.isfinite(summary["losses"]["value_loss"])


def test_track_logs_to_wandb_offline(workdir):
    proc = run_main(PPO, *SHORT, "--track", cwd=workdir, env={"WANDB_MODE": "offline"})
    summary_of(proc, workdir)
    assert list((workdir / "wandb").glob("offline-run-*")), "no offline wandb run was written"


def test_episode_statistics_when_envs_finish_at_different_steps():
    """Three InvertedPendulum envs under random actions end their episodes at different steps: each
    finished episode is reported once, at the step it ends, with its length and its raw return
    (recorded before reward normalisation: v5 pays 1 for each step but the one that ends it)."""
    module = load_script(PPO)
    envs = gym.vector.SyncVectorEnv(
        [module.make_env("InvertedPendulum-v5", i, False, "test", 0.99) for i in range(3)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs.action_space.seed(0)
    envs.reset(seed=0)
    lengths = np.zeros(3, dtype=int)
    some_but_not_all = 0
    for _ in range(300):
        _, _, terminations, truncations, infos = envs.step(envs.action_space.sample())
        lengths += 1
        done = terminations | truncations
        episodes = module.finished_episodes(infos)
        assert sorted(length for _, length in episodes) == sorted(lengths[done].tolist())
        for episodic_return, length in episodes:
            assert episodic_return == length - 1
        some_but_not_all += 0 < done.sum() < 3
        lengths[done] = 0
    assert some_but_not_all > 10


def test_truncation_bootstraps_from_the_true_last_observation():
    """Pendulum ends every episode by truncation at step 200: that step's reward gains
    gamma * V(the episode's last observation, from infos["final_obs"], not the reset observation the
    step returns); every other step's reward is left alone and the critic is not asked."""
    module = load_script(PPO)
    envs = gym.vector.SyncVectorEnv(
        [module.make_env("Pendulum-v1", i, False, "test", 0.99) for i in range(2)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs.action_space.seed(0)
    envs.reset(seed=0)
    asked = []

    def get_value(obs):  # a stand-in critic: V(s) = sum of s
        asked.append(obs)
        return obs.sum(1)

    for t in range(200):
        next_obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
        bootstrapped = module.truncation_bootstrap(rewards, terminations, truncations, infos, get_value, 0.9)
        if t < 199:
            assert not asked and np.array_equal(bootstrapped, rewards)
    assert truncations.all() and not terminations.any()
    last_obs = np.stack(infos["final_obs"])
    assert len(asked) == 1 and np.array_equal(asked[0], last_obs) and not np.allclose(last_obs, next_obs)
    np.testing.assert_allclose(bootstrapped, rewards + 0.9 * last_obs.sum(1))

    # a termination is final even when the time limit falls on the same step
    final_obs = np.empty(2, dtype=object)  # as the vector env builds it: an array of arrays
    final_obs[0], final_obs[1] = np.ones(3), np.ones(3)
    infos = {"final_obs": final_obs}
    out = module.truncation_bootstrap(np.zeros(2), np.array([True, False]), np.array([True, True]), infos, lambda o: o.sum(1), 0.5)
    np.testing.assert_allclose(out, [0.0, 1.5])


def wrap(fn, mode):
    """A twin's function as main() wraps it for --compile [--cudagraphs]."""
    if mode == "twin":
        return fn
    from tensordict.nn import CudaGraphModule

    return CudaGraphModule(torch.compile(fn), warmup=3) if mode == "cudagraphs" else torch.compile(fn)


@pytest.mark.parametrize("mode", MODES)
def test_twin_gae_computes_the_eager_gae(mode):
    """The twin's log-depth scan against CleanRL's backward loop, on a rollout whose length is not a
    power of two, with episodes ending inside it and at its end."""
    eager, twin = load_script(PPO), load_script(PPO_TWIN)
    device = "cuda" if mode == "cudagraphs" else "cpu"
    gen = torch.Generator().manual_seed(0)
    gae = wrap(twin.compute_gae, mode)
    for _ in range(5 if mode == "cudagraphs" else 2):  # warm-ups, capture and replays for CUDA graphs
        rollout = [torch.randn(3, generator=gen), (torch.rand(3, generator=gen) < 0.5).float()]  # next_value, next_done
        rollout += [torch.randn(37, 3, generator=gen), torch.randn(37, 3, generator=gen), (torch.rand(37, 3, generator=gen) < 0.1).float()]
        rollout = [x.to(device) for x in rollout]  # next_value, next_done, rewards, values, dones
        expected = eager.compute_gae(*rollout, 0.99, 0.95)
        for got, want in zip(gae(*rollout, 0.99, 0.95), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the loop itself, on a case worked by hand: gamma = lambda = 1 and no dones make the advantage the
    # sum of the rewards still to come plus the bootstrap value, minus the value
    rewards, values = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[0.5], [0.25], [0.0]])
    advantages, returns = eager.compute_gae(torch.tensor([10.0]), torch.zeros(1), rewards, values, torch.zeros(3, 1), 1.0, 1.0)
    torch.testing.assert_close(advantages, torch.tensor([[15.5], [14.75], [13.0]]))
    torch.testing.assert_close(returns, torch.tensor([[16.0], [15.0], [13.0]]))


@pytest.mark.parametrize("mode", MODES)
def test_twin_update_computes_the_eager_update(mode, no_tf32):
    """Same weights, same minibatches, the same learning rates: the same losses and statistics, and
    the same weights after each Adam step (the twin's torch.func.grad and written-out Adam against
    loss.backward(), clip_grad_norm_ and torch.optim.Adam), gradient clipping active throughout."""
    device = "cuda" if mode == "cudagraphs" else "cpu"
    learners = []
    for name in (PPO, PPO_TWIN):
        module = load_script(name)
        torch.manual_seed(0)
        agent = module.Agent(5, 2, device=device)
        extra = {"compile": mode != "twin", "cudagraphs": mode == "cudagraphs"} if name == PPO_TWIN else {}
        args = module.Args(max_grad_norm=0.05, ent_coef=0.01, **extra)
        update, set_learning_rate, _ = module.make_update(args, agent)
        learners.append((agent, wrap(update, mode) if name == PPO_TWIN else update, set_learning_rate))
    gen = torch.Generator().manual_seed(1)
    for i in range(6 if mode == "cudagraphs" else 3):
        minibatch = (
            torch.randn(64, 5, generator=gen), torch.randn(64, 2, generator=gen), torch.randn(64, generator=gen) - 2.0,
            torch.randn(64, generator=gen), torch.randn(64, generator=gen), torch.randn(64, generator=gen),
        )  # obs, actions, logprobs, advantages, returns, values
        minibatch = [x.to(device) for x in minibatch]
        results = []
        for agent, update, set_learning_rate in learners:
            set_learning_rate(1e-3 / (i + 1))
            results.append(torch.stack(list(update(*minibatch))))
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
        twin_params = dict(learners[1][0].named_parameters())
        for name, p in learners[0][0].named_parameters():
            torch.testing.assert_close(twin_params[name].data, p.data, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.equal(learners[0][0].actor_logstd.data, load_script(PPO).Agent(5, 2).actor_logstd.data.to(device))  # weights moved


@pytest.mark.parametrize("compile", [False, True], ids=["twin", "twin-compile"])
@pytest.mark.parametrize("target_kl", [None, 1e-6], ids=["all-epochs", "target-kl"])
def test_twin_trains_like_the_eager_script(compile, target_kl, workdir, monkeypatch):
    """Whole runs with the same seed: 32 rollouts, learning-rate annealing and (with a tiny
    --target-kl) CleanRL's early stop after an epoch. The twin, compiled or not, takes the same
    number of gradient steps and ends with the same returns and losses as the eager script (the
    compiled policy told to draw eager's random numbers)."""
    import torch._inductor.config

    monkeypatch.chdir(workdir)
    flags = dict(env_id="Pendulum-v1", num_steps=64, num_minibatches=2, update_epochs=2, total_timesteps=2048, target_kl=target_kl)
    eager, twin = load_script(PPO), load_script(PPO_TWIN)
    want = eager.main(eager.Args(**flags))
    with torch._inductor.config.patch(fallback_random=True):
        got = twin.main(twin.Args(compile=compile, **flags))
    assert got["gradient_steps"] == want["gradient_steps"]
    if target_kl:  # the early stop cut some rollouts short after their first epoch
        assert 32 * 2 <= want["gradient_steps"] < 32 * 2 * 2
    else:
        assert want["gradient_steps"] == 32 * 2 * 2
    assert got["episodes"] == want["episodes"] == 10
    assert got["episodic_return"] == pytest.approx(want["episodic_return"], rel=1e-4)
    for key in ("value_loss", "policy_loss", "entropy", "learning_rate"):
        assert got["losses"][key] == pytest.approx(want["losses"][key], rel=1e-3, abs=1e-6), key


# the twin's check is slow and left out of the default run, as the off-policy twins' are
@pytest.mark.parametrize(
    "script, flags",
    [pytest.param(PPO, [], id="eager"), pytest.param(PPO_TWIN, ["--compile"], id="twin-compile", marks=pytest.mark.slow)],
)
def test_learns_inverted_pendulum(script, flags, workdir):
    """A reference PPO reaches 1,000 (the maximum) by 40,000 steps on this CPU; a random policy
    scores under 10. 24 rollouts of 2,048 steps here."""
    proc = run_script(script, "--env-id", "InvertedPendulum-v5", "--total-timesteps", 50_000, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert summary["global_step"] == 49_152
    assert summary["episodic_return"] >= 500, summary


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "HalfCheeta-v5"], "unknown env id 'HalfCheeta-v5': did you mean HalfCheetah-v5"),
        (["--env-id", "CartPole-v1"], "samples continuous (Box) actions, but CartPole-v1 has Discrete(2)"),
        (["--num-steps", "100", "--num-minibatches", "32"], "does not split into --num-minibatches (32) equal minibatches"),
        (["--total-timesteps", "1000"], "smaller than one rollout"),
        (["--num-steps", "64", "--num-minibatches", "64"], "minibatches of at least 2 steps"),
        (["--update-epochs", "0"], "--update-epochs must be positive"),
        (["--gamma", "1.5"], "must lie in [0, 1]"),
        (["--learning-rate", "nan"], "--learning-rate must be a positive number"),
        (["--target-kl", "-0.1"], "--target-kl must be a positive number"),
        (["--env-id", MISSING_SIMULATOR], f"cannot make {MISSING_SIMULATOR}: the simulator of this env is not installed"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(script, flags, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert_rejected(script, flags, message, capsys)


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
def test_bad_input_on_the_command_line(script, workdir):
    message = "error: this PPO samples continuous (Box) actions, but CartPole-v1 has Discrete(2): pass an env with Box actions, such as HalfCheetah-v5"
    assert_rejected_on_the_command_line(script, ["--env-id", "CartPole-v1"], message, workdir)


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
def test_help(script, workdir):
    proc = run_main(script, "--help", cwd=workdir)
    assert proc.returncode == 0
    for flag in ("--env-id", "--total-timesteps", "--num-steps", "--num-minibatches", "--target-kl", "--no-anneal-lr", "--measure-burnin", "--track"):
        assert flag in proc.stdout
    assert ("--cudagraphs" in proc.stdout) == script.endswith("_torchcompile")
