"""Save, evaluate, resume and fail well: every script in leanrl/, each eager script and its twin.

A checkpoint written by a finished run and resumed with nothing left to train evaluates to the
same return as the run itself did, which holds only if every weight (and PPO's normalisation
statistics) survives the round trip. A run stopped by a signal writes its summary and checkpoint, and
resuming it ends where an uninterrupted run ends."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import tyro
from conftest import LEANRL, assert_rejected, load_script, run_main, run_script, summary_of

try:
    import envpool  # noqa: F401

    HAS_ENVPOOL = True
except ImportError:
    HAS_ENVPOOL = False

NEEDS_ENVPOOL = pytest.mark.skipif(not HAS_ENVPOOL, reason="envpool is not installed: pip install -r requirements/requirements-atari.txt")

PPO, SAC, TD3, ATARI = "ppo_continuous_action", "sac_continuous_action", "td3_continuous_action", "ppo_atari_envpool"
# run here in this process, a group of one; tests/test_ppo_atari_multigpu.py stops, resumes and diverges it under
# torchrun
MULTI = "ppo_atari_envpool_multigpu"
# per script: a short run that reaches several updates, and the steps in one iteration
SHORT = {
    PPO: ["--env-id", "Pendulum-v1", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "512"],
    SAC: ["--env-id", "Pendulum-v1", "--learning-starts", "100", "--total-timesteps", "400", "--batch-size", "32", "--log-every", "50"],
    TD3: ["--env-id", "Pendulum-v1", "--learning-starts", "100", "--total-timesteps", "400", "--batch-size", "32", "--log-every", "50"],
    # Pong: an untrained policy loses a whole game in about 800 steps, so evaluation stays short
    ATARI: ["--env-id", "Pong-v5", "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "256"],
    MULTI: ["--env-id", "Pong-v5", "--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "256"],
}
ITERATION_STEPS = {PPO: 64, SAC: 1, TD3: 1, ATARI: 64, MULTI: 64}


def params(scripts, twins=True):
    """pytest params over scripts (and their twins), Atari skipped without envpool."""
    out = []
    for script in scripts:
        for name in [script, f"{script}_torchcompile"] if twins else [script]:
            marks = [NEEDS_ENVPOOL] if script in (ATARI, MULTI) else []
            out.append(pytest.param(script, name, id=name, marks=marks))
    return out


def test_every_script_is_covered_here():
    for path in LEANRL.glob("*.py"):
        base = path.stem.removesuffix("_torchcompile")
        assert base in SHORT, f"{path.name} is not covered by tests/test_lifecycle.py"


@pytest.mark.parametrize("script, name", params([PPO, SAC, TD3, ATARI, MULTI]))
def test_checkpoint_round_trip(script, name, workdir):
    """The saved weights act exactly as the trained ones: a finished run's checkpoint, resumed with no
    step left to train, evaluates (deterministic actions, same evaluation seeds) to the same return."""
    proc = run_main(name, *SHORT[script], "--save-model", "--eval-episodes", "1", cwd=workdir)
    first = summary_of(proc, workdir)
    path = workdir / first["checkpoint"]
    assert path.is_file() and not Path(f"{path}.tmp").exists()
    assert first["eval_episodes"] == 1 and math.isfinite(first["eval_return"])
    assert first["interrupted"] is False and first["diverged"] is False and first["exit_code"] == 0
    assert first["resumed_from"] is None

    checkpoint = torch.load(path, weights_only=True)  # tensors, numbers and strings only
    assert checkpoint["script"] == f"{name}.py" and checkpoint["global_step"] == first["global_step"]

    # --seed on the command line is a run argument: the checkpoint's seed stays, with a note
    proc = run_main(name, "--resume", path, "--eval-episodes", "1", "--seed", "7", cwd=workdir)
    again = summary_of(proc, workdir)
    assert again["resumed_from"] == str(path)
    assert again["seed"] == first["seed"] and "--seed stays 1" in proc.stderr
    assert again["global_step"] == first["global_step"] and again["episodes"] == first["episodes"]
    assert again["eval_return"] == first["eval_return"]
    assert again["checkpoint"] is None  # no --save-model this time


@pytest.mark.parametrize("script, name", params([PPO, SAC, TD3, ATARI], twins=False))
def test_same_seed_same_run(script, name, workdir):
    """Determinism on the CPU: two eager runs with the same seed give the same returns and losses."""
    runs = [summary_of(run_main(name, *SHORT[script], cwd=workdir), workdir) for _ in range(2)]
    keys = ("global_step", "episodes", "episodic_return", "losses")
    assert [{k: run[k] for k in keys} for run in runs][0] == {k: runs[1][k] for k in keys}


def metrics_steps(workdir):
    """The global steps logged so far by the one run under workdir/runs."""
    files = list((workdir / "runs").glob("*/metrics.csv"))
    if not files:
        return []
    lines = files[0].read_text().splitlines()[1:]
    return [int(line.split(",")[0]) for line in lines if line.count(",") > 2]


# a budget long enough to be stopped mid-run, short enough to finish after a resume
LONG = {
    PPO: SHORT[PPO][:-1] + ["6400", "--checkpoint-every", "128"],
    SAC: SHORT[SAC][:-5] + ["1200", "--batch-size", "32", "--log-every", "20", "--checkpoint-every", "100"],
    TD3: SHORT[TD3][:-5] + ["1200", "--batch-size", "32", "--log-every", "20", "--checkpoint-every", "100"],
    ATARI: SHORT[ATARI][:-1] + ["1920", "--checkpoint-every", "128"],
}


@pytest.mark.parametrize(
    "script, signum",
    [
        (PPO, signal.SIGINT),
        (SAC, signal.SIGINT),
        (TD3, signal.SIGTERM),
        pytest.param(ATARI, signal.SIGINT, marks=NEEDS_ENVPOOL),
    ],
)
def test_stop_and_resume(script, signum, workdir):
    """Stopped mid-run by a signal: the current iteration ends, the checkpoint and the summary say
    interrupted, the exit code is 128 + the signal. Resumed from that checkpoint, the run ends at the
    global step of an uninterrupted one."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, str(LEANRL / f"{script}.py"), *LONG[script], "--save-model", "--eval-episodes", "1"],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 300
    # past learning-starts (off-policy) and the first periodic checkpoint
    while not any(step > 200 for step in metrics_steps(workdir)):
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the run logged nothing past step 200 in 300 s"
        time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    total = int(LONG[script][LONG[script].index("--total-timesteps") + 1])
    assert summary["interrupted"] is True and summary["exit_code"] == 128 + signum
    assert 200 < summary["global_step"] < total and summary["global_step"] % ITERATION_STEPS[script] == 0
    assert math.isfinite(summary["eval_return"])  # an interrupted run is still evaluated
    with open(workdir / "runs" / summary["run_name"] / "summary.json") as f:
        assert json.load(f) == summary
    checkpoint = torch.load(workdir / summary["checkpoint"], weights_only=True)
    assert checkpoint["global_step"] == summary["global_step"]

    resumed = summary_of(run_script(script, "--resume", workdir / summary["checkpoint"], cwd=workdir), workdir)
    assert resumed["global_step"] == total // ITERATION_STEPS[script] * ITERATION_STEPS[script]
    assert resumed["interrupted"] is False and resumed["exit_code"] == 0
    assert resumed["episodes"] >= summary["episodes"]


DIVERGE = {
    PPO: ["--learning-rate", "1e30", "--checkpoint-every", "64"],
    ATARI: ["--learning-rate", "1e30", "--checkpoint-every", "64"],
    # periodic checkpoints at steps 50 and 100 of the random-action warm-up, then updates from step 101
    SAC: ["--q-lr", "1e30", "--policy-lr", "1e30", "--checkpoint-every", "50"],
    TD3: ["--learning-rate", "1e30", "--checkpoint-every", "50"],
}


@pytest.mark.parametrize("script, name", params([PPO, ATARI, SAC, TD3], twins=False))
def test_divergence_stops_with_one_line_and_keeps_the_checkpoint(script, name, workdir):
    """A learning rate of 1e30 makes the losses non-finite within a few updates: the run stops at the
    next log point with one line naming the loss and the step, exit code 1, a valid summary, and the
    last periodic checkpoint left readable. SAC and TD3 always save one before they diverge."""
    proc = run_main(name, *SHORT[script], *DIVERGE[script], "--save-model", cwd=workdir)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "at global step" in errors[0] and "the run diverged" in errors[0], proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["diverged"] is True and summary["exit_code"] == 1 and summary["eval_return"] is None
    step = int(errors[0].split("at global step ")[1].split(":")[0])
    assert step == summary["global_step"]
    if script in (SAC, TD3):
        assert "is intact" in errors[0], errors[0]
    if "is intact" in errors[0]:
        checkpoint = torch.load(workdir / "runs" / summary["run_name"] / "checkpoint.pt", weights_only=True)
        assert checkpoint["global_step"] < step and summary["checkpoint"] is not None
    else:
        assert "no checkpoint was saved" in errors[0]


def save_fake_checkpoint(path, **content):
    torch.save({"global_step": 0, "args": {}, **content}, path)


BAD_INPUTS = [
    # (scripts, flags, message): {tmp} is the test's folder
    ([PPO, SAC, TD3, ATARI, MULTI], ["--resume", "{tmp}/missing.pt"], "--resume {tmp}/missing.pt: no such file"),
    ([PPO, SAC, TD3, ATARI, MULTI], ["--resume", "{tmp}/truncated.pt"], "is not a readable checkpoint"),
    ([PPO, SAC, TD3, ATARI, MULTI], ["--resume", "{tmp}/notes.txt"], "is not a readable checkpoint"),
    ([PPO, TD3, ATARI, MULTI], ["--resume", "{tmp}/sac.pt"], "was written by sac_continuous_action.py, not"),
    ([SAC], ["--resume", "{tmp}/td3.pt"], "was written by td3_continuous_action.py, not sac_continuous_action"),
    ([PPO, SAC, TD3, ATARI, MULTI], ["--checkpoint-every", "-5", "--save-model"], "--checkpoint-every must be >= 0, got -5"),
    ([PPO, SAC, TD3, ATARI, MULTI], ["--checkpoint-every", "100"], "--checkpoint-every needs --save-model"),
    ([PPO, SAC, TD3, ATARI, MULTI], ["--eval-episodes", "-1"], "--eval-episodes must be >= 0, got -1"),
    ([PPO, SAC, TD3], ["--capture-video"], "--capture-video writes to videos/, which cannot be written here"),
]


@pytest.mark.parametrize(
    "script, name, flags, message",
    [
        pytest.param(script, name, flags, message, id=f"{name}-{' '.join(flags)}", marks=p.marks)
        for scripts, flags, message in BAD_INPUTS
        for p in params(scripts)
        for script, name in [p.values]
    ],
)
def test_bad_lifecycle_input_is_one_line_and_exit_code_2(script, name, flags, message, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    truncated = workdir / "truncated.pt"
    torch.save({"script": f"{name}.py", "weights": torch.zeros(10_000)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:1000])  # a checkpoint cut short by a kill
    (workdir / "notes.txt").write_text("not a checkpoint\n")
    save_fake_checkpoint(workdir / "sac.pt", script="sac_continuous_action.py")
    save_fake_checkpoint(workdir / "td3.pt", script="td3_continuous_action.py")
    (workdir / "videos").write_text("a file where the videos folder should go\n")
    flags = [f.replace("{tmp}", str(workdir)) for f in flags]
    assert_rejected(name, flags, message.replace("{tmp}", str(workdir)), capsys)


@pytest.mark.parametrize("script", [SAC, TD3])
def test_offpolicy_help_says_how_the_buffer_is_resumed(script, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit):
        tyro.cli(module.Args, args=["--help"])
    out = " ".join(capsys.readouterr().out.split())  # tyro wraps the help to the terminal's width
    assert "refill" in out and "--learning-starts" in out and "extends the run" in out


# eager scripts: the twins share the plumbing block byte for byte, and test_checkpoint_round_trip restores them
@pytest.mark.parametrize("script, name", params([PPO, SAC, TD3], twins=False))
def test_resume_with_a_larger_budget_extends_the_run(script, name, workdir, monkeypatch, capsys):
    """--resume CKPT --total-timesteps N continues a finished run to step N, updating again (off-policy: after
    the refill of the replay buffer; PPO: annealing re-planned to reach 0 at the new end); an N below the
    checkpoint's step is a one-line error."""
    first = summary_of(run_main(name, *SHORT[script], "--save-model", "--eval-episodes", "0", cwd=workdir), workdir)
    path = workdir / first["checkpoint"]
    proc = run_main(name, "--resume", path, "--total-timesteps", "768", cwd=workdir)
    extended = summary_of(proc, workdir)
    assert extended["global_step"] == 768 and extended["episodes"] == 3  # Pendulum: 200 steps an episode
    loss = "value_loss" if script == PPO else "qf_loss"
    assert loss in extended["losses"] and extended["losses"] != first["losses"] and extended["sps"] > 0  # updates ran
    if script == PPO:  # the last of 12 rollouts of 64 steps
        assert extended["losses"]["learning_rate"] == pytest.approx(3e-4 / 12)
    assert "stays" not in proc.stderr  # the budget is not a flag that the checkpoint keeps
    monkeypatch.chdir(workdir)
    step = first["global_step"]
    assert_rejected(name, ["--resume", str(path), "--total-timesteps", "300"],
                    f"--total-timesteps 300 ends before the checkpoint's step {step}: give {step} or more", capsys)


@pytest.mark.parametrize("saved, now", [(True, False), (False, True)])
def test_resume_keeps_this_runs_capturable(saved, now, workdir, monkeypatch):
    """A twin's optimisers are capturable exactly when this run replays CUDA graphs: loading the optimiser state
    of a run made with the other setting must not bring its setting along (a CUDA graph replaying a
    non-capturable Adam, or a CPU run with a capturable one, fails or computes wrongly)."""
    module = load_script(f"{SAC}_torchcompile")
    monkeypatch.chdir(workdir)
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.Adam([param], capturable=saved)
    torch.save({
        "script": f"{SAC}_torchcompile.py", "args": {"env_id": "Pendulum-v1"}, "global_step": 0, "episodes": 0,
        "returns": [], "rng": [{"torch": torch.get_rng_state(), "cuda": []}],
        "state": {"optimizer": optimizer.state_dict()},
    }, workdir / "checkpoint.pt")
    run = module.Run(module.Args(resume=str(workdir / "checkpoint.pt"), total_timesteps=10_000), module.arg_errors)
    optimizer = torch.optim.Adam([param], capturable=now)
    run.start({"optimizer": optimizer}, losses=())
    run.metrics_file.close()
    assert run.args.env_id == "Pendulum-v1"  # the checkpoint's run arguments were taken
    assert optimizer.param_groups[0]["capturable"] is now
