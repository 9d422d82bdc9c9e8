"""PPO on envpool's Atari: the eager script and its torch.compile twin, on the CPU."""

import math

import numpy as np
import pytest
import torch
from conftest import assert_rejected, assert_rejected_on_the_command_line, load_script, run_main, run_script, summary_of

envpool = pytest.importorskip("envpool", reason="envpool is not installed: pip install -r requirements/requirements-atari.txt")

PPO, PPO_TWIN = "ppo_atari_envpool", "ppo_atari_envpool_torchcompile"
SUMMARY_KEYS = {
    "script", "env_id", "seed", "compile", "cudagraphs", "device", "global_step", "wall_seconds",
    "compile_seconds", "sps", "episodic_return", "episodes", "gradient_steps",
}
# 4 rollouts of 2 envs x 32 steps, each 4 epochs of 2 minibatches
SHORT = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "256"]
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
        (PPO, ["--no-anneal-lr", "--no-clip-vloss", "--no-norm-adv", "--ent-coef", "0"]),
        (PPO_TWIN, []),
        (PPO_TWIN, ["--compile"]),
        (PPO_TWIN, ["--compile", "--cudagraphs"]),
        (PPO_TWIN, ["--cudagraphs"]),
    ],
)
def test_short_run(script, flags, workdir):
    proc = run_main(script, *SHORT, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["script"] == f"{script}.py" and summary["env_id"] == "Breakout-v5"
    assert summary["compile"] == ("--compile" in flags)
    assert summary["cudagraphs"] == ("--cudagraphs" in flags and torch.cuda.is_available())
    assert summary["global_step"] == 256
    assert summary["gradient_steps"] == 4 * 4 * 2  # every epoch of every rollout ran
    assert summary["sps"] > 0 and summary["compile_seconds"] >= 0 and summary["wall_seconds"] > 0
    losses = summary["losses"]
    assert all(math.isfinite(losses[k]) for k in ("value_loss", "policy_loss", "entropy", "approx_kl", "clipfrac"))
    # a near-uniform policy over Breakout's 4 actions after 32 small steps
    assert 1.0 < losses["entropy"] <= math.log(4) + 1e-6
    expected_lr = 2.5e-4 if "--no-anneal-lr" in flags else 2.5e-4 / 4  # the last of 4 rollouts
    assert losses["learning_rate"] == pytest.approx(expected_lr)
    if "--cudagraphs" in flags and not torch.cuda.is_available():
        assert proc.stderr.count("--cudagraphs needs CUDA") == 1


def fake_infos(reward, game_over, elapsed):
    return {
        "reward": np.asarray(reward, dtype=np.float64),
        "terminated": np.asarray(game_over, dtype=np.int32),
        "elapsed_step": np.asarray(elapsed, dtype=np.int32),
    }


def test_game_statistics_sum_unclipped_rewards_across_lives():
    """A lost life (a termination for the learner) does not end the game: the score sums the
    unclipped rewards of all its lives, and game over or the time limit ends it and starts a new count.
    A game's length is envpool's elapsed_step when it ends (reset steps do not count)."""
    games = load_script(PPO).GameStatistics(2)
    no = np.zeros(2, dtype=bool)
    assert games.update(no, fake_infos([4.0, 1.0], [0, 0], [1, 1])) == []  # rewards of 4 arrive clipped to 1 for the learner
    assert games.update(no, fake_infos([7.0, 0.0], [0, 0], [2, 2])) == []  # env 0 loses a life here: not a game over
    assert games.update(no, fake_infos([0.0, 0.0], [0, 0], [2, 3])) == []  # env 0's reset step after the lost life
    assert games.update(no, fake_infos([1.0, 0.0], [1, 0], [3, 4])) == [(12.0, 3)]  # env 0's game over
    assert games.update(no, fake_infos([0.0, 0.0], [0, 0], [0, 5])) == []  # env 0's reset step pays nothing
    assert games.update(np.array([False, True]), fake_infos([1.0, 2.0], [0, 0], [1, 6])) == [(3.0, 6)]  # env 1's time limit
    assert games.update(np.array([True, True]), fake_infos([0.0, 5.0], [0, 0], [2, 1])) == [(1.0, 2), (5.0, 1)]  # both: a fresh count


def test_game_statistics_on_envpool_games():
    """Real Breakout games under random play, with a time limit short enough that some games end by
    it: every game over and every time limit reports one game, no lost life does, the reported
    scores plus the games in progress add up to all the unclipped reward paid, and each game's length
    is the number of steps that acted in it (counted here: every step but those right after a done)."""
    module = load_script(PPO)
    envs = envpool.make("Breakout-v5", env_type="gymnasium", num_envs=3, episodic_life=True, reward_clip=True, seed=3, max_episode_steps=150)
    games = module.GameStatistics(3)
    envs.reset()
    rng = np.random.default_rng(0)
    reported, paid, lives_lost, game_overs, time_limits = [], 0.0, 0, 0, 0
    acted, after_done = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=bool)
    for _ in range(1500):
        _, _, terminations, truncations, infos = envs.step(rng.integers(0, 4, size=3))
        acted += ~after_done
        finished = games.update(truncations, infos)
        game_over = infos["terminated"].astype(bool)
        ended = game_over | truncations
        assert len(finished) == ended.sum()
        assert [length for _, length in finished] == acted[ended].tolist()
        acted[ended] = 0
        after_done = terminations | truncations
        reported += [score for score, _ in finished]
        paid += infos["reward"].sum()
        lives_lost += (terminations & ~game_over).sum()
        game_overs += game_over.sum()
        time_limits += (truncations & ~game_over).sum()
    assert game_overs > 0 and time_limits > 0 and lives_lost > 3 * game_overs
    assert sum(reported) + games.returns.sum() == pytest.approx(paid)
    assert paid > 0  # random play scores now and then


def test_standard_atari_settings_and_frames_as_bytes():
    """CleanRL's envpool settings, and observations that stay uint8 up to the network (a quarter of
    float32's bytes on the way to the device), which scales them to [0, 1] itself."""
    module = load_script(PPO)
    envs = module.make_envs("Pong-v5", 2, 1)
    config = envs.spec.config
    assert (config.episodic_life, config.reward_clip, config.use_fire_reset) == (True, True, True)
    assert (config.stack_num, config.frame_skip, config.noop_max, config.max_episode_steps) == (4, 4, 30, 27_000)
    assert (config.img_height, config.img_width, config.repeat_action_probability) == (84, 84, 0.0)
    obs, _ = envs.reset()
    assert obs.dtype == np.uint8 and obs.shape == (2, 4, 84, 84) and envs.single_action_space.n == 6
    torch.manual_seed(0)
    agent = module.Agent(6)
    x = torch.as_tensor(obs)
    _, _, _, value = agent.get_action_and_value(x)
    torch.testing.assert_close(value, agent.critic(agent.network(x.float() / 255)))


def test_sampling_follows_the_policy():
    """The written-out categorical (Gumbel-max sampling, log-probabilities and entropy) against
    torch.distributions.Categorical, with the network's features replaced by zeros so that the
    policy is the softmax of the actor's bias."""
    module = load_script(PPO)
    torch.manual_seed(0)
    agent = module.Agent(3)
    del agent.network
    agent.network = lambda x: torch.zeros(len(x), 512)
    probs = torch.tensor([0.2, 0.3, 0.5])
    with torch.no_grad():
        agent.actor.bias.copy_(probs.log())
        action, log_prob, entropy, _ = agent.get_action_and_value(torch.zeros(40_000, 1, dtype=torch.uint8))
    dist = torch.distributions.Categorical(probs=probs)
    torch.testing.assert_close(log_prob, dist.log_prob(action))
    torch.testing.assert_close(entropy, dist.entropy().expand(40_000))
    freq = torch.bincount(action, minlength=3) / 40_000
    torch.testing.assert_close(freq, probs, atol=4 * (0.25 / 40_000) ** 0.5, rtol=0)  # within 4 standard errors


def test_compiled_policy_samples_the_policy():
    """The twin's acting policy compiled as main() compiles it on a CPU: inductor draws its own random
    numbers, so its actions are compared in distribution (each env's action frequencies against the
    softmax, within 4.5 standard errors) and the log-probs, entropies and values it returns against
    eager's for the same actions."""
    twin = load_script(PPO_TWIN)
    torch.manual_seed(0)
    agent = twin.Agent(4).to(memory_format=torch.channels_last)
    with torch.no_grad():
        agent.actor.weight.mul_(300)  # a policy far from uniform, different in each env
    obs = torch.randint(0, 256, (8, 4, 84, 84), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    policy = torch.compile(agent.get_action_and_value, options={"cpp_wrapper": True})
    n = 2000
    counts = torch.zeros(8, 4)
    with torch.no_grad():
        probs = agent.actor(agent.network(obs / 255.0)).softmax(-1)
        assert probs.max() < 0.95 and (probs.max(-1).values > 0.35).all()  # far from uniform (0.25)
        for _ in range(n):
            action, log_prob, entropy, value = policy(obs)
            counts[torch.arange(8), action] += 1
        _, want_log_prob, want_entropy, want_value = agent.get_action_and_value(obs, action)
    torch.testing.assert_close(log_prob, want_log_prob, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(value, want_value, rtol=1e-4, atol=1e-5)
    standard_error = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 4.5 * standard_error + 1e-3).all(), (counts / n, probs)


def wrap(fn, mode):
    """A twin's function as main() wraps it for --compile [--cudagraphs]."""
    if mode == "twin":
        return fn
    from tensordict.nn import CudaGraphModule

    return CudaGraphModule(torch.compile(fn), warmup=3) if mode == "cudagraphs" else torch.compile(fn)


@pytest.mark.parametrize("mode", MODES)
def test_twin_gae_computes_the_eager_gae(mode):
    """The twin's log-depth scan against the backward loop, over 128 steps of 8 envs with lives
    lost inside the rollout and at its end."""
    eager, twin = load_script(PPO), load_script(PPO_TWIN)
    device = "cuda" if mode == "cudagraphs" else "cpu"
    gen = torch.Generator().manual_seed(0)
    gae = wrap(twin.compute_gae, mode)
    for _ in range(5 if mode == "cudagraphs" else 2):  # warm-ups, capture and replays for CUDA graphs
        rollout = [torch.randn(8, generator=gen), (torch.rand(8, generator=gen) < 0.5).float()]  # next_value, next_done
        rollout += [torch.randn(128, 8, generator=gen), torch.randn(128, 8, generator=gen), (torch.rand(128, 8, generator=gen) < 0.02).float()]
        rollout = [x.to(device) for x in rollout]  # next_value, next_done, rewards, values, dones
        expected = eager.compute_gae(*rollout, 0.99, 0.95)
        for got, want in zip(gae(*rollout, 0.99, 0.95), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_twin_update_computes_the_eager_update(mode, no_tf32):
    """Same weights, same minibatches of frames, the same learning rates: the same losses and
    statistics, and the same weights after each Adam step (the twin's torch.func.grad and
    written-out Adam against loss.backward(), clip_grad_norm_ and torch.optim.Adam)."""
    device = "cuda" if mode == "cudagraphs" else "cpu"
    memory_format = torch.channels_last if device == "cpu" else torch.contiguous_format  # as main() lays them out
    learners = []
    for name in (PPO, PPO_TWIN):
        module = load_script(name)
        torch.manual_seed(0)
        agent = module.Agent(4, device=device).to(memory_format=memory_format)
        extra = {"compile": mode != "twin", "cudagraphs": mode == "cudagraphs"} if name == PPO_TWIN else {}
        update, set_learning_rate, _ = module.make_update(module.Args(**extra), agent)
        learners.append((agent, wrap(update, mode) if name == PPO_TWIN else update, set_learning_rate))
    initial = {name: p.detach().clone() for name, p in learners[0][0].named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for i in range(5 if mode == "cudagraphs" else 2):  # 3 warm-ups, the capture, a replay
        minibatch = (
            torch.randint(0, 256, (16, 4, 84, 84), generator=gen, dtype=torch.uint8).contiguous(memory_format=memory_format),
            torch.randint(0, 4, (16,), generator=gen), torch.randn(16, generator=gen) - 1.4,
            torch.randn(16, generator=gen), torch.randn(16, generator=gen), torch.randn(16, generator=gen),
        )  # obs, actions, logprobs, advantages, returns, values
        minibatch = [x.to(device) for x in minibatch]
        results = []
        for agent, update, set_learning_rate in learners:
            set_learning_rate(1e-3 / (i + 1))
            results.append(torch.stack(list(update(*minibatch))))
        torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-6)
        twin_params = dict(learners[1][0].named_parameters())
        for name, p in learners[0][0].named_parameters():
            torch.testing.assert_close(twin_params[name].data, p.data, rtol=1e-4, atol=1e-6)
    assert all(not torch.equal(p, initial[name]) for name, p in learners[0][0].named_parameters())  # every weight moved


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
def test_optimiser_state_from_another_layout_takes_the_weights_layout(script):
    """A checkpoint written on a GPU (contiguous Adam moments) resumed on a CPU (channels-last weights): each
    restored moment holds its saved values in its weight's memory format, as fused Adam (eager) pairs elements in
    memory order and the twin's compiled code and CUDA graphs keep reading their own tensors."""
    module = load_script(script)
    torch.manual_seed(0)
    agent = module.Agent(4).to(memory_format=torch.channels_last)
    update, _, optimizer = module.make_update(module.Args(), agent)
    gen = torch.Generator().manual_seed(1)
    obs = torch.randint(0, 256, (8, 4, 84, 84), generator=gen, dtype=torch.uint8)
    update(obs.contiguous(memory_format=torch.channels_last), torch.randint(0, 4, (8,), generator=gen),
           *torch.randn(4, 8, generator=gen))  # a first step gives Adam's moments values
    saved = torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, optimizer.state_dict())
    gpu_layout = torch.utils._pytree.tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, saved)
    optimizer.load_state_dict(gpu_layout)
    restored = [x for x in torch.utils._pytree.tree_leaves(optimizer.state_dict()) if isinstance(x, torch.Tensor)]
    weights = {p.shape: p for p in agent.parameters()}
    for tensor, want in zip(restored, [x for x in torch.utils._pytree.tree_leaves(saved) if isinstance(x, torch.Tensor)]):
        assert torch.equal(tensor, want)
        if tensor.dim() == 4:  # a convolution's moment
            assert tensor.stride() == weights[tensor.shape].stride() != want.contiguous().stride()


@pytest.mark.parametrize("target_kl", [None, 1e-4], ids=["all-epochs", "target-kl"])
def test_twin_trains_like_the_eager_script(target_kl, workdir, monkeypatch):
    """Whole runs with the same seed: 6 rollouts with learning-rate annealing and, with a small
    --target-kl, the early stop after an epoch. The twin takes the same number of gradient steps
    and ends with the same losses as the eager script."""
    monkeypatch.chdir(workdir)
    flags = dict(num_envs=2, num_steps=32, num_minibatches=2, total_timesteps=384, target_kl=target_kl)
    eager, twin = load_script(PPO), load_script(PPO_TWIN)
    want = eager.main(eager.Args(**flags))
    got = twin.main(twin.Args(**flags))
    assert got["gradient_steps"] == want["gradient_steps"]
    if target_kl:  # the early stop cut some rollouts short
        assert want["gradient_steps"] < 6 * 4 * 2
    else:
        assert want["gradient_steps"] == 6 * 4 * 2
    assert got["episodes"] == want["episodes"] and got["episodic_return"] == want["episodic_return"]
    # One update is compared tightly above. Over 48 Adam steps the two roundings (fused Adam and
    # autograd against Adam written out and torch.func.grad) drift apart by up to ~1e-5 in float32
    # (~1e-8 when both run in float64): Adam turns rounding noise in near-zero gradients into whole
    # steps. The losses are near-zero means of O(1) terms, so the bound is absolute
    for key in ("value_loss", "policy_loss", "entropy", "approx_kl", "learning_rate"):
        assert got["losses"][key] == pytest.approx(want["losses"][key], rel=1e-3, abs=1e-4), key


@pytest.mark.slow
@pytest.mark.parametrize("script, flags", [(PPO, []), (PPO_TWIN, ["--compile"])], ids=["eager", "twin-compile"])
def test_learns_breakout(script, flags, workdir):
    """Breakout with 8 envs: a reference PPO's whole-game score goes from about 1.5 (random play) to
    about 7-8 over the first 200,000 steps of a default (10M-step) run on this CPU. Those steps see an
    almost constant learning rate (annealing over 10M steps has taken off 2% by then), hence
    --no-anneal-lr: with a 200,000-step budget annealing halves the mean learning rate (annealed eager
    runs stayed at 2.0-4.3 on four seeds; unannealed, seeds 1 and 2 end at 5.8 and 7.5). 15-20
    minutes per run on 2 cores, so it runs only when asked for: python -m pytest tests -m slow"""
    proc = run_script(script, "--total-timesteps", 200_000, "--no-anneal-lr", *flags, cwd=workdir, timeout=1800)
    summary = summary_of(proc, workdir)
    assert summary["global_step"] == 199_680
    assert summary["episodic_return"] >= 5, summary


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "Breakout-v4"], "'Breakout-v4' is not an envpool Atari game: did you mean Breakout-v5"),
        (["--env-id", "Braekout-v5"], "did you mean Breakout-v5"),
        (["--env-id", "CartPole-v1"], "'CartPole-v1' is not an envpool Atari game"),
        (["--num-steps", "100", "--num-minibatches", "3"], "does not split into --num-minibatches (3) equal minibatches: pick a divisor of 800"),
        (["--total-timesteps", "1000"], "smaller than one rollout of --num-envs * --num-steps (1024)"),
        (["--num-envs", "0"], "--num-envs must be positive"),
        (["--seed", "-1"], "--seed must lie in [0, 2**31)"),
        (["--clip-coef", "inf"], "--clip-coef must be a positive number"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(script, flags, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert_rejected(script, flags, message, capsys)


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
def test_bad_input_on_the_command_line(script, workdir):
    message = "error: 'Pong' is not an envpool Atari game: did you mean Pong-v5?"
    assert_rejected_on_the_command_line(script, ["--env-id", "Pong"], message, workdir)


@pytest.mark.parametrize("script", [PPO, PPO_TWIN])
def test_help(script, workdir):
    proc = run_main(script, "--help", cwd=workdir)
    assert proc.returncode == 0
    for flag in ("--env-id", "--total-timesteps", "--num-envs", "--num-minibatches", "--target-kl", "--no-anneal-lr", "--track"):
        assert flag in proc.stdout
    assert ("--cudagraphs" in proc.stdout) == script.endswith("_torchcompile")
