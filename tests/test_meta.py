"""The repository's promises about itself: every script paired, tested, in run.sh; README and CI agree."""

import os
import re
import subprocess

from conftest import LEANRL, ROOT

SCRIPTS = sorted(p.stem for p in LEANRL.glob("*.py"))
EAGER = [s for s in SCRIPTS if not s.endswith("_torchcompile")]


def test_every_eager_script_has_a_compiled_twin_and_back():
    assert EAGER, "no scripts found"
    for name in SCRIPTS:
        pair = name[: -len("_torchcompile")] if name.endswith("_torchcompile") else f"{name}_torchcompile"
        assert pair in SCRIPTS, f"{name} has no twin {pair}"


def test_every_script_is_tested():
    test_text = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_meta.py")
    for name in SCRIPTS:
        assert f'"{name}"' in test_text, f"no test names {name}"


def test_run_sh_covers_every_script_and_names_existing_files():
    out = subprocess.run(
        ["bash", str(ROOT / "run.sh")], env={**os.environ, "DRY_RUN": "1", "SCRIPTS": " ".join(EAGER), "SEEDS": "1"},
        capture_output=True, text=True, check=True,
    ).stdout
    commands = [line for line in out.splitlines() if line.startswith("python ")]
    script_of = {c: next(word for word in c.split() if word.endswith(".py")) for c in commands}  # after torchrun's flags, if any
    for c in commands:
        assert os.path.exists(script_of[c]), c
    # the report on the results folder comes last, after every script's runs
    assert os.path.samefile(script_of[commands[-1]], ROOT / "benchmarks" / "report.py"), commands[-1]
    commands = commands[:-1]
    named = {os.path.basename(script_of[c])[: -len(".py")] for c in commands}
    assert named == set(SCRIPTS)
    for twin in (s for s in SCRIPTS if s.endswith("_torchcompile")):  # each twin in its four variants
        # the flags after "--total-timesteps N"
        flags = {" ".join(c.split("--total-timesteps ")[1].split()[1:]) for c in commands if f"/{twin}.py" in c}
        assert flags == {"", "--compile", "--cudagraphs", "--compile --cudagraphs"}, flags


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    test_cmd = next(b for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()
    for path in re.findall(r"requirements/[\w.-]+", readme + ci):
        assert (ROOT / path).exists(), path
