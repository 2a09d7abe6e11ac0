#!/usr/bin/env bash
# Set up, then run the main job: the quick benchmark (a few minutes on 2 cores).
# Extra arguments go to `posenc bench` (see `posenc bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/posenc bench "$@"
