"""A new user's first hour with a copied script: an env of their own (gymnasium's module:EnvId), --track without a
wandb login, --capture-video on a machine without a display, and no noise that is not theirs on stderr."""

import csv
import importlib.util
import io
import os
import subprocess
import sys

import pytest
from conftest import LEANRL, assert_rejected, load_script, run_main, run_script, summary_of

try:
    import envpool  # noqa: F401
    HAS_ENVPOOL = True
except ImportError:
    HAS_ENVPOOL = False

# the gymnasium-env scripts, each with a short run that reaches updates on an env like the one it is made for
SHORT = {
    "ppo_continuous_action": ["--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "1",
                              "--total-timesteps", "128"],
    "sac_continuous_action": ["--learning-starts", "100", "--total-timesteps", "150", "--batch-size", "32"],
    "td3_continuous_action": ["--learning-starts", "100", "--total-timesteps", "150", "--batch-size", "32"],
    "dqn": ["--learning-starts", "100", "--total-timesteps", "150", "--batch-size", "32"],
}
GYM_SCRIPTS = [name for script in SHORT for name in (script, f"{script}_torchcompile")]
# an env module as a user writes one: its own class (here a renamed classic-control env), registered on import
ENV_MODULE = """import gymnasium as gym
from gymnasium.envs.classic_control.{file} import {base}


class My{kind}({base}):
    pass


gym.register(id="{env}", entry_point="{module}:My{kind}", max_episode_steps=50)
"""
BASES = {"Pendulum": ("pendulum", "PendulumEnv"), "CartPole": ("cartpole", "CartPoleEnv")}


def write_env_module(folder, module, env, kind):
    file, base = BASES[kind]
    (folder / f"{module}.py").write_text(ENV_MODULE.format(file=file, base=base, kind=kind, env=env, module=module))


def test_every_gymnasium_script_is_covered_here():
    scripts = {p.stem for p in LEANRL.glob("*.py") if "atari" not in p.stem}
    assert scripts == set(GYM_SCRIPTS)


@pytest.mark.parametrize("name", GYM_SCRIPTS)
def test_an_env_of_your_own_as_module_colon_id(name, workdir):
    """A module beside the user registers the env when imported: `--env-id my_envs:MyEnv-v0` trains on it, from the
    folder the script runs in (not the script's own), and the run's folder name has no colon."""
    script = name.removesuffix("_torchcompile")
    kind = "CartPole" if script == "dqn" else "Pendulum"
    module, env = f"my_envs_{name}", f"My{kind}{GYM_SCRIPTS.index(name)}-v0"  # imported once in this process
    write_env_module(workdir, module, env, kind)
    summary = summary_of(run_main(name, "--env-id", f"{module}:{env}", *SHORT[script], cwd=workdir), workdir)
    assert summary["env_id"] == f"{module}:{env}" and summary["global_step"] == (128 if script.startswith("ppo") else 150)
    assert summary["episodes"] >= 2 and summary["losses"]  # 50-step episodes, and updates ran
    assert summary["run_name"].startswith(f"{module}-{env}__") and (workdir / "runs" / summary["run_name"]).is_dir()


def test_an_env_of_your_own_from_the_command_line(workdir):
    """As a user runs it: the script from its own folder, the env module in the folder the command runs from."""
    write_env_module(workdir, "my_envs", "MyPendulum-v0", "Pendulum")
    proc = run_script("sac_continuous_action", "--env-id", "my_envs:MyPendulum-v0", *SHORT["sac_continuous_action"],
                      cwd=workdir)
    assert summary_of(proc, workdir)["episodes"] == 3


@pytest.mark.parametrize("name", GYM_SCRIPTS)
@pytest.mark.parametrize(
    "module_text, env_id, message",
    [
        (None, "no_such_module:MyEnv-v0", "--env-id no_such_module:MyEnv-v0: cannot import no_such_module "
                                          "(ModuleNotFoundError: No module named 'no_such_module')"),
        ("import gymnasium\n", "empty_envs:MyEnv-v0", "--env-id empty_envs:MyEnv-v0: empty_envs imports, but "
                                                      "registers no env 'MyEnv-v0': have it call gymnasium.register"),
        ("import no_such_dependency\n", "broken_envs:MyEnv-v0", "--env-id broken_envs:MyEnv-v0: cannot import "
         "broken_envs (ModuleNotFoundError: No module named 'no_such_dependency')"),  # no hint about the folder
    ],
    ids=["module-not-found", "id-not-registered", "module-import-fails"],
)
def test_an_env_module_that_fails_names_which_part(name, module_text, env_id, message, workdir, monkeypatch, capsys):
    if module_text:
        (workdir / f"{env_id.split(':')[0]}.py").write_text(module_text)
    monkeypatch.chdir(workdir)
    assert_rejected(name, ["--env-id", env_id], message, capsys)
    assert not (workdir / "runs").exists()


@pytest.mark.skipif(not HAS_ENVPOOL, reason="envpool is not installed: pip install -r requirements/requirements-atari.txt")
@pytest.mark.parametrize("name", ["ppo_atari_envpool", "ppo_atari_envpool_multigpu_torchcompile"])
def test_the_envpool_scripts_say_they_take_atari_games_only(name, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert_rejected(name, ["--env-id", "my_envs:MyEnv-v0"], "not gymnasium's module:EnvId; for an env of your own "
                    "use ppo_continuous_action.py (continuous actions) or dqn.py (discrete)", capsys)


def without_wandb_login(workdir):
    """The environment of a machine where wandb was never logged into: no key, no mode, a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    return {**env, "HOME": str(workdir), "PYTHONUNBUFFERED": "1"}


def test_track_without_a_login_and_without_a_terminal_is_one_line(workdir):
    """A batch job (no terminal for wandb to ask for a key on) stops before any env is made, with both ways out."""
    proc = subprocess.run([sys.executable, str(LEANRL / "sac_continuous_action.py"), "--track", "--env-id", "Pendulum-v1"],
                          cwd=workdir, env=without_wandb_login(workdir), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --track finds no wandb login: run `wandb login`, or set WANDB_MODE=offline to log here and "
        "`wandb sync` later"]
    assert not (workdir / "runs").exists() and not (workdir / "wandb").exists()


def test_track_offline_logs_what_metrics_csv_holds(workdir, monkeypatch):
    """WANDB_MODE=offline and no login: an offline run under wandb/, logged at metrics.csv's steps with its values."""
    import wandb

    logged, log = [], wandb.Run.log  # wandb.init points wandb.log at its run's

    def spy(run, data, step):
        logged.append({**data, "global_step": step})
        return log(run, data, step=step)

    monkeypatch.setattr(wandb.Run, "log", spy)
    proc = run_main("dqn", "--track", "--env-id", "CartPole-v1", *SHORT["dqn"], "--log-every", "25", cwd=workdir,
                    env={"WANDB_MODE": "offline", "HOME": str(workdir), "WANDB_API_KEY": None})
    summary = summary_of(proc, workdir)
    with open(workdir / "runs" / summary["run_name"] / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]  # "": no value yet
    assert len(rows) >= 3 and logged == [pytest.approx(row, rel=1e-6) for row in rows]
    runs = list((workdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and next(runs[0].glob("*.wandb")).stat().st_size > 0


def egl_works():
    code = "import mujoco; mujoco.GLContext(8, 8).make_current()"
    env = {**os.environ, "MUJOCO_GL": "egl"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0


NO_DISPLAY = dict.fromkeys(("DISPLAY", "WAYLAND_DISPLAY", "MUJOCO_GL", "SDL_VIDEODRIVER", "PYOPENGL_PLATFORM"))
VIDEO_RUN = ["--capture-video", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1",
             "--total-timesteps", "64"]


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "HalfCheetah-v5"])
def test_capture_video_without_a_display(env_id, workdir):
    """No DISPLAY and MUJOCO_GL unset: MuJoCo renders through EGL (one note says so), pygame off-screen, and the
    first episode's video is written; nothing else on stderr but the CUDA note and the progress bar."""
    if env_id == "HalfCheetah-v5" and not egl_works():
        pytest.skip("no EGL on this machine (the headless GL backend the scripts pick): MuJoCo cannot render here")
    proc = run_script("ppo_continuous_action", "--env-id", env_id, *VIDEO_RUN, cwd=workdir, env=NO_DISPLAY)
    summary = summary_of(proc, workdir)
    videos = list((workdir / "videos" / summary["run_name"]).glob("rl-video-episode-0.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 1000
    egl_note = "note: no display: MuJoCo renders the videos with MUJOCO_GL=egl (set MUJOCO_GL to choose)"
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip() and "it/s" not in line
             and "?it" not in line and "s/it" not in line]
    expected = ([egl_note] if env_id == "HalfCheetah-v5" else []) + ["note: CUDA is not available, running on the CPU"]
    assert lines == expected, proc.stderr  # neither MuJoCo's settotalmass warning nor SDL's complaints


def test_capture_video_that_cannot_render_is_one_line_before_any_folder(workdir):
    """MUJOCO_GL=glfw without a display: one error line that names MUJOCO_GL, before training and before videos/."""
    proc = run_script("sac_continuous_action", "--env-id", "HalfCheetah-v5", "--capture-video", cwd=workdir,
                      env={**NO_DISPLAY, "MUJOCO_GL": "glfw"})
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --capture-video cannot render HalfCheetah-v5 here (")
    assert "without a display a MuJoCo env needs MUJOCO_GL=egl or osmesa" in lines[0]
    assert not (workdir / "videos").exists() and not (workdir / "runs").exists()


def test_capture_video_without_moviepy_leaves_no_folder(workdir, monkeypatch, capsys):
    module = load_script("td3_continuous_action")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *a: None if name == "moviepy" else find_spec(name, *a))
    monkeypatch.chdir(workdir)
    assert_rejected("td3_continuous_action", ["--capture-video"], "--capture-video needs moviepy: pip install moviepy",
                    capsys)
    assert not (workdir / "videos").exists()


def test_a_compiled_run_does_not_print_the_profiler_hook_warning(workdir):
    """torch.compile's warning that it ignores the optimiser's profiler hook is not the user's business."""
    proc = run_script("dqn_torchcompile", "--compile", "--env-id", "CartPole-v1", *SHORT["dqn"], cwd=workdir)
    summary_of(proc, workdir)
    assert "Profiler" not in proc.stderr and "torch/_logging" not in proc.stderr, proc.stderr


def test_mujocos_settotalmass_warning_is_dropped_and_its_others_kept(capsys):
    """gymnasium's own MuJoCo models set an attribute MuJoCo 4 deprecates: that warning is dropped, any other that
    MuJoCo gives still reaches stderr."""
    import mujoco

    load_script("sac_continuous_action").env_spaces("HalfCheetah-v5")
    warn = mujoco.get_mju_user_warning()
    warn("compiler attribute 'settotalmass' is deprecated and will be removed in a future release")
    warn("Nan, Inf or huge value in QACC at DOF 0. The simulation is unstable.")
    assert capsys.readouterr().err == "WARNING: Nan, Inf or huge value in QACC at DOF 0. The simulation is unstable.\n"


@pytest.mark.parametrize(
    "files, variables, finds_a_login",
    [
        ({}, {}, False),
        ({".netrc": "machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n"}, {}, True),
        ({}, {"WANDB_API_KEY": "b" * 40}, True),
        ({".config/wandb/settings": "[default]\nmode = offline\n"}, {}, True),  # `wandb offline` wrote it
        ({}, {"WANDB_MODE": "offline"}, True),
    ],
    ids=["nothing", "netrc", "api-key", "wandb-offline", "wandb-mode"],
)
def test_track_finds_a_login_without_asking_wandb(files, variables, finds_a_login, workdir, monkeypatch):
    """The --track check reads what `wandb login` and `wandb offline` leave, silently and without the network."""
    for name, text in files.items():
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text)
        (workdir / name).chmod(0o600)
    for key in [k for k in os.environ if k.startswith("WANDB_") or k == "NETRC"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(workdir))
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # no terminal, where wandb would ask for a key
    monkeypatch.chdir(workdir)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    error = load_script("dqn").wandb_error()
    assert (error is None) == finds_a_login, error


def test_track_without_wandb_installed_is_one_line(workdir, monkeypatch, capsys):
    module = load_script("td3_continuous_action")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    monkeypatch.chdir(workdir)
    assert_rejected("td3_continuous_action", ["--track"], "--track needs wandb: pip install wandb", capsys)
