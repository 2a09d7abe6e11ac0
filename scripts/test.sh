#!/usr/bin/env bash
# Set up, then run the linter and the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
