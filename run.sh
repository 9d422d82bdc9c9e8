#!/usr/bin/env bash
# Reproduces the speed table: every script in its variants, over seeds, with each run's summary.json
# under one results folder (results/<date>/runs/<run_name>/summary.json).
#
#   ./run.sh                                   # the full table: 1M steps, seeds 1 2 3 (hours)
#   STEPS=50000 SEEDS=1 ./run.sh               # a short version for a CPU (TD3 needs > 25000, PPO >= 2048)
#   SCRIPTS=ppo_atari_envpool STEPS=100000 ./run.sh   # Atari (needs requirements/requirements-atari.txt)
#   SCRIPTS="sac_continuous_action" ./run.sh   # some scripts only (names without .py)
#   DRY_RUN=1 ./run.sh                         # print the commands, run nothing
#   EXTRA="--env-id Pendulum-v1" ./run.sh      # flags appended to every command
#
# The Breakout learning check (8 envs, 200,000 steps, eager and twin --compile, about 8 minutes each
# on 2 CPU cores) is a test left out of the default run: python -m pytest tests -m slow
#
# Environment variables: STEPS (total timesteps), SEEDS, SCRIPTS, EXTRA, RESULTS (the folder), DRY_RUN.
# Steady-state sps and compile seconds are in each summary: compile time is never in the sps.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
STEPS=${STEPS:-1000000}
SEEDS=${SEEDS:-1 2 3}
SCRIPTS=${SCRIPTS:-ppo_atari_envpool ppo_continuous_action sac_continuous_action td3_continuous_action}
RESULTS=${RESULTS:-$here/results/$(date +%Y%m%d-%H%M%S)}

# script -> the variants to run ("" = the script with no flag); the twins' flags are --compile and
# --cudagraphs (on a machine without CUDA, --cudagraphs warns and runs without graphs)
variants() {
  case $1 in
    ppo_atari_envpool | ppo_continuous_action | sac_continuous_action | td3_continuous_action) echo "$1|" ;;
    *) echo "unknown script $1" >&2; return 1 ;;
  esac
  # every eager script has a _torchcompile twin, run in four variants
  for flags in "" "--compile" "--cudagraphs" "--compile --cudagraphs"; do
    echo "${1}_torchcompile|$flags"
  done
}

# per-script settings beyond the defaults (HalfCheetah-v5 for the MuJoCo scripts: SAC and TD3 learn
# from 5000 / 25000 random steps first, PPO updates after each rollout of 2048 steps; Breakout-v5 with
# 8 envs for Atari: an update after each rollout of 8 x 128 steps)
extra() {
  case $1 in
    ppo_atari_envpool*) echo "--env-id Breakout-v5" ;;
    ppo_continuous_action* | sac_continuous_action* | td3_continuous_action*) echo "--env-id HalfCheetah-v5" ;;
  esac
}

mkdir -p "$RESULTS"
cd "$RESULTS"
for script in $SCRIPTS; do
  variants "$script" | while IFS='|' read -r file flags; do
    for seed in $SEEDS; do
      cmd="python $here/leanrl/$file.py $(extra "$file") --seed $seed --total-timesteps $STEPS $flags ${EXTRA:-}"
      echo "$cmd"
      if [ -z "${DRY_RUN:-}" ]; then
        # the summary line (the progress bar is on stderr); a failed run is reported, the table goes on
        $cmd | tail -n 1 || echo "FAILED: $cmd" >&2
      fi
    done
  done
done
[ -n "${DRY_RUN:-}" ] || echo "summaries under $RESULTS/runs"
