"""benchmarks/inference.py in a subprocess on tiny settings: the PPO MLP at one batch size, on the CPU."""

import json
import math
import os
import subprocess
import sys

from conftest import ROOT

TINY = ["--device", "cpu", "--nets", "ppo_continuous", "--batch-sizes", "4", "--burnin", "3", "--iters", "20"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_benchmark(*flags, out_dir):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "inference.py"), *flags, "--out-dir", str(out_dir)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600,
    )


def rows_of(out_dir):
    with open(out_dir / "inference.json") as f:
        result = json.load(f)
    assert result["header"]["device"] == "cpu" and result["header"]["torch"]
    return {row["mode"]: row for row in result["rows"]}


def test_tiny_run_writes_the_table_the_json_and_the_plot(tmp_path):
    proc = run_benchmark(*TINY, "--modes", "default", out_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(tmp_path)
    assert set(rows) == {"eager", "default"}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["net"] == "ppo_continuous" and row["batch_size"] == 4
        assert row["median_us"] > 0 and row["samples_per_s"] > 0
    assert math.isfinite(rows["default"]["speedup_pct"])
    assert (tmp_path / "inference.png").read_bytes().startswith(PNG_MAGIC)
    table = (tmp_path / "inference.md").read_text()
    assert "| ppo_continuous | 4 | eager |" in table and "| ppo_continuous | 4 | default |" in table
    assert table in proc.stdout


def test_a_mode_that_fails_to_compile_is_a_failed_row(tmp_path):
    # torch.compile rejects an unknown mode as it is called: no compile time spent
    proc = run_benchmark(*TINY, "--modes", "no-such-mode", out_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(tmp_path)
    assert rows["eager"]["status"] == "ok"
    failed = rows["no-such-mode"]
    assert failed["status"] == "failed" and failed["median_us"] is None and failed["speedup_pct"] is None
    assert failed["error"].startswith("RuntimeError: ") and "no-such-mode" in failed["error"]
    assert "| no-such-mode | — | — | failed: RuntimeError: " in (tmp_path / "inference.md").read_text()
    assert (tmp_path / "inference.png").read_bytes().startswith(PNG_MAGIC)


def test_bad_input_stops_with_one_line(tmp_path):
    proc = run_benchmark("--device", "cpu", "--burnin", "1", out_dir=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith("error: --burnin must be at least 2")
