"""The repository's promises about itself: every script paired, tested, in run.sh; README and CI agree."""

import ast
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


BLOCK_START = "# " + "=" * 114 + "\n# PLUMBING:"
LEAN = SCRIPTS  # every script has the lean shape


def plumbing_block(name):
    text = (LEANRL / f"{name}.py").read_text()
    return text[text.index(BLOCK_START) : text.index('\n\nif __name__ == "__main__":')] if BLOCK_START in text else None


def test_plumbing_block_is_the_same_in_every_script():
    blocks = {name: plumbing_block(name) for name in SCRIPTS}
    assert all(blocks[name] for name in LEAN), [name for name in LEAN if not blocks[name]]
    reference = blocks[LEAN[0]]
    for name, block in blocks.items():
        if block is not None:
            assert block == reference, f"the plumbing block of {name}.py differs from {LEAN[0]}.py's"


def test_lean_scripts_keep_their_shape():
    """No line over 120 characters, main() at most 120 lines, the plumbing block at the end of the file."""
    for name in LEAN:
        text = (LEANRL / f"{name}.py").read_text()
        long_lines = [i + 1 for i, line in enumerate(text.splitlines()) if len(line) > 120]
        assert not long_lines, f"{name}.py: lines over 120 characters: {long_lines}"
        main = next(node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef) and node.name == "main")
        length = main.end_lineno - main.lineno + 1
        assert length <= 120, f"{name}.py: main() has {length} lines"
        assert text.index(BLOCK_START) > text.index("\ndef main("), f"{name}.py: the plumbing block comes after main()"
