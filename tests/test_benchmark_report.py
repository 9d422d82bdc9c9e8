"""benchmarks/report.py on a made-up results folder (exact numbers), on a real run.sh run, and on a
folder with no runs."""

import json
import os
import subprocess
import sys

from conftest import ROOT

REPORT = ROOT / "benchmarks" / "report.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report(*args, **kwargs):
    return subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True, text=True, timeout=120, **kwargs)


def table_rows(markdown):
    """{(algorithm, env, variant): {column: cell}} from report.md's table."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return {(r["algorithm"], r["env"], r["variant"]): r for r in rows}


def write_run(results, script, seed, sps, episodic_return, compile=False, cudagraphs=False, env_id="Pendulum-v1",
              compile_seconds=1.0, curve=None, started=1_790_000_000, **extra):
    """One run's folder as the scripts write it: summary.json, and metrics.csv when `curve` is given
    as [(global_step, episodic_return or None)]."""
    started += 600 * len(list(results.glob("runs/*")))  # ten minutes after the run before
    run_name = f"{env_id}__{script[: -len('.py')]}__{seed}__{started}"
    folder = results / "runs" / run_name
    folder.mkdir(parents=True)
    summary = {
        "script": script, "env_id": env_id, "seed": seed, "compile": compile, "cudagraphs": cudagraphs,
        "device": "cpu", "torch": "2.13.0", "global_step": 300, "wall_seconds": 3.0, "compile_seconds": compile_seconds,
        "sps": sps, "episodic_return": episodic_return, "episodes": 1, "losses": {}, "run_name": run_name, **extra,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    if curve is not None:
        rows = ["global_step,wall_seconds,episodic_return,sps,qf_loss,actor_loss,alpha"]
        rows += [f"{step},0.1,{'' if ret is None else ret},,,," for step, ret in curve]
        (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_report_numbers_and_plots(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    sac, twin = "sac_continuous_action.py", "sac_continuous_action_torchcompile.py"
    curve = [(1, None), (200, -1300.0), (300, -1250.5)]
    write_run(results, sac, 1, 100.0, -1200.0, compile_seconds=0.5, curve=curve)
    write_run(results, sac, 2, 200.0, -1000.0, compile_seconds=0.7, curve=curve)
    write_run(results, twin, 1, 150.0, -1100.0, curve=curve)
    # a --cudagraphs run on a CPU records cudagraphs=false: it is the twin without flags
    write_run(results, twin, 2, 250.0, -1100.0, curve=curve)
    write_run(results, twin, 1, 300.0, -900.0, compile=True, compile_seconds=20.0)
    write_run(results, twin, 2, 330.0, -700.0, compile=True, compile_seconds=30.0)
    write_run(results, twin, 3, None, -800.0, compile=True, compile_seconds=40.0)  # too short for a steady state
    write_run(results, twin, 1, 500.0, None, compile=True, cudagraphs=True)
    write_run(results, "td3_continuous_action_torchcompile.py", 1, 80.0, -300.0, env_id="Hopper-v5", curve=[(100, -300.0)])

    proc = report(results, "--out", out)
    assert proc.returncode == 0, proc.stderr
    markdown = (out / "report.md").read_text()
    assert "| algorithm |" in proc.stdout and proc.stdout.strip() == markdown.strip()
    assert "device: cpu; torch: 2.13.0; runs started 2026-09-21 14:13 to 2026-09-21 15:33 UTC." in markdown
    rows = table_rows(markdown)
    pend = ("sac_continuous_action", "Pendulum-v1")
    assert list(rows) == [
        (*pend, "eager"), (*pend, "twin (no flags)"), (*pend, "twin --compile"), (*pend, "twin --compile --cudagraphs"),
        ("td3_continuous_action", "Hopper-v5", "twin (no flags)"),
    ]
    expected = {  # runs, sps, compile s, return, speed-up (sample std: 100, 200 -> 70.7)
        "eager": ("2", "150.0 ± 70.7", "0.6", "-1100.0 ± 141.4", "1.00x"),
        "twin (no flags)": ("2", "200.0 ± 70.7", "1.0", "-1100.0 ± 0.0", "1.33x"),
        "twin --compile": ("3", "315.0 ± 21.2 (n=2)", "30.0", "-800.0 ± 100.0", "2.10x"),
        "twin --compile --cudagraphs": ("1", "500.0", "1.0", "-", "3.33x"),
    }
    for variant, cells in expected.items():
        row = rows[(*pend, variant)]
        assert (row["runs"], row["sps"], row["compile s"], row["return"], row["speed-up"]) == cells, row
        assert row["global steps"] == "300"
    td3 = rows[("td3_continuous_action", "Hopper-v5", "twin (no flags)")]
    assert (td3["sps"], td3["speed-up"]) == ("80.0", "-")  # no eager run to compare with
    for name in ("sps.png", "returns.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    assert not (results / "report.md").exists()  # --out, not the results folder


def test_run_sh_end_to_end(tmp_path):
    """run.sh for real on two variants and two seeds of a short SAC run, then the report it ends with."""
    results = tmp_path / "results"
    env = {
        **os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",  # run.sh calls `python`
        # one thread: two OpenMP threads on two cores slow down ~50x while any other process is busy
        "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "SCRIPTS": "sac_continuous_action", "VARIANTS": "eager twin", "SEEDS": "1 2",
        "STEPS": "300", "EXTRA": "--env-id Pendulum-v1 --learning-starts 100", "RESULTS": str(results),
    }
    proc = subprocess.run(["bash", str(ROOT / "run.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr, proc.stderr[-3000:]
    summaries = sorted(results.glob("runs/*/summary.json"))
    assert len(summaries) == 4, summaries
    rows = table_rows((results / "report.md").read_text())
    assert set(rows) == {("sac_continuous_action", "Pendulum-v1", v) for v in ("eager", "twin (no flags)")}
    for row in rows.values():
        assert row["runs"] == "2" and row["global steps"] == "300" and "(n=" not in row["sps"] + row["return"], row
    assert rows[("sac_continuous_action", "Pendulum-v1", "eager")]["speed-up"] == "1.00x"
    assert (results / "sps.png").read_bytes()[:8] == PNG_MAGIC
    curves = list(results.glob("runs/*/metrics.csv"))
    assert len(curves) == 4, f"{len(curves)} of 4 runs wrote runs/<run_name>/metrics.csv: the scripts must write it for returns.png"
    assert (results / "returns.png").read_bytes()[:8] == PNG_MAGIC


def test_no_runs_is_one_line_error(tmp_path):
    proc = report(tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no runs/*/summary.json under"), proc.stderr


def test_runs_of_several_processes_are_rows_of_their_own(tmp_path):
    """The multi-process script's sps counts every process's steps: 2 processes are not averaged with
    1, and their speed-up is against the eager script run by as many processes."""
    results = tmp_path / "results"
    multi, twin = "ppo_atari_envpool_multigpu.py", "ppo_atari_envpool_multigpu_torchcompile.py"
    write_run(results, multi, 1, 100.0, 1.0, env_id="Breakout-v5", world_size=1)
    write_run(results, multi, 1, 180.0, 1.0, env_id="Breakout-v5", world_size=2)
    write_run(results, twin, 1, 360.0, 1.0, env_id="Breakout-v5", world_size=2, compile=True)
    proc = report(results, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    rows = table_rows((tmp_path / "out" / "report.md").read_text())
    assert set(rows) == {
        ("ppo_atari_envpool_multigpu", "Breakout-v5", "eager"),
        ("ppo_atari_envpool_multigpu x2", "Breakout-v5", "eager"),
        ("ppo_atari_envpool_multigpu x2", "Breakout-v5", "twin --compile"),
    }
    assert rows["ppo_atari_envpool_multigpu x2", "Breakout-v5", "twin --compile"]["speed-up"] == "2.00x"
