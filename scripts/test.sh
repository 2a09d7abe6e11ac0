#!/usr/bin/env bash
# Set up (once), then run the linter and the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
echo "test: ruff check ."
.venv/bin/ruff check .
echo "test: pytest"
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
