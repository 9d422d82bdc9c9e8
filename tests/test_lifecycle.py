"""Save, evaluate, resume and fail well: every script in leanrl/, each eager script and its twin.

A checkpoint written by a finished run and resumed with nothing left to train evaluates to the
same return as the run itself did, which holds only if every weight (and PPO's normalisation
statistics) survives the round trip. A run stopped by a signal writes its summary and checkpoint, and
resuming it ends where an uninterrupted run ends."""

import builtins
import csv
import errno
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
DQN = "dqn"
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
    # the target network updates every 50 steps, so a resume that dropped it would act on another one
    DQN: ["--env-id", "CartPole-v1", "--learning-starts", "100", "--total-timesteps", "400", "--batch-size", "32", "--log-every", "50",
          "--target-network-frequency", "50"],
}
ITERATION_STEPS = {PPO: 64, SAC: 1, TD3: 1, ATARI: 64, MULTI: 64, DQN: 1}


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


@pytest.mark.parametrize("script, name", params([PPO, SAC, TD3, ATARI, MULTI, DQN]))
def test_checkpoint_round_trip(script, name, workdir):
    """The saved weights act exactly as the trained ones: a finished run's checkpoint, resumed with no
    step left to train, evaluates (deterministic actions, same evaluation seeds) to the same return."""
    flags = ["--save-model", "--checkpoint-every", "1000000", "--eval-episodes", "1"]
    first = summary_of(run_main(name, *SHORT[script], *flags, cwd=workdir), workdir)
    path = workdir / first["checkpoint"]
    assert path.is_file() and not Path(f"{path}.tmp").exists()
    assert first["eval_episodes"] == 1 and math.isfinite(first["eval_return"])
    assert first["interrupted"] is False and first["diverged"] is False and first["exit_code"] == 0
    assert first["resumed_from"] is None

    checkpoint = torch.load(path, weights_only=True)  # tensors, numbers and strings only
    assert checkpoint["script"] == f"{name}.py" and checkpoint["global_step"] == first["global_step"]

    # --seed on the command line is a run argument: the checkpoint's seed stays, with a note; --no-save-model turns
    # off the run's saving flags (its --checkpoint-every with it)
    written = path.read_bytes()
    proc = run_main(name, "--resume", path, "--eval-episodes", "1", "--seed", "7", "--no-save-model", cwd=workdir)
    again = summary_of(proc, workdir)
    assert again["resumed_from"] == str(path)
    assert again["run_name"] == first["run_name"] and again["resumes"] == 1  # the same run, in its own folder
    assert again["seed"] == first["seed"] and "--seed stays 1" in proc.stderr
    assert again["global_step"] == first["global_step"] and again["episodes"] == first["episodes"]
    assert again["eval_return"] == first["eval_return"]
    assert again["checkpoint"] == str(path) and path.read_bytes() == written  # nothing trained, nothing written


@pytest.mark.parametrize("script, name", params([PPO, SAC, TD3, ATARI, DQN], twins=False))
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
    TD3: SHORT[TD3][:-5] + ["1200", "--batch-size", "32", "--log-every", "20", "--checkpoint-every", "100"],
}


# a rollout-based and an off-policy loop, one signal each; the plumbing block that handles them is shared by every
# script (SAC's kill and resume is test_a_killed_run_resumes_in_its_own_folder, the envpool scripts' stop and resume
# under torchrun is in tests/test_ppo_atari_multigpu.py)
@pytest.mark.parametrize("script, signum", [(PPO, signal.SIGINT), (TD3, signal.SIGTERM)])
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

    resumed = summary_of(run_script(script, "--resume", workdir / summary["checkpoint"], "--eval-episodes", "1",
                                    cwd=workdir), workdir)
    assert resumed["run_name"] == summary["run_name"] and len(list((workdir / "runs").iterdir())) == 1
    assert resumed["global_step"] == total // ITERATION_STEPS[script] * ITERATION_STEPS[script]
    assert resumed["interrupted"] is False and resumed["exit_code"] == 0
    assert resumed["episodes"] >= summary["episodes"]


DIVERGE = {
    PPO: ["--learning-rate", "1e30", "--checkpoint-every", "64"],
    ATARI: ["--learning-rate", "1e30", "--checkpoint-every", "64"],
    # periodic checkpoints at steps 50 and 100 of the random-action warm-up, then updates from step 101
    SAC: ["--q-lr", "1e30", "--policy-lr", "1e30", "--checkpoint-every", "50"],
    TD3: ["--learning-rate", "1e30", "--checkpoint-every", "50"],
    DQN: ["--learning-rate", "1e30", "--checkpoint-every", "50"],
}


@pytest.mark.parametrize("script, name", params([PPO, ATARI, SAC, TD3, DQN], twins=False))
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
    ([SAC, TD3, DQN], ["--save-buffer"], "--save-buffer needs --save-model"),
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
    assert "--save-buffer" in out and "MB per million steps" in out


# eager scripts: the twins share the plumbing block byte for byte, and test_checkpoint_round_trip restores them
@pytest.mark.parametrize("script, name", params([PPO, SAC, TD3, DQN], twins=False))
def test_resume_with_a_larger_budget_extends_the_run(script, name, workdir, monkeypatch, capsys):
    """--resume CKPT --total-timesteps N continues a finished run to step N, updating again (off-policy: after
    the refill of the replay buffer; PPO: annealing re-planned to reach 0 at the new end); an N below the
    checkpoint's step is a one-line error."""
    first = summary_of(run_main(name, *SHORT[script], "--save-model", "--eval-episodes", "0", cwd=workdir), workdir)
    path = workdir / first["checkpoint"]
    proc = run_main(name, "--resume", path, "--total-timesteps", "768", "--eval-episodes", "0", cwd=workdir)
    extended = summary_of(proc, workdir)
    assert extended["global_step"] == 768 and (extended["episodes"] == 3 or script == DQN)  # Pendulum: 200 steps each
    loss = {PPO: "value_loss", DQN: "td_loss"}.get(script, "qf_loss")
    assert loss in extended["losses"] and extended["losses"] != first["losses"] and extended["sps"] > 0  # updates ran
    if script == PPO:  # the last of 12 rollouts of 64 steps
        assert extended["losses"]["learning_rate"] == pytest.approx(3e-4 / 12)
    assert "stays" not in proc.stderr  # the budget is not a flag that the checkpoint keeps
    assert torch.load(path, weights_only=True)["global_step"] == 768  # --save-model came with the run
    proc = run_main(name, "--resume", path, "--total-timesteps", "832", "--no-save-model", cwd=workdir)
    assert summary_of(proc, workdir)["global_step"] == 832 and torch.load(path, weights_only=True)["global_step"] == 768
    monkeypatch.chdir(workdir)
    step = 768
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
        "returns": [], "rng": [{"torch": torch.get_rng_state(), "cuda": []}], "run_name": "a_run", "resumes": 0,
        "wall_seconds": 1.0, "wandb_id": None, "state": {"optimizer": optimizer.state_dict()},
    }, workdir / "checkpoint.pt")
    run = module.Run(module.Args(resume=str(workdir / "checkpoint.pt"), total_timesteps=10_000), module.arg_errors)
    optimizer = torch.optim.Adam([param], capturable=now)
    run.start({"optimizer": optimizer}, losses=())
    run.metrics_file.close()
    assert run.args.env_id == "Pendulum-v1"  # the checkpoint's run arguments were taken
    assert optimizer.param_groups[0]["capturable"] is now


KILLED = [*SHORT[SAC][:-5], "900", "--batch-size", "32", "--log-every", "25", "--save-model", "--checkpoint-every", "300"]


def test_a_killed_run_resumes_in_its_own_folder(workdir, monkeypatch):
    """SIGKILL after a periodic checkpoint, then `--resume` alone: the run goes on in its folder, under its name,
    its metrics.csv cut back to the checkpoint's step (the rows after it are work that the kill lost) and then
    appended to, so its steps increase to the budget with none twice; it keeps checkpointing every K steps; the
    summary counts the resume. The shared plumbing block does this for every script."""
    proc = subprocess.Popen([sys.executable, str(LEANRL / f"{SAC}.py"), *KILLED], cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "WANDB_MODE": "disabled"})
    deadline = time.monotonic() + 300
    while not any(step > 400 for step in metrics_steps(workdir)):  # past the checkpoint of step 300
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:] if proc.poll() else ""
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    [folder] = (workdir / "runs").iterdir()
    before = (folder / "metrics.csv").read_text().splitlines()
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: saved.append(obj["global_step"]) or real_save(obj, f))

    resumed = run_main(SAC, "--resume", folder / "checkpoint.pt", "--eval-episodes", "0", cwd=workdir)
    summary = summary_of(resumed, workdir)
    assert list((workdir / "runs").iterdir()) == [folder] and summary["run_name"] == folder.name
    assert summary["global_step"] == 900 and summary["resumes"] == 1 and summary["checkpoint"] is not None
    assert saved == [600, 900]  # --save-model --checkpoint-every 300 came with the run
    after = (folder / "metrics.csv").read_text().splitlines()
    steps = [int(line.split(",")[0]) for line in after[1:]]
    assert steps == sorted(set(steps)) and steps[-1] == 900
    kept = [line for line in before[1:] if int(line.split(",")[0]) <= 300]
    assert after[: 1 + len(kept)] == before[: 1 + len(kept)]  # the rows up to the checkpoint, as they were
    assert max(int(line.split(",")[0]) for line in before[1:]) > 400  # rows that the resume cut and wrote again
    assert "refills it for --learning-starts (100) steps" in resumed.stderr  # saved without --save-buffer


@pytest.mark.parametrize("script", [SAC, TD3, DQN])
@pytest.mark.parametrize("save_buffer", [True, False], ids=["save-buffer", "refill"])
def test_save_buffer_resumes_the_buffer_and_the_updates(script, save_buffer, workdir):
    """With --save-buffer the checkpoint holds the filled replay buffer: the resumed run has it row for row and
    updates from its first step. Without, the restored policy refills the buffer first, and a note says so."""
    flags = ["--save-model", "--eval-episodes", "0"] + (["--save-buffer"] if save_buffer else [])
    first = summary_of(run_main(script, *SHORT[script], *flags, cwd=workdir), workdir)
    path = workdir / first["checkpoint"]
    saved = torch.load(path, weights_only=True)["state"]

    proc = run_main(script, "--resume", path, "--total-timesteps", "401", cwd=workdir)
    resumed = summary_of(proc, workdir)
    state = torch.load(path, weights_only=True)["state"]
    loss = "td_loss" if script == DQN else "qf_loss"  # DQN updates every 10 steps, at step 401 too
    if save_buffer:
        assert saved["replay_buffer"]["rows"].shape[0] == 400 and state["replay_buffer"]["pos"] == 401
        assert torch.equal(state["replay_buffer"]["rows"][:400], saved["replay_buffer"]["rows"])
        assert loss in resumed["losses"] and "refills" not in proc.stderr  # an update at step 401
    else:
        assert "replay_buffer" not in state and loss not in resumed["losses"]  # no update: 100 refill steps first
        assert "refills it for --learning-starts (100) steps" in proc.stderr


def test_a_buffer_of_another_shape_is_one_line(workdir):
    """A buffer whose rows do not fit the env (an env module changed since): one error line, exit code 2."""
    first = summary_of(run_main(SAC, *SHORT[SAC], "--save-model", "--save-buffer", "--eval-episodes", "0",
                                cwd=workdir), workdir)
    checkpoint = torch.load(workdir / first["checkpoint"], weights_only=True)
    buffer = checkpoint["state"]["replay_buffer"]
    buffer["rows"] = torch.cat([buffer["rows"], buffer["rows"][:, :1]], dim=1)  # one value too many a row
    torch.save(checkpoint, workdir / first["checkpoint"])
    proc = run_main(SAC, "--resume", first["checkpoint"], cwd=workdir)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert errors == [proc.stderr.strip().splitlines()[-1]] and "rows of 10 values" in errors[0]
    assert "resume with --no-save-buffer" in errors[0]
    proc = run_main(SAC, "--resume", first["checkpoint"], "--no-save-buffer", "--total-timesteps", "401", cwd=workdir)
    assert summary_of(proc, workdir)["global_step"] == 401 and "refills" in proc.stderr  # the named way out


def test_a_checkpoint_outside_its_run_folder_resumes_into_a_new_one(workdir):
    first = summary_of(run_main(SAC, *SHORT[SAC], "--save-model", "--eval-episodes", "0", cwd=workdir), workdir)
    copy = workdir / "copied.pt"
    copy.write_bytes((workdir / first["checkpoint"]).read_bytes())
    proc = run_main(SAC, "--resume", copy, "--total-timesteps", "450", cwd=workdir)
    resumed = summary_of(proc, workdir)
    assert resumed["run_name"] != first["run_name"] and resumed["global_step"] == 450
    notes = [line for line in proc.stderr.splitlines() if "is not in its run folder" in line]
    assert len(notes) == 1 and f"runs/{first['run_name']}" in notes[0] and resumed["run_name"] in notes[0]


def test_track_resumes_the_same_wandb_run(workdir):
    """The checkpoint keeps the wandb run id, and the resumed run logs into that run. Rows logged after the
    checkpoint (here written by hand, as a crash leaves them) are cut from metrics.csv and not logged to wandb
    again: a note says which steps keep their earlier values."""
    env = {"WANDB_MODE": "offline"}
    first = summary_of(run_main(SAC, *SHORT[SAC], "--save-model", "--eval-episodes", "0", "--track", cwd=workdir,
                                env=env), workdir)
    path = workdir / first["checkpoint"]
    run_id = torch.load(path, weights_only=True)["wandb_id"]
    assert run_id and len(list((workdir / "wandb").glob(f"offline-run-*-{run_id}"))) == 1
    with open(path.parent / "metrics.csv", "a") as f:
        f.write("450,1.0,-1000.0,,,,\n")  # a row of the crashed run, after the checkpoint's step
    proc = run_main(SAC, "--resume", path, "--total-timesteps", "500", "--track", cwd=workdir, env=env)
    resumed = summary_of(proc, workdir)  # checks that metrics.csv holds no step twice
    assert torch.load(path, weights_only=True)["wandb_id"] == run_id and resumed["global_step"] == 500
    assert len(list((workdir / "wandb").glob(f"offline-run-*-{run_id}*"))) == 2
    assert f"note: wandb run {run_id} continues; its steps 401-450 keep the values logged before the crash" \
        in proc.stderr


def failing_save(calls):
    """A torch.save that fails as a full disk does, after writing part of the file, at the given calls (from 1)."""
    real_save, count = torch.save, [0]

    def save(obj, f):
        count[0] += 1
        if count[0] not in calls:
            return real_save(obj, f)
        f.write(b"part of a checkpoint")
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:  # as torch.save's zip writer does on a full disk, closing the file it could not write
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 561664 vs 561552")

    return save


@pytest.mark.parametrize("fails", ["periodic", "all"])
def test_a_checkpoint_that_cannot_be_written_costs_no_training(fails, workdir, monkeypatch):
    """Disk full at both periodic saves (steps 150 and 300): one warning, training reaches its budget, no .tmp file
    is left. A final save (step 400) that succeeds ends the run as usual; one that fails still prints and writes
    the summary (checkpoint null, the reason), with one error line and exit code 1."""
    monkeypatch.setattr(torch, "save", failing_save({1, 2} if fails == "periodic" else {1, 2, 3}))
    proc = run_main(SAC, *SHORT[SAC], "--save-model", "--checkpoint-every", "150", "--eval-episodes", "0",
                    cwd=workdir)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "training goes on" in warnings[0]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == 400
    assert not list(workdir.glob("runs/*/*.tmp"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if fails == "periodic":
        assert proc.returncode == 0 and summary["checkpoint"] and summary["checkpoint_error"] is None and not errors
        assert torch.load(workdir / summary["checkpoint"], weights_only=True)["global_step"] == 400
    else:
        assert proc.returncode == 1 and summary["exit_code"] == 1 and summary["checkpoint"] is None
        assert "No space left on device" in summary["checkpoint_error"]
        assert len(errors) == 1 and "the final checkpoint is lost" in errors[0], proc.stderr
        assert json.loads((workdir / "runs" / summary["run_name"] / "summary.json").read_text()) == summary


def test_a_record_that_cannot_be_written_costs_no_training(workdir, monkeypatch):
    """The disk fills up mid-run: the rows of metrics.csv after step 200 and summary.json cannot be written. One
    warning each, the run reaches its budget and prints its summary."""
    real_open, real_writerow = builtins.open, csv.DictWriter.writerow

    def full_disk_open(file, mode="r", *args, **kwargs):
        if str(file).endswith("summary.json") and mode != "r":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(file, mode, *args, **kwargs)

    def full_disk_writerow(writer, row):
        if isinstance(row["global_step"], int) and row["global_step"] > 200:  # not the header
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writerow(writer, row)

    monkeypatch.setattr(builtins, "open", full_disk_open)
    monkeypatch.setattr(csv.DictWriter, "writerow", full_disk_writerow)
    proc = run_main(SAC, *SHORT[SAC], "--eval-episodes", "0", cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and all("No space left on device" in line for line in warnings), proc.stderr
    assert "metrics.csv" in warnings[0] and "summary.json" in warnings[1]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == 400 and summary["exit_code"] == 0
    assert metrics_steps(workdir)[-1] == 151  # the last row before the disk filled up (one every 50 steps)
