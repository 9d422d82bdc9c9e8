"""Data-parallel PPO on envpool's Atari over torch.distributed: on the CPU, with gloo.

Several processes are launched as users launch them, with torchrun (`python -m
torch.distributed.run`, the same program), on this machine's 2 cores."""

import json
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import LEANRL, assert_rejected, assert_rejected_on_the_command_line, load_script, run_main, summary_of

envpool = pytest.importorskip("envpool", reason="envpool is not installed: pip install -r requirements/requirements-atari.txt")

SINGLE, SINGLE_TWIN = "ppo_atari_envpool", "ppo_atari_envpool_torchcompile"
MULTI, MULTI_TWIN = "ppo_atari_envpool_multigpu", "ppo_atari_envpool_multigpu_torchcompile"
# per process: 2 envs x 32 steps, 2 minibatches, 4 epochs
SHORT = ["--env-id", "Pong-v5", "--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2"]
MODES = [
    pytest.param("twin", id="twin"),
    pytest.param("compile", id="twin-compile"),
    pytest.param(
        "cudagraphs", id="twin-compile-cudagraphs",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
    ),
]


@pytest.fixture(autouse=True)
def lone_process(monkeypatch):
    """main() run in this process forms a group of one process: no torchrun variables, and no group
    left behind by a test that failed half-way."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(name, *flags, nproc=2, launch=None, cwd, timeout=600, popen=False):
    """Launches leanrl/<name>.py with torchrun on this machine: --standalone, or `launch` in its place."""
    launch = launch or ["--standalone"]
    # --no-cuda: processes on the CPU (gloo), however many GPUs this machine has (each process would take its own)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc_per_node", str(nproc), str(LEANRL / f"{name}.py"), *map(str, flags), "--no-cuda"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if popen:  # in a session of its own, so that a test can signal the whole group as a Ctrl-C does
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check_both_processes(summary, total, flags_per_process=(2, 32, 2)):
    """The summary of a 2-process run: both processes' steps counted, every iteration's updates run,
    and the weights of the two processes identical to the bit."""
    envs, steps, minibatches = flags_per_process
    assert summary["world_size"] == 2 and summary["local_num_envs"] == envs
    assert summary["global_step"] == total // (2 * envs * steps) * 2 * envs * steps
    assert summary["gradient_steps"] == total // (2 * envs * steps) * 4 * minibatches
    checksums = summary["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
    assert summary["sps"] > 0 and summary["device"] == "cpu"


@pytest.mark.parametrize(
    "name, flags", [(MULTI, ["--backend", "gloo"]), (MULTI_TWIN, ["--compile"])], ids=["eager-gloo", "twin-compile"]
)
def test_two_processes(name, flags, workdir):
    """torchrun with 2 processes: one summary (rank 0's, the only line on stdout) that counts both
    processes' steps, and weights that are bitwise equal in both processes at the end."""
    proc = torchrun(name, *SHORT, "--total-timesteps", 1024, *flags, cwd=workdir)
    summary = summary_of(proc, workdir)
    assert proc.stdout.strip().count("\n") == 0, proc.stdout[-2000:]
    check_both_processes(summary, 1024)
    assert summary["compile"] == ("--compile" in flags)
    assert all(math.isfinite(v) for k, v in summary["losses"].items() if k != "explained_variance")


@pytest.mark.slow
def test_learns_breakout_on_two_processes(workdir):
    """CleanRL's Atari setting split over 2 processes (4 games each, so 8 in all, the batch of the
    single-process script): the whole-game score climbs as ppo_atari_envpool.py's does in the same
    200,000 steps at a constant learning rate (5.8, 7.5 and 8.1 there on seeds 1-3). One seed is too
    noisy a measure at this budget (here seed 1 ends at 2.2, seed 2 at 10.0, seed 3 at 6.5), so the
    check is the mean of two. About 10 minutes a seed on 2 cores, so it runs only when asked for:
    python -m pytest tests -m slow"""
    returns = []
    for seed in (1, 2):
        proc = torchrun(MULTI, "--local-num-envs", 4, "--total-timesteps", 200_000, "--no-anneal-lr", "--seed", seed, cwd=workdir, timeout=2400)
        summary = summary_of(proc, workdir)
        check_both_processes(summary, 200_000, flags_per_process=(4, 128, 4))
        returns.append(summary["episodic_return"])
    assert sum(returns) / 2 >= 5, returns


def test_launch_across_machines(workdir):
    """The README's form for several machines, two machines of one process each played here by two
    torchrun agents that meet at a c10d rendezvous on localhost: one run of 2 processes, whose
    summary comes from whichever agent holds rank 0."""
    port = free_port()
    launch = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "leanrl-test"]
    agents = [torchrun(MULTI, *SHORT, "--total-timesteps", 512, nproc=1, launch=launch, cwd=workdir, popen=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    lines = [out.strip().splitlines() for out, _ in outputs]
    assert sorted(len(x) for x in lines) == [0, 1], lines  # rank 0's summary, and nothing from rank 1
    summary = json.loads(next(x for x in lines if x)[-1])
    check_both_processes(summary, 512)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's thread names from Linux's /proc")
@pytest.mark.parametrize("name", [MULTI, MULTI_TWIN])
def test_process_group_is_released_at_the_end(name, workdir):
    """When main() returns, the process group is gone, gloo's threads with it. A gloo thread left
    alive can still be releasing the last collective's tensors when the interpreter shuts down, and
    that aborts the process (SIGABRT after the summary: CI saw it once in a few runs of two
    processes). It stays alive when torch.distributed.nn.functional is first imported after
    init_process_group, so this runs in a fresh interpreter: the import order is what is tested."""
    flags = [*SHORT, "--total-timesteps", 128, "--eval-episodes", 0]
    code = "\n".join([
        "import json, os, sys, tyro",
        f"sys.path.insert(0, {str(LEANRL)!r})",
        f"import {name} as script",
        f"script.main(tyro.cli(script.Args, args={list(map(str, flags))!r}))",
        "print(json.dumps(sorted(open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task'))))",
    ])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env={**env, "WANDB_MODE": "disabled"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-2])["global_step"] == 128
    threads = json.loads(lines[-1])
    assert threads and not [t for t in threads if "gloo" in t], threads


def test_machines_with_different_commands_stop_with_one_line(workdir):
    """Two machines (two torchrun agents) launched with different seeds: every process stops before
    training, and rank 0 names the argument that differs."""
    port = free_port()
    launch = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "leanrl-test"]
    agents = [torchrun(MULTI, *SHORT, "--total-timesteps", 512, "--seed", seed, nproc=1, launch=launch, cwd=workdir, popen=True) for seed in (1, 2)]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    assert all(agent.returncode != 0 for agent in agents)
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: the processes were launched with different --seed: give every machine the same command"], errors
    assert not (workdir / "runs").exists()


def test_interrupted_processes_stop_together_and_resume(workdir):
    """A Ctrl-C to torchrun's process group (torchrun passes it on to its processes): all finish the
    same iteration, rank 0 writes the checkpoint (with each process's generators) and the summary,
    and torchrun's 2 processes resume it to the end of the budget."""
    total = 2560
    proc = torchrun(MULTI, *SHORT, "--total-timesteps", total, "--save-model", "--eval-episodes", "1", cwd=workdir, popen=True)
    deadline = time.monotonic() + 300
    while not list(workdir.glob("runs/*/metrics.csv")) or len(next(workdir.glob("runs/*/metrics.csv")).read_text().splitlines()) < 4:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no 3 iterations logged in 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert out.strip(), err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["exit_code"] == 130, err[-3000:]
    assert 0 < summary["global_step"] < total and summary["global_step"] % 128 == 0
    assert summary["eval_return"] is None and "is not evaluated after a signal" in err
    assert summary["param_checksums"][0] == summary["param_checksums"][1]
    checkpoint = torch.load(workdir / summary["checkpoint"], weights_only=True)
    assert len(checkpoint["rng"]) == 2  # a generator state per process
    assert not torch.equal(checkpoint["rng"][0]["torch"], checkpoint["rng"][1]["torch"])  # each process its own generator

    resumed = summary_of(torchrun(MULTI, "--resume", workdir / summary["checkpoint"], "--eval-episodes", "1",
                                  cwd=workdir), workdir)
    assert resumed["run_name"] == summary["run_name"] and resumed["resumes"] == 1
    assert resumed["global_step"] == total // 128 * 128 and resumed["interrupted"] is False
    assert resumed["param_checksums"][0] == resumed["param_checksums"][1]
    assert resumed["episodes"] >= summary["episodes"]


def test_divergence_in_any_process_stops_all(workdir):
    """A learning rate of 1e30: the processes agree to stop at the same log point, one error line
    (rank 0's) names the loss and the step, and the summary says diverged."""
    proc = torchrun(MULTI, *SHORT, "--total-timesteps", 1024, "--learning-rate", "1e30", cwd=workdir)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["diverged"] is True and summary["exit_code"] == 1 and summary["world_size"] == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"at global step {summary['global_step']}: the run diverged" in errors[0], proc.stderr[-3000:]


@pytest.mark.parametrize("single, multi", [(SINGLE, MULTI), (SINGLE_TWIN, MULTI_TWIN)], ids=["eager", "twin"])
def test_one_process_runs_the_single_process_script(single, multi, workdir, monkeypatch):
    """Run as one process (no torchrun), the script is the single-process script: same seed, same
    games, the same losses, to the bit for the eager pair (the all-reduce of one process and the
    division by 1 change nothing). The twin's flat gradients come back in the weights' logical
    layout, not the CPU's channels-last one, so the gradient norm sums in another order: its losses
    agree to rounding, as the twin's agree with the eager script's."""
    monkeypatch.chdir(workdir)
    flags = dict(env_id="Breakout-v5", num_steps=32, num_minibatches=2, total_timesteps=512, target_kl=0.02)
    want = load_script(single).main(load_script(single).Args(num_envs=2, **flags))
    module = load_script(multi)
    got = module.main(module.Args(local_num_envs=2, **flags))
    assert got["world_size"] == 1 and len(got["param_checksums"]) == 1
    for key in ("global_step", "episodes", "episodic_return", "gradient_steps"):
        assert got[key] == want[key], key
    assert want["episodes"] > 0
    if single == SINGLE:
        assert got["losses"] == want["losses"]
    for key in ("value_loss", "policy_loss", "entropy", "approx_kl", "learning_rate"):
        assert got["losses"][key] == pytest.approx(want["losses"][key], rel=1e-3, abs=1e-4), key


def _update_in_process(rank, store_path, minibatch, out_path):
    """One process of a 2-process group: the gradient step on its half of the minibatch."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    module = load_script(MULTI)
    torch.manual_seed(0)
    agent = module.Agent(4)
    compute_grads, apply_grads, set_learning_rate, _ = module.make_update(module.Args(norm_adv=False), agent, 2)
    set_learning_rate(1e-3)
    half = [x.chunk(2)[rank] for x in minibatch]
    grads, stats = compute_grads(*half)
    dist.all_reduce(grads)
    apply_grads(grads)
    torch.save({"params": {k: p.detach() for k, p in agent.named_parameters()}}, out_path)
    dist.destroy_process_group()


def test_gradients_are_averaged_over_processes(workdir):
    """Two processes with half a minibatch each take the step that one process takes on the whole
    minibatch: the losses are means over equal halves (without per-minibatch advantage
    normalisation), so the mean of the halves' gradients is the whole's gradient. A sum, or no
    all-reduce at all, would give other weights."""
    gen = torch.Generator().manual_seed(1)
    minibatch = (
        torch.randint(0, 256, (16, 4, 84, 84), generator=gen, dtype=torch.uint8),
        torch.randint(0, 4, (16,), generator=gen), torch.randn(16, generator=gen) - 1.4,
        torch.randn(16, generator=gen), torch.randn(16, generator=gen), torch.randn(16, generator=gen),
    )  # obs, actions, logprobs, advantages, returns, values
    ctx = multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=_update_in_process, args=(rank, workdir / "store", minibatch, workdir / f"{rank}.pt")) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=300)
        assert p.exitcode == 0
    module = load_script(MULTI)
    torch.manual_seed(0)
    agent = module.Agent(4)
    compute_grads, apply_grads, set_learning_rate, _ = module.make_update(module.Args(norm_adv=False), agent, 1)
    set_learning_rate(1e-3)
    initial = {k: p.detach().clone() for k, p in agent.named_parameters()}
    grads, _ = compute_grads(*minibatch)
    apply_grads(grads)
    results = [torch.load(workdir / f"{rank}.pt", weights_only=True)["params"] for rank in range(2)]
    for name, p in agent.named_parameters():
        assert torch.equal(results[0][name], results[1][name]), name  # the same bytes in both processes
        torch.testing.assert_close(results[0][name], p.detach(), rtol=1e-4, atol=1e-6)
        assert not torch.equal(p.detach(), initial[name])


def wrap(fn, mode):
    from tensordict.nn import CudaGraphModule

    if mode == "twin":
        return fn
    return CudaGraphModule(torch.compile(fn), warmup=3) if mode == "cudagraphs" else torch.compile(fn)


@pytest.mark.parametrize("mode", MODES)
def test_twin_update_computes_the_eager_update(mode, no_tf32):
    """Same weights, same minibatches, same learning rates: the twin's two halves (torch.func.grad,
    Adam written out) give the eager halves' (loss.backward(), clip_grad_norm_, torch.optim.Adam)
    flat gradients, losses and updated weights; here for a group of 2 processes whose summed
    gradients are this one's, doubled."""
    device = "cuda" if mode == "cudagraphs" else "cpu"
    memory_format = torch.channels_last if device == "cpu" else torch.contiguous_format  # as main() lays them out
    learners = []
    for name in (MULTI, MULTI_TWIN):
        module = load_script(name)
        torch.manual_seed(0)
        agent = module.Agent(4, device=device).to(memory_format=memory_format)
        compute_grads, apply_grads, set_learning_rate, _ = module.make_update(module.Args(), agent, 2)
        if name == MULTI_TWIN:
            compute_grads, apply_grads = wrap(compute_grads, mode), wrap(apply_grads, mode)
        learners.append((agent, compute_grads, apply_grads, set_learning_rate))
    initial = {name: p.detach().clone() for name, p in learners[0][0].named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for i in range(5 if mode == "cudagraphs" else 2):  # 3 warm-ups, the capture, a replay
        minibatch = (
            torch.randint(0, 256, (16, 4, 84, 84), generator=gen, dtype=torch.uint8).contiguous(memory_format=memory_format),
            torch.randint(0, 4, (16,), generator=gen), torch.randn(16, generator=gen) - 1.4,
            torch.randn(16, generator=gen), torch.randn(16, generator=gen), torch.randn(16, generator=gen),
        )
        minibatch = [x.to(device) for x in minibatch]
        results = []
        for agent, compute_grads, apply_grads, set_learning_rate in learners:
            set_learning_rate(1e-3 / (i + 1))
            grads, stats = compute_grads(*minibatch)
            results.append((grads.clone(), torch.stack(list(stats))))
            apply_grads(grads * 2)  # what the all-reduce of 2 processes with these gradients gives
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)  # the gradients sum in other orders
        torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)
        twin_params = dict(learners[1][0].named_parameters())
        for name, p in learners[0][0].named_parameters():
            torch.testing.assert_close(twin_params[name].data, p.data, rtol=1e-4, atol=1e-6)
    assert all(not torch.equal(p, initial[name]) for name, p in learners[0][0].named_parameters())


def write_checkpoint_of_two_processes(path, script):
    rng = {"torch": torch.get_rng_state(), "cuda": []}
    torch.save({"script": script, "args": {}, "global_step": 0, "rng": [rng, rng], "state": {}, "run_name": "a_run"}, path)


@pytest.mark.parametrize("name", [MULTI, MULTI_TWIN])
@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--backend", "nccl"], {}, "--backend nccl needs CUDA: on the CPU use --backend gloo"),
        (["--backend", "tcp"], {}, "--backend 'tcp' is not a torch.distributed backend: pick gloo (CPU or CUDA) or nccl (CUDA)"),
        (["--local-num-envs", "0"], {}, "--local-num-envs must be positive"),
        (["--total-timesteps", "2000"], {"WORLD_SIZE": "2", "RANK": "0"}, "smaller than one rollout of --local-num-envs * --num-steps * 2 processes (2048)"),
        (["--resume", "{tmp}/two.pt"], {}, "was written by a run of 2 processes, not 1: resume it with as many"),
    ],
    ids=["nccl-on-cpu", "unknown-backend", "no-envs", "budget-of-2-processes", "resume-of-2-processes"],
)
def test_bad_input_is_one_line_and_exit_code_2(name, flags, env, message, workdir, monkeypatch, capsys):
    if "nccl" in flags and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid choice here")
    monkeypatch.chdir(workdir)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    write_checkpoint_of_two_processes(workdir / "two.pt", f"{name}.py")
    assert_rejected(name, [f.replace("{tmp}", str(workdir)) for f in flags], message.replace("{tmp}", str(workdir)), capsys)


def test_bad_input_under_torchrun_is_said_once(workdir):
    """Every process checks the same input and stops; only rank 0 says why."""
    proc = torchrun(MULTI, "--env-id", "Pong", cwd=workdir)
    assert proc.returncode != 0 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: 'Pong' is not an envpool Atari game: did you mean Pong-v5?"], proc.stderr[-3000:]


@pytest.mark.parametrize("name", [MULTI, MULTI_TWIN])
def test_bad_input_on_the_command_line(name, workdir):
    assert_rejected_on_the_command_line(name, ["--local-num-envs", "-2"], "error: --local-num-envs must be positive, got -2", workdir)


@pytest.mark.parametrize("name", [MULTI, MULTI_TWIN])
def test_help(name, workdir):
    proc = run_main(name, "--help", cwd=workdir)
    assert proc.returncode == 0
    for flag in ("--local-num-envs", "--backend", "--total-timesteps", "--num-minibatches", "--target-kl", "--save-model"):
        assert flag in proc.stdout
    assert "--num-envs " not in proc.stdout
    assert ("--cudagraphs" in proc.stdout) == name.endswith("_torchcompile")
