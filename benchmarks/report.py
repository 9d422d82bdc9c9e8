"""Tables and plots for a results folder written by run.sh: one row per algorithm, env and variant.

    python benchmarks/report.py results/20261122-015756              # writes into the results folder
    python benchmarks/report.py results/20261122-015756 --out report # or into another folder

Reads every RESULTS_DIR/runs/*/summary.json and, where the run wrote one, the metrics.csv beside it.
Writes report.md (the table, also printed on stdout), sps.png (steady-state sps per variant) and
returns.png (episodic return against global step, one thin line per run). The variant is read from
what each run recorded, not from the flags it was given: on a machine without CUDA a `--cudagraphs`
run records cudagraphs=false and counts as the twin without it.
"""

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

# in run.sh's order (its VARIANTS names), with the labels the table and the plots show
VARIANTS = {
    "eager": "eager",
    "twin": "twin (no flags)",
    "compile": "twin --compile",
    "cudagraphs": "twin --cudagraphs",
    "compile+cudagraphs": "twin --compile --cudagraphs",
}
COLOURS = dict(zip(VARIANTS, ("C0", "C1", "C2", "C3", "C4")))  # the same colour per variant in both plots
REQUIRED = {"script", "env_id", "seed", "compile", "cudagraphs", "device", "torch", "global_step", "compile_seconds", "sps", "episodic_return", "run_name"}


def fail(message: str):
    """Stops with a one-line message and exit code 2, as the scripts do on bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def variant_of(summary: dict) -> str:
    if not summary["script"].endswith("_torchcompile.py"):
        return "eager"
    flags = [name for name in ("compile", "cudagraphs") if summary[name]]
    return "+".join(flags) or "twin"


def load_runs(results_dir: Path) -> list:
    """The summaries under results_dir/runs, each with its algorithm, variant and metrics.csv path
    (None where the run wrote none)."""
    paths = sorted(results_dir.glob("runs/*/summary.json"))
    if not paths:
        fail(f"no runs/*/summary.json under {results_dir}: give the folder that run.sh printed (RESULTS)")
    runs = []
    for path in paths:
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            fail(f"{path} is not valid JSON: {e}")
        missing = REQUIRED - summary.keys()
        if missing:
            fail(f"{path} lacks {', '.join(sorted(missing))}: was it written by a leanrl script?")
        metrics = path.with_name("metrics.csv")
        runs.append({
            **summary,
            # a multi-process run is its own row: its sps counts every process's steps
            "algorithm": summary["script"][: -len(".py")].removesuffix("_torchcompile") + (f" x{summary['world_size']}" if summary.get("world_size", 1) > 1 else ""),
            "variant": variant_of(summary),
            "metrics_csv": metrics if metrics.exists() else None,
        })
    return runs


def group_runs(runs: list) -> dict:
    """{(algorithm, env_id, variant): runs}, sorted by algorithm, env and run.sh's variant order."""
    groups = defaultdict(list)
    for run in runs:
        groups[run["algorithm"], run["env_id"], run["variant"]].append(run)
    order = list(VARIANTS)
    return dict(sorted(groups.items(), key=lambda item: (item[0][0], item[0][1], order.index(item[0][2]))))


def stats(values) -> tuple:
    """(n, mean, sample std) of the values that are not None; the mean is nan without values, the
    std without two."""
    v = np.array([x for x in values if x is not None], dtype=float)
    return len(v), float(v.mean()) if len(v) else math.nan, float(v.std(ddof=1)) if len(v) > 1 else math.nan


def cell(values: list, digits: int = 1, with_std: bool = True) -> str:
    """`mean ± std`, with `(n=k)` where only k of the row's runs had a value; `-` where none had."""
    n, mean, std = stats(values)
    if n == 0:
        return "-"
    text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if with_std and n > 1 else "")
    return text + (f" (n={n})" if n < len(values) else "")


def table(groups: dict) -> str:
    eager_sps = {key[:2]: stats(r["sps"] for r in runs)[1] for key, runs in groups.items() if key[2] == "eager"}
    lines = [
        "| algorithm | env | variant | runs | global steps | sps | compile s | return | speed-up |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (algorithm, env_id, variant), runs in groups.items():
        sps = stats(r["sps"] for r in runs)[1]
        eager = eager_sps.get((algorithm, env_id), math.nan)
        speedup = f"{sps / eager:.2f}x" if math.isfinite(sps) and math.isfinite(eager) and eager > 0 else "-"
        steps = ", ".join(str(s) for s in sorted({r["global_step"] for r in runs}))
        lines.append(
            f"| {algorithm} | {env_id} | {VARIANTS[variant]} | {len(runs)} | {steps} | {cell([r['sps'] for r in runs])} "
            f"| {cell([r['compile_seconds'] for r in runs], with_std=False)} | {cell([r['episodic_return'] for r in runs])} | {speedup} |"
        )
    return "\n".join(lines)


def header(results_dir: Path, runs: list) -> str:
    lines = [f"# Benchmark report: {results_dir.resolve().name}", ""]
    facts = [f"device: {', '.join(sorted({r['device'] for r in runs}))}", f"torch: {', '.join(sorted({r['torch'] for r in runs}))}"]
    # run_name ends in the unix time at which the run started
    starts = [int(r["run_name"].rsplit("__", 1)[-1]) for r in runs if r["run_name"].rsplit("__", 1)[-1].isdigit()]
    if starts:
        first, last = (datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M") for t in (min(starts), max(starts)))
        facts.append(f"runs started {first} to {last} UTC")
    return "\n".join(lines + ["; ".join(facts) + ".", ""])


LEGEND = """
sps: steady-state environment steps per second (warm-up and compile left out), mean ± sample std over
the runs; (n=k): only k of the row's runs recorded a value, the mean is over those. compile s: mean
wall time of the burn-in iterations (compile and warm-up). return: each run's final episodic return
(the mean of its last finished episodes), mean ± sample std. speed-up: mean sps over the mean sps of
the same algorithm and env's eager script.
"""


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed), or None if matplotlib is
    not installed: the table does not need it."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed (pip install -r requirements/requirements-bench.txt): no plots", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels(plt, n: int):
    """A figure with n subplots, up to three a row; returns (figure, axes), unused axes hidden."""
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.0 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes.flat


def plot_sps(plt, groups: dict, path: Path):
    by_panel = defaultdict(dict)  # (algorithm, env_id) -> {variant: runs}
    for (algorithm, env_id, variant), runs in groups.items():
        by_panel[algorithm, env_id][variant] = runs
    fig, axes = panels(plt, len(by_panel))
    for ax, ((algorithm, env_id), variants) in zip(axes, by_panel.items()):
        means, stds = zip(*(stats(r["sps"] for r in runs)[1:] for runs in variants.values()))
        x = np.arange(len(variants))
        # a variant with no recorded sps keeps its label and gets no bar (nan height)
        ax.bar(x, means, yerr=np.nan_to_num(stds), capsize=4, color=[COLOURS[v] for v in variants])
        ax.set_xticks(x, [VARIANTS[v] for v in variants], rotation=20, ha="right")
        ax.set_title(f"{algorithm}\n{env_id}", fontsize=10)
        ax.set_ylabel("steady-state sps (mean ± std over runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_curve(path: Path) -> tuple:
    """(global_step, episodic_return) arrays from a metrics.csv; rows without a return yet are left out."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not {"global_step", "episodic_return"} <= set(reader.fieldnames or ()):
            fail(f"{path} has no global_step and episodic_return columns")
        points = [(float(row["global_step"]), float(row["episodic_return"])) for row in reader if row["episodic_return"]]
    return np.array(points, dtype=float).reshape(-1, 2).T


def plot_returns(plt, groups: dict, path: Path) -> bool:
    """Draws returns.png from the runs that wrote a metrics.csv; False (and no file) if none did."""
    by_panel = defaultdict(list)  # (algorithm, env_id) -> [(variant, steps, returns)]
    for (algorithm, env_id, variant), runs in groups.items():
        for run in runs:
            if run["metrics_csv"] is not None:
                by_panel[algorithm, env_id].append((variant, *read_curve(run["metrics_csv"])))
    if not by_panel:
        return False
    fig, axes = panels(plt, len(by_panel))
    for ax, ((algorithm, env_id), curves) in zip(axes, by_panel.items()):
        labelled = set()
        for variant, steps, returns in curves:  # one thin line per run, one colour per variant
            label = None if variant in labelled else VARIANTS[variant]
            labelled.add(variant)
            marker = "o" if len(steps) == 1 else None  # a single logged point draws no line
            ax.plot(steps, returns, color=COLOURS[variant], linewidth=0.8, alpha=0.8, marker=marker, label=label)
        ax.set_title(f"{algorithm}\n{env_id}", fontsize=10)
        ax.set_xlabel("global step")
        ax.set_ylabel("episodic return")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tables and plots for a results folder written by run.sh.")
    parser.add_argument("results_dir", type=Path, help="the folder run.sh wrote (it holds runs/*/summary.json)")
    parser.add_argument("--out", type=Path, help="where report.md, sps.png and returns.png go (default: RESULTS_DIR)")
    args = parser.parse_args(argv)
    runs = load_runs(args.results_dir)
    groups = group_runs(runs)
    out = args.out or args.results_dir
    out.mkdir(parents=True, exist_ok=True)

    report = header(args.results_dir, runs) + "\n" + table(groups) + "\n" + LEGEND
    (out / "report.md").write_text(report)
    print(report, end="")
    written = ["report.md"]
    plt = pyplot()
    if plt is not None:
        plot_sps(plt, groups, out / "sps.png")
        written.append("sps.png")
        if plot_returns(plt, groups, out / "returns.png"):
            written.append("returns.png")
        else:
            print("note: no run wrote a metrics.csv: no returns.png", file=sys.stderr)
    print(f"wrote {', '.join(written)} in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
