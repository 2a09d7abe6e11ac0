#!/usr/bin/env bash
# Set up, then run the main job: the quick benchmark (a few minutes on 2 cores).
# Extra arguments go to `posenc bench` (see `posenc bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# tiny models train fastest on one thread per process (and a shared machine stays usable)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/posenc bench "$@"
