import contextlib
import csv
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import gymnasium as gym
import pytest
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
LEANRL = ROOT / "leanrl"


def load_script(name):
    """Imports leanrl/<name>.py as a module: importing a script runs nothing but definitions."""
    spec = importlib.util.spec_from_file_location(name, LEANRL / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.compile looks functions' modules up by name
    spec.loader.exec_module(module)
    return module


def run_script(name, *flags, cwd, env=None, timeout=900):
    """Runs leanrl/<name>.py in a subprocess from `cwd`; returns the finished process. run_main is faster where
    the test needs no command line of its own."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    full_env.update(env or {})
    full_env = {key: value for key, value in full_env.items() if value is not None}  # None: unset
    return subprocess.run(
        [sys.executable, str(LEANRL / f"{name}.py"), *map(str, flags)],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


# torchrun's variables: a script run in-process forms a group of one process, as when run without torchrun
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _Output(io.StringIO):
    encoding = "utf-8"  # as a pipe reads to a subprocess: tyro's help draws its boxes by the output's encoding


@contextlib.contextmanager
def _environment(changes):
    """os.environ with `changes` applied (None: unset), restored afterwards."""
    saved = {key: os.environ.get(key) for key in changes}
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(value)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_main(name, *flags, cwd, env=None):
    """Runs leanrl/<name>.py's main() in this process, as run_script runs the script: from `cwd`, with `env` added
    to the environment (WANDB_MODE=disabled unless given) and no torchrun variables, its stdout and stderr
    captured. Returns a finished process: the exit code is the summary's exit_code, or that of a SystemExit (bad
    input, --help). Seconds faster than a subprocess: no imports, and torch.compile's caches stay warm. Each
    script still runs once as a command (test_bad_input_on_the_command_line) and under its own signals."""
    import torch.distributed as dist

    flags = [str(f) for f in flags]
    changes = {**dict.fromkeys(TORCHRUN_VARIABLES), "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    changes.update(env or {})
    if dist.is_available() and dist.is_initialized():  # left by a test that failed half-way
        dist.destroy_process_group()
    module = load_script(name)
    out, err, returncode, here = _Output(), _Output(), None, os.getcwd()
    try:
        with _environment(changes), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(sys, "argv", [f"{name}.py", *flags]):  # a resumed run reads which flags were typed
            os.chdir(cwd)
            try:
                returncode = module.main(tyro.cli(module.Args, args=flags, prog=f"{name}.py"))["exit_code"]
            except SystemExit as exit:
                if exit.code is None or isinstance(exit.code, int):
                    returncode = exit.code or 0
                else:  # sys.exit("message"): Python prints the message and exits with 1
                    print(exit.code, file=sys.stderr)
                    returncode = 1
            finally:
                os.chdir(here)
                if "--track" in flags and "wandb" in sys.modules:
                    sys.modules["wandb"].teardown()  # its service process, as the end of a subprocess ends it
    except BaseException:
        print(out.getvalue(), err.getvalue()[-5000:], sep="\n", file=sys.stderr)  # shown with the failure
        raise
    finally:
        left = dist.is_available() and dist.is_initialized()
        if left:  # a run ends without a process group, whatever it ran into: the next test starts without one
            dist.destroy_process_group()
    assert not left, f"{name}.py left a process group behind"
    return subprocess.CompletedProcess([f"{name}.py", *flags], returncode, out.getvalue(), err.getvalue())


def summary_of(proc, cwd):
    """Checks the run's summary contract and returns the summary: the last stdout line is JSON, and
    runs/<run_name>/summary.json holds the same object."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, "no stdout: " + proc.stderr[-2000:]
    summary = json.loads(lines[-1], parse_constant=reject_non_json)
    with open(Path(cwd) / "runs" / summary["run_name"] / "summary.json") as f:
        assert json.load(f) == summary
    check_metrics_csv(Path(cwd) / "runs" / summary["run_name"] / "metrics.csv", summary)
    return summary


def check_metrics_csv(path, summary):
    """The run's curve: a header row, then one row per logged point with increasing global steps, the
    last at the end of the run and with the summary's last losses (a diverged loss, null in the
    summary, is nan or inf in the file)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, f"{path} has no rows"
    assert list(rows[0])[:4] == ["global_step", "wall_seconds", "episodic_return", "sps"]
    steps = [int(row["global_step"]) for row in rows]
    assert steps == sorted(set(steps)) and steps[-1] == summary["global_step"], steps
    if summary["episodic_return"] is not None:
        assert float(rows[-1]["episodic_return"]) == summary["episodic_return"]
    for key, value in summary["losses"].items():
        if value is None:
            assert not math.isfinite(float(rows[-1][key])), (key, rows[-1][key])
        else:
            assert float(rows[-1][key]) == value, (key, rows[-1][key], value)


def assert_rejected(script, flags, message, capsys):
    """main() with these flags stops before any work: exit code 2, nothing on stdout, one line
    `error: ...` on stderr that contains `message`. In-process: a subprocess per case would cost
    seconds of imports (assert_rejected_on_the_command_line runs the command itself)."""
    module = load_script(script)
    with pytest.raises(SystemExit) as exit, mock.patch.object(sys, "argv", [f"{script}.py", *flags]):
        module.main(tyro.cli(module.Args, args=flags))
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert out == ""


def assert_rejected_on_the_command_line(script, flags, message, cwd):
    proc = run_script(script, *flags, cwd=cwd)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def reject_non_json(constant):
    raise AssertionError(f"{constant} in the summary: not valid JSON")


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


@pytest.fixture(autouse=True)
def environment_and_import_path_restored():
    """A script run in this process may set variables (MUJOCO_GL for a headless --capture-video) or extend sys.path
    (an env module beside the user): the next test starts without them."""
    environ, path = dict(os.environ), list(sys.path)
    yield
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path


@pytest.fixture
def no_tf32():
    """Full float32 matmuls and convolutions on a GPU, as on the CPU: TF32 rounding would hide a real difference
    between a twin and its eager script behind the tolerance, or fail a correct twin."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _missing_simulator(**kwargs):
    raise ImportError("the simulator of this env is not installed")


# an env whose simulator is missing (as CarRacing is without Box2D), whatever this machine has installed
MISSING_SIMULATOR = "LeanrlMissingSimulator-v0"
gym.register(MISSING_SIMULATOR, entry_point=_missing_simulator)
