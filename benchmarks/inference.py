"""Inference benchmark: torch.compile on the acting networks of the LeanRL scripts.

Times the call each script makes once per environment step, under torch.no_grad() as the scripts
make it: the PPO Atari agent (Nature CNN, uint8 frames), the PPO, SAC and TD3 policies at
HalfCheetah's sizes (17 observations, 6 actions). For every network and batch size: the eager call,
then the call compiled in each torch.compile mode (on CUDA, also each mode wrapped in tensordict's
CudaGraphModule, as the twins wrap their policies). Each row: the median of --iters calls, each timed
on its own, after --burnin untimed calls (compiling happens in the first); the throughput (samples
per second); the speed-up over eager, median eager / median compiled - 1, as RLlib reports it.

Before a compiled row is timed, its output is checked against the eager network on the same input.
A row that fails to compile or differs from eager is reported as failed with a one-line reason.
Writes inference.md (the table, also printed), inference.json (the rows and the machine) and
inference.png (speed-up against batch size, one panel per network).

    python benchmarks/inference.py --device cpu --out-dir benchmarks/results/inference-cpu
"""

import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime
from functools import cache, partial
from pathlib import Path
from typing import Callable, Literal, Optional
from unittest import mock

import gymnasium as gym
import tensordict
import torch
import tyro
from tensordict.nn import CudaGraphModule
from torch._inductor import config as inductor_config
from torch._inductor import list_mode_options

ROOT = Path(__file__).resolve().parent.parent
NETS = ("ppo_atari", "ppo_continuous", "sac", "td3")
N_OBS, N_ACT = 17, 6  # HalfCheetah-v5
ATARI_ACTIONS = 4  # Breakout
# CudaGraphModule and torch.compile's CUDA graphs both record on the second call and replay from the
# third: the check must see a replay
WARMUP_CALLS = 2


@dataclass
class Args:
    nets: tuple[Literal["ppo_atari", "ppo_continuous", "sac", "td3"], ...] = NETS
    """the acting networks to time"""
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64, 256)
    """observations per call (environments acting at once)"""
    modes: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune")
    """torch.compile modes, passed to torch.compile as they are"""
    cudagraph_module: bool = True
    """on CUDA, also time each mode wrapped in tensordict's CudaGraphModule"""
    burnin: int = 100
    """untimed calls before the timed ones: compiling and CUDA graph capture happen here"""
    iters: int = 1000
    """timed calls, each timed on its own; the table reports their median"""
    device: Optional[Literal["cpu", "cuda"]] = None
    """where the networks run; CUDA when there is a GPU"""
    out_dir: Optional[str] = None
    """where inference.md, .json and .png go; benchmarks/results/inference-<date>-<time> by default"""
    seed: int = 1
    """seed of the networks' weights and of the observations"""


def fail(message: str):
    """Stops with a one-line message and exit code 2, as the scripts do on bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args: Args):
    if not args.nets or not args.batch_sizes:
        fail("--nets and --batch-sizes need at least one value")
    if min(args.batch_sizes) < 1:
        fail(f"--batch-sizes must be positive, got {args.batch_sizes}")
    if args.burnin < WARMUP_CALLS:
        fail(f"--burnin must be at least {WARMUP_CALLS}: the check after it must see a CUDA graph replay")
    if args.iters < 1:
        fail(f"--iters must be positive, got {args.iters}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but CUDA is not available")


@cache
def load_script(name):
    """Imports leanrl/<name>.py as a module: importing a script runs nothing but definitions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "leanrl" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.compile looks functions' modules up by name
    spec.loader.exec_module(module)
    return module


@dataclass
class Net:
    act: Callable  # the script's per-step acting call
    obs: torch.Tensor
    # maps a compiled call's output to {name: (compiled, eager)} for its noise-free parts; None where
    # every output carries noise (TD3), see check_with_eager_rng
    rescore: Optional[Callable]
    tol: float = 1e-4


def rescore_ppo(agent, obs, out):
    """PPO samples its action; the log-prob, entropy and value of that action under eager are noise-free."""
    action, log_prob, entropy, value = out
    _, eager_log_prob, eager_entropy, eager_value = agent.get_action_and_value(obs, action)
    return {"log-prob": (log_prob, eager_log_prob), "entropy": (entropy, eager_entropy), "value": (value, eager_value)}


def rescore_sac(actor, obs, out):
    """SAC's action is a squashed sample: its Gaussian noise, recovered from the action, is replayed in
    the eager call, which must give the same log-prob and the same deterministic action."""
    action, log_prob, mean_action = out
    mean, log_std = actor(obs)
    eps = (torch.atanh((action - actor.action_bias) / actor.action_scale) - mean) / log_std.exp()
    with mock.patch.object(torch, "randn_like", lambda like: eps):
        _, eager_log_prob, eager_mean_action = actor.get_action(obs)
    return {"log-prob": (log_prob, eager_log_prob), "deterministic action": (mean_action, eager_mean_action)}


def make_net(name, batch_size, device, seed):
    torch.manual_seed(seed)  # the same weights at every batch size
    if name == "ppo_atari":
        agent = load_script("ppo_atari_envpool").Agent(n_act=ATARI_ACTIONS, device=device)
        obs = torch.randint(0, 256, (batch_size, 4, 84, 84), dtype=torch.uint8, device=device)
        if device.type == "cpu":  # as the script lays them out: oneDNN's convolutions run faster channels-last
            agent = agent.to(memory_format=torch.channels_last)
            obs = obs.contiguous(memory_format=torch.channels_last)
        # cuDNN convolutions round their inputs to TF32 by default, and the compiled graph may pick another kernel
        tol = 5e-3 if device.type == "cuda" and torch.backends.cudnn.allow_tf32 else 1e-4
        return Net(agent.get_action_and_value, obs, partial(rescore_ppo, agent, obs), tol)
    obs = torch.randn(batch_size, N_OBS, device=device)
    if name == "ppo_continuous":
        agent = load_script("ppo_continuous_action").Agent(N_OBS, N_ACT, device=device)
        return Net(agent.get_action_and_value, obs, partial(rescore_ppo, agent, obs))
    action_space = gym.spaces.Box(-1.0, 1.0, (N_ACT,))
    if name == "sac":
        actor = load_script("sac_continuous_action").Actor(N_OBS, action_space, device=device)
        return Net(actor.get_action, obs, partial(rescore_sac, actor, obs))
    script = load_script("td3_continuous_action")
    actor = script.Actor(N_OBS, action_space, device=device)
    # the twin's acting call: the noise scale bound, so that CudaGraphModule gets tensors only
    return Net(partial(actor.explore, noise_scale=script.Args.exploration_noise), obs, None)


class Mismatch(Exception):
    """A compiled call whose output differs from eager's."""


def expect_close(name, got, expected, tol):
    if got.shape != expected.shape:
        raise Mismatch(f"{name} has shape {tuple(got.shape)}, eager {tuple(expected.shape)}")
    error = (got - expected).abs().max().item()
    bound = tol * (1.0 + expected.abs().max().item())
    if not error <= bound:  # a NaN fails too
        raise Mismatch(f"{name} differs from eager by {error:.3g} (tolerance {bound:.3g})")


def check_with_eager_rng(net, compile_act):
    """For a call whose every output carries noise (TD3's explore): a twin compiled to draw eager's
    random numbers (inductor's fallback_random) must return eager's output for the same seed."""
    with inductor_config.patch(fallback_random=True):
        twin = compile_act()
        for _ in range(WARMUP_CALLS):
            twin(net.obs)
        torch.manual_seed(0)
        got = twin(net.obs)
    torch.manual_seed(0)
    expect_close("noisy action", got, net.act(net.obs), net.tol)


def burn_in(act, obs, calls, cuda):
    """Returns the seconds the untimed calls took: compiling included, in a compiled call's first."""
    start = time.perf_counter()
    for _ in range(calls):
        act(obs)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_seconds(act, obs, iters, cuda):
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        act(obs)
        if cuda:  # the call only queues its kernels
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_eager(net, args, cuda):
    return burn_in(net.act, net.obs, args.burnin, cuda), median_seconds(net.act, net.obs, args.iters, cuda)


def run_compiled(net, mode, cudagraph_module, args, cuda):
    def compile_act():
        act = torch.compile(net.act, mode=mode, dynamic=False)
        return CudaGraphModule(act) if cudagraph_module else act

    torch.compiler.reset()  # each row compiles for its own shape and mode
    if net.rescore is None:
        check_with_eager_rng(net, compile_act)
        torch.compiler.reset()
    act = compile_act()
    burnin_seconds = burn_in(act, net.obs, args.burnin, cuda)
    if net.rescore is not None:
        for name, (got, expected) in net.rescore(act(net.obs)).items():
            expect_close(name, got, expected, net.tol)
    return burnin_seconds, median_seconds(act, net.obs, args.iters, cuda)


def note_for(mode, cudagraph_module, device):
    uses_cudagraphs = list_mode_options().get(mode, {}).get("triton.cudagraphs", False)
    if uses_cudagraphs and device.type == "cpu":
        return "CUDA graphs are CUDA-only: on a CPU this mode compiles without them"
    if uses_cudagraphs and cudagraph_module:
        return "torch.compile's CUDA graphs inside CudaGraphModule's"
    return ""


def reason(error):
    """One line: the exception type and its message's first line (two where the first ends with ':')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(error).__name__}: {text}"[:240]


def measure(name, batch_size, mode, note, run):
    """Runs one configuration into a row; a failure becomes the row's reason, never a crash."""
    row = {
        "net": name, "batch_size": batch_size, "mode": mode, "status": "ok", "median_us": None,
        "samples_per_s": None, "speedup_pct": None, "burnin_s": None, "note": note, "error": None,
    }
    try:
        burnin_seconds, median = run()
        row.update(median_us=median * 1e6, samples_per_s=batch_size / median, burnin_s=burnin_seconds)
    except Exception as error:
        traceback.print_exc()
        row.update(status="failed", error=reason(error))
    result = f"{row['median_us']:.1f} us" if row["status"] == "ok" else f"failed: {row['error']}"
    print(f"{name} batch {batch_size} {mode}: {result}", file=sys.stderr, flush=True)
    return row


def machine(device, args):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "device": device.type, "device_name": gpu or cpu, "cpu": cpu, "gpu": gpu,
        "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "tensordict": tensordict.__version__,
        "python": platform.python_version(), "date": datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv, "burnin": args.burnin, "iters": args.iters,
    }


def markdown(header, rows):
    lines = [
        f"Inference on {header['device_name']} ({header['device']}), torch {header['torch']}, {header['date']}: "
        f"median of {header['iters']} calls after {header['burnin']} burn-in calls.",
        "",
        "| net | batch | mode | median (µs) | samples/s | speed-up | burn-in (s) | note |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] == "failed":
            cells = ["—", "—", "failed: " + r["error"].replace("|", "\\|"), "—"]
        else:
            speedup = "—" if r["speedup_pct"] is None else f"{r['speedup_pct']:+.1f} %"
            if r["mode"] == "eager":
                speedup = "baseline"
            cells = [f"{r['median_us']:.1f}", f"{r['samples_per_s']:,.0f}", speedup, f"{r['burnin_s']:.1f}"]
        lines.append("| " + " | ".join([r["net"], str(r["batch_size"]), r["mode"], *cells, r["note"]]) + " |")
    return "\n".join(lines) + "\n"


def plot(header, rows, path):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    nets = list(dict.fromkeys(r["net"] for r in rows))
    ncols = min(len(nets), 2)
    nrows = math.ceil(len(nets) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.0 * nrows), squeeze=False)
    for ax in axes.flat[len(nets):]:
        ax.set_visible(False)
    for ax, net in zip(axes.flat, nets):
        compiled = [r for r in rows if r["net"] == net and r["mode"] != "eager"]
        for mode in dict.fromkeys(r["mode"] for r in compiled):
            points = [r for r in compiled if r["mode"] == mode]
            speedups = [math.nan if r["speedup_pct"] is None else r["speedup_pct"] for r in points]
            ax.plot([r["batch_size"] for r in points], speedups, marker="o", label=mode)
        batch_sizes = sorted({r["batch_size"] for r in rows if r["net"] == net})
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        # limits set here, not from the data: a panel whose rows all failed has none
        ax.set_xlim(batch_sizes[0] / 1.5, batch_sizes[-1] * 1.5)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set(title=net, xlabel="batch size", ylabel="speed-up over eager (%)")
        if compiled:
            ax.legend(fontsize="small")
    fig.suptitle(f"torch.compile inference on {header['device_name']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Args):
    check_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir) if args.out_dir else ROOT / "benchmarks" / "results" / f"inference-{stamp}"
    torch.backends.cudnn.deterministic = True  # as the scripts run by default (--torch-deterministic)
    configs = [(mode, False) for mode in args.modes]
    if cuda and args.cudagraph_module:
        configs += [(mode, True) for mode in args.modes]

    rows = []
    with torch.no_grad():  # the scripts act under no_grad
        for name in args.nets:
            for batch_size in args.batch_sizes:
                net = make_net(name, batch_size, device, args.seed)
                eager = measure(name, batch_size, "eager", "", partial(run_eager, net, args, cuda))
                rows.append(eager)
                for mode, cudagraph_module in configs:
                    label = f"{mode}+CudaGraphModule" if cudagraph_module else mode
                    note = note_for(mode, cudagraph_module, device)
                    run = partial(run_compiled, net, mode, cudagraph_module, args, cuda)
                    row = measure(name, batch_size, label, note, run)
                    if row["status"] == "ok" and eager["status"] == "ok":
                        row["speedup_pct"] = (eager["median_us"] / row["median_us"] - 1.0) * 100.0
                    rows.append(row)

    header = machine(device, args)
    table = markdown(header, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "inference.md").write_text(table)
    with open(out_dir / "inference.json", "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=2)
    plot(header, rows, out_dir / "inference.png")
    print(table)
    print(f"wrote {out_dir}/inference.{{md,json,png}}", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args))
