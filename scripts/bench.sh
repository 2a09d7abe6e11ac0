#!/usr/bin/env bash
# Set up (once), then run the main job: the quick benchmark (a few minutes on 2 cores).
# Extra arguments go to `posenc bench` (see `posenc bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
# the quick suite is synthetic: the data sets are installed only when another suite or task is named
level=bench
for arg in "$@"; do
  case "$arg" in --suite|--suite=*|--task|--task=*|--tasks|--tasks=*) level=data ;; esac
done
bash scripts/setup.sh "$level"
# tiny models train fastest on one thread per process (and a shared machine stays usable)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/posenc bench "$@"
