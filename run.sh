#!/usr/bin/env bash
# Reproduces the speed table: every script in its variants, over seeds, with each run's summary.json
# under one results folder (results/<date>/runs/<run_name>/summary.json).
#
#   ./run.sh                                   # the full table: 1M steps, seeds 1 2 3 (hours)
#   STEPS=50000 SEEDS=1 ./run.sh               # a short version for a CPU (TD3 needs > 25000, PPO >= 2048)
#   SCRIPTS=ppo_atari_envpool STEPS=100000 ./run.sh   # Atari (needs requirements/requirements-atari.txt)
#   SCRIPTS="sac_continuous_action" ./run.sh   # some scripts only (names without .py)
#   SCRIPTS=ppo_atari_envpool_multigpu NPROC=2 ./run.sh   # data-parallel PPO Atari: torchrun, NPROC processes
#   DRY_RUN=1 ./run.sh                         # print the commands, run nothing
#   EXTRA="--env-id Pendulum-v1" ./run.sh      # flags appended to every command
#   VARIANTS="eager twin compile" ./run.sh     # some variants only (on a CPU --cudagraphs changes nothing)
#
# At the end (not in a dry run) benchmarks/report.py writes report.md, sps.png and returns.png into
# the results folder (the plots need requirements/requirements-bench.txt).
#
# The Breakout learning checks (8 envs, 200,000 steps at a constant learning rate: eager, twin --compile, and the
# multi-process script as 2 processes of 4 envs; 15-20 minutes each on 2 CPU cores) are tests left out of the
# default test run, as are the compiled twins' learning checks on Pendulum and InvertedPendulum:
# python -m pytest tests -m slow
#
# Environment variables: STEPS (total timesteps), SEEDS, SCRIPTS, EXTRA, RESULTS (the folder), DRY_RUN,
# NPROC (processes of the multi-process script, default 1; each steps its own --local-num-envs 8 envs),
# VARIANTS (any of: eager twin compile cudagraphs compile+cudagraphs, the default all five: the eager
# script, its _torchcompile twin with no flag, --compile, --cudagraphs, both).
# Steady-state sps and compile seconds are in each summary: compile time is never in the sps.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
STEPS=${STEPS:-1000000}
SEEDS=${SEEDS:-1 2 3}
SCRIPTS=${SCRIPTS:-ppo_atari_envpool ppo_continuous_action sac_continuous_action td3_continuous_action dqn}
RESULTS=${RESULTS:-$here/results/$(date +%Y%m%d-%H%M%S)}
ALL_VARIANTS="eager twin compile cudagraphs compile+cudagraphs"
VARIANTS=${VARIANTS:-$ALL_VARIANTS}
for variant in $VARIANTS; do  # checked before the first run, not hours into the table
  case " $ALL_VARIANTS " in
    *" $variant "*) ;;
    *) echo "error: unknown variant $variant in VARIANTS (pick from: $ALL_VARIANTS)" >&2; exit 2 ;;
  esac
done

# script -> the variants to run, one "file|flags" line each, in the order of VARIANTS; the twins'
# flags are --compile and --cudagraphs (on a machine without CUDA, --cudagraphs warns and runs
# without graphs)
variants() {
  case $1 in
    ppo_atari_envpool | ppo_atari_envpool_multigpu | ppo_continuous_action | sac_continuous_action | td3_continuous_action | dqn) ;;
    *) echo "unknown script $1" >&2; return 1 ;;
  esac
  for variant in $VARIANTS; do
    case $variant in
      eager) echo "$1|" ;;
      twin) echo "${1}_torchcompile|" ;;
      compile) echo "${1}_torchcompile|--compile" ;;
      cudagraphs) echo "${1}_torchcompile|--cudagraphs" ;;
      compile+cudagraphs) echo "${1}_torchcompile|--compile --cudagraphs" ;;
    esac
  done
}

# per-script settings beyond the defaults (HalfCheetah-v5 for the MuJoCo scripts: SAC and TD3 learn
# from 5000 / 25000 random steps first, PPO updates after each rollout of 2048 steps; Breakout-v5 with
# 8 envs for Atari: an update after each rollout of 8 x 128 steps; CartPole-v1 for DQN: an update every
# 10 steps after 10000)
extra() {
  case $1 in
    ppo_atari_envpool*) echo "--env-id Breakout-v5" ;;
    ppo_continuous_action* | sac_continuous_action* | td3_continuous_action*) echo "--env-id HalfCheetah-v5" ;;
    dqn*) echo "--env-id CartPole-v1" ;;
  esac
}

# the multi-process script runs under torchrun (python -m torch.distributed.run), NPROC processes here
launcher() {
  case $1 in
    ppo_atari_envpool_multigpu*) echo "python -m torch.distributed.run --standalone --nproc_per_node ${NPROC:-1}" ;;
    *) echo "python" ;;
  esac
}

# a dry run creates no results folder
if [ -z "${DRY_RUN:-}" ]; then
  mkdir -p "$RESULTS"
  cd "$RESULTS"
fi
for script in $SCRIPTS; do
  variants "$script" | while IFS='|' read -r file flags; do
    for seed in $SEEDS; do
      cmd="$(launcher "$file") $here/leanrl/$file.py $(extra "$file") --seed $seed --total-timesteps $STEPS $flags ${EXTRA:-}"
      echo "$cmd"
      if [ -z "${DRY_RUN:-}" ]; then
        # the summary line (the progress bar is on stderr); a failed run is reported, the table goes on
        $cmd | tail -n 1 || echo "FAILED: $cmd" >&2
      fi
    done
  done
done
[ -n "${DRY_RUN:-}" ] || echo "summaries under $RESULTS/runs"
# the table and the plots (report.md, sps.png, returns.png), into the results folder
echo "python $here/benchmarks/report.py $RESULTS"
[ -n "${DRY_RUN:-}" ] || python "$here/benchmarks/report.py" "$RESULTS"
