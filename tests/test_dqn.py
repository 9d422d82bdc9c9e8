"""The DQN pair: the eager script and its torch.compile twin, on the CPU (CUDA-graph modes where CUDA is)."""

import math
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
import conftest
from conftest import assert_rejected, assert_rejected_on_the_command_line, load_script, run_main, run_script, summary_of

DQN, DQN_TWIN = "dqn", "dqn_torchcompile"
# 300 steps past --learning-starts, an update every 2 of them, on CartPole-v1
SHORT = ["--env-id", "CartPole-v1", "--learning-starts", "100", "--total-timesteps", "400", "--batch-size", "32",
         "--buffer-size", "1000", "--train-frequency", "2", "--target-network-frequency", "50", "--log-every", "50"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@pytest.mark.parametrize(
    "script, flags",
    [
        (DQN, []),
        (DQN, ["--num-envs", "2"]),
        (DQN_TWIN, []),
        (DQN_TWIN, ["--compile", "--cudagraphs"]),  # on a CPU: --compile, with a warning
    ],
)
def test_short_run(script, flags, workdir):
    summary = summary_of(run_main(script, *SHORT, *flags, cwd=workdir), workdir)
    assert summary["script"] == f"{script}.py" and summary["global_step"] == 400
    assert summary["compile"] == ("--compile" in flags)
    assert summary["cudagraphs"] == ("--cudagraphs" in flags and torch.cuda.is_available())
    assert summary["episodes"] > 0 and summary["sps"] > 0 and 0 < summary["compile_seconds"] < summary["wall_seconds"]
    losses = summary["losses"]
    assert math.isfinite(losses["td_loss"]) and math.isfinite(losses["q_values"])
    assert losses["epsilon"] == pytest.approx(0.05)  # the schedule ended at step 200, half the budget


def test_transition_rows_store_the_action_and_the_true_last_observation():
    module = load_script(DQN)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=0)
    ended = 0
    for _ in range(60):
        actions = envs.action_space.sample()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        rows = module.transition_rows(obs, actions, rewards, next_obs, terminations, infos)
        assert rows.dtype == np.float32 and rows.shape == (2, 4 + 1 + 1 + 4 + 1)
        np.testing.assert_array_equal(rows[:, 4], actions)
        np.testing.assert_allclose(rows[:, -1], terminations.astype(np.float32))
        for i in np.flatnonzero(terminations | truncations):
            np.testing.assert_allclose(rows[i, 6:10], infos["final_obs"][i], rtol=1e-6)
            ended += 1
        obs = next_obs
    assert ended > 0


MODES = [
    pytest.param("twin", id="twin"),
    pytest.param("compile", id="twin-compile"),
    pytest.param("cudagraphs", id="twin-compile-cudagraphs", marks=CUDA),
]


def wrap(fn, mode):
    """The twin's update as main() wraps it for --compile [--cudagraphs]."""
    if mode == "twin":
        return fn
    from tensordict.nn import CudaGraphModule

    return CudaGraphModule(torch.compile(fn), warmup=3) if mode == "cudagraphs" else torch.compile(fn)


@pytest.mark.parametrize("mode", MODES)
def test_twin_computes_the_eager_update(mode, no_tf32):
    """Same weights, same batches: the same TD losses and mean Q-values, and the same Q-network and target after
    rounds of updates with a target update between them (six with CUDA graphs: three warm-ups, the capture,
    replays)."""
    device = "cuda" if mode == "cudagraphs" else "cpu"
    learners = []
    for name, twin in ((DQN, False), (DQN_TWIN, True)):
        module = load_script(name)
        torch.manual_seed(0)
        q_network = module.QNetwork(4, 2, device=device)
        target = module.QNetwork(4, 2, device=device)
        extra = {"cudagraphs": mode == "cudagraphs", "compile": mode != "twin"} if twin else {}
        _, (update, update_target) = module.make_updates(module.Args(tau=0.5, **extra), q_network, target)
        learners.append((q_network, target, wrap(update, mode) if twin else update, update_target))
    initial_target = [p.clone() for p in learners[0][1].parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6 if mode == "cudagraphs" else 3):
        batch = (torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64, 1), generator=gen).float(),
                 torch.randn(64, 1, generator=gen), torch.randn(64, 4, generator=gen),
                 (torch.rand(64, 1, generator=gen) < 0.1).float())
        batch = tuple(x.to(device) for x in batch)
        results = []
        for _, _, update, update_target in learners:
            results.append(torch.stack(update(*batch)))
            update_target()
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    for eager, twin in zip(learners[0][:2], learners[1][:2]):
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    for learner in learners:  # the target updates ran (tau 0.5: half way to the Q-network each time)
        assert not any(torch.equal(p, q) for p, q in zip(learner[1].parameters(), initial_target))


@pytest.mark.parametrize(
    "name, flags",
    [
        pytest.param(DQN, [], id="eager"),
        pytest.param(DQN_TWIN, ["--compile"], id="twin-compile"),
        pytest.param(DQN_TWIN, ["--compile", "--cudagraphs"], id="twin-compile-cudagraphs", marks=CUDA),
    ],
)
def test_epsilon_follows_its_schedule(name, flags, workdir, monkeypatch):
    """The fraction of random actions follows the linear schedule in the scripts themselves: a Q-network whose
    greedy action is always 0 (and a learning rate too small to change that) takes action 1 only when it explores,
    half the time. Epsilon falls from 1 to 0.05 over the first 1,000 of 2,000 steps. A policy that kept epsilon at
    its first value, as a CUDA graph captured with epsilon as a number does, would take action 1 half the time."""
    module = load_script(name)
    init = module.QNetwork.__init__

    def greedy_zero(self, n_obs, n_act, device=None):
        init(self, n_obs, n_act, device=device)
        if device != "meta":
            with torch.no_grad():
                self.network[-1].weight.zero_()
                self.network[-1].bias.copy_(torch.tensor([10.0, 0.0]))

    monkeypatch.setattr(module.QNetwork, "__init__", greedy_zero)
    monkeypatch.setattr(conftest, "load_script", lambda name: module)  # run_main runs this module
    taken = []
    step = gym.vector.SyncVectorEnv.step
    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", lambda self, a: taken.append(int(a[0])) or step(self, a))
    flags = [*flags, "--total-timesteps", "2000", "--learning-starts", "1000", "--learning-rate", "1e-30"]
    summary_of(run_main(name, "--env-id", "CartPole-v1", *flags, cwd=workdir), workdir)
    taken = np.array(taken)
    for start, end in ((0, 500), (500, 1000), (1000, 2000)):
        expected = np.mean([max(1.0 - 0.95 * t / 1000, 0.05) for t in range(start, end)]) / 2
        assert abs(taken[start:end].mean() - expected) < 0.08, (start, end, taken[start:end].mean(), expected)


def test_compile_seconds_counts_a_policy_that_compiles_at_the_first_step(workdir, monkeypatch):
    """The twin's policy acts from the first step, so it compiles there, long before the first update: a first
    acting call that takes a second (a stand-in for that compile) counts in compile_seconds."""
    module = load_script(DQN)
    act, calls = module.epsilon_greedy, []

    def slow_first_call(*args):
        if not calls:
            time.sleep(1.0)
        calls.append(1)
        return act(*args)

    monkeypatch.setattr(module, "epsilon_greedy", slow_first_call)
    monkeypatch.setattr(conftest, "load_script", lambda name: module)  # run_main runs this module
    summary = summary_of(run_main(DQN, *SHORT, "--measure-burnin", "5", cwd=workdir), workdir)
    assert 1.0 <= summary["compile_seconds"] < summary["wall_seconds"] and summary["sps"] > 0


@pytest.mark.parametrize(
    "script, flags, message",
    [
        (DQN, ["--env-id", "Pendulum-v1"], "DQN needs a discrete action space, but Pendulum-v1 has Box"),
        (DQN_TWIN, ["--env-id", "Pendulum-v1"], "use SAC, TD3 or PPO"),
        (DQN, ["--train-frequency", "0"], "--train-frequency must be positive, got 0"),
        (DQN, ["--start-e", "0.1", "--end-e", "0.5"], "epsilon falls from --start-e (0.1) to --end-e (0.5)"),
        (DQN, ["--exploration-fraction", "0"], "--exploration-fraction must lie in (0, 1], got 0.0"),
        (DQN, ["--total-timesteps", "1000", "--learning-starts", "1000"], "must be larger than --learning-starts"),
        (DQN_TWIN, ["--learning-rate", "nan"], "--learning-rate must be a positive number, got nan"),
        (DQN, ["--save-buffer"], "--save-buffer needs --save-model"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(script, flags, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert_rejected(script, flags, message, capsys)


def test_actions_that_do_not_start_at_0_are_one_line(workdir, monkeypatch, capsys):
    module = load_script(DQN)
    spaces = gym.spaces.Box(-1.0, 1.0, (4,)), gym.spaces.Discrete(3, start=1)
    monkeypatch.setattr(module, "env_spaces", lambda env_id: spaces)
    monkeypatch.setattr(conftest, "load_script", lambda name: module)  # assert_rejected runs this module
    monkeypatch.chdir(workdir)
    assert_rejected(DQN, [], "DQN's actions are 0 to n-1, but CartPole-v1 has Discrete(3, start=1)", capsys)


@pytest.mark.parametrize("script", [DQN, DQN_TWIN])
def test_bad_input_on_the_command_line(script, workdir):
    assert_rejected_on_the_command_line(script, ["--env-id", "CartPol-v1"], "error: unknown env id 'CartPol-v1'", workdir)


@pytest.mark.parametrize("script", [DQN, DQN_TWIN])
def test_help(script, workdir):
    proc = run_main(script, "--help", cwd=workdir)
    assert proc.returncode == 0
    for flag in ("--env-id", "--exploration-fraction", "--train-frequency", "--save-buffer", "--measure-burnin"):
        assert flag in proc.stdout
    assert ("--cudagraphs" in proc.stdout) == script.endswith("_torchcompile")


# Returns (2-core CPU, torch 2.13, 2026-11-23): seed 1 at 100k 180.2, at 150k 341.5; at 200k seeds 1-3 451.9, 500.0,
# 500.0, but the twin's --compile (other random draws: inductor's own generator) 357.1 for seed 1; at 250k seeds
# 1-3 and the twin's seed 1 all 500.0. 200k is the edge, 250k the budget with a margin
BUDGET = 250_000


@pytest.mark.parametrize(
    "script, flags, seed",
    [
        pytest.param(DQN, [], 1, id="eager-1"),
        pytest.param(DQN, [], 2, marks=pytest.mark.slow, id="eager-2"),
        pytest.param(DQN, [], 3, marks=pytest.mark.slow, id="eager-3"),
        pytest.param(DQN_TWIN, ["--compile"], 1, marks=pytest.mark.slow, id="twin-compile-1"),
    ],
)
def test_learns_cartpole(script, flags, seed, workdir):
    """CleanRL's DQN reaches 488.69 +- 16.11 at 500k steps; with its hyper-parameters and a BUDGET-step run (the
    epsilon schedule spans half of it) the last 10 training episodes average 400 or more for seeds 1-3."""
    proc = run_script(script, *flags, "--total-timesteps", BUDGET, "--seed", seed, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert summary["episodic_return"] >= 400, summary
