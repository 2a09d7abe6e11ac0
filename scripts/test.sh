#!/usr/bin/env bash
# Set up (once), then run the linter and the test suite. Extra arguments go to pytest (one process).
#
# Without arguments (what CI runs) the suite runs in one pytest worker per core (at most 4), and a second, shorter
# leg follows with the native C kernels off
# (POSENC_NATIVE=0): the PyTorch paths a machine without a C compiler takes, through the tests of the plan,
# the attention kernels, the models, generation and the encodings that have a C kernel. Both legs print
# pytest's closing line; the script fails if either fails. POSENC_NATIVE_ISA=baseline runs the first leg
# with the portable baseline build of the kernels instead of the one this CPU's flags pick (src/posenc/native/builds.py).
#
# `bash scripts/test.sh --latest [PYTEST ARGS]` is the second leg, run by hand (CI runs only the pinned leg above):
# the same suite in .venv-latest (bash scripts/setup.sh latest), on the newest torch and transformers tested, as
# constraints-latest.txt pins them (the newest ends of posenc/_version.py's TESTED_RANGES; README "Supported
# versions"). Run it before widening that range; `bash scripts/setup.sh latest --refresh` moves the pins to the
# newest releases on the index first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --latest ]; then
    shift
    bash scripts/setup.sh latest
    # transformers 5.25.0's from_pretrained kernelizes by default and then raises without the `kernels` package,
    # whose required release (0.19.1) is not on PyPI (constraints-latest.txt): hub kernels off, as its variable says
    export USE_HUB_KERNELS=NO
    echo "test: the latest leg ($(.venv-latest/bin/python -c 'import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__)'))"
    workers=$(.venv-latest/bin/python -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')
    if [ "$#" -gt 0 ]; then
        exec .venv-latest/bin/python -m pytest -p no:cacheprovider "$@"
    fi
    exec .venv-latest/bin/python -m pytest -p no:cacheprovider -n "$workers" --dist loadfile
fi
bash scripts/setup.sh test
echo "test: ruff check ."
.venv/bin/ruff check .
echo "test: mkdocs build --strict (the documentation site, offline, into site/)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site
echo "test: pytest ($(.venv/bin/python -c 'from posenc import native; print(native.status())' 2>&1 | tail -1))"
status=0
if [ "$#" -gt 0 ]; then
    .venv/bin/python -m pytest -p no:cacheprovider "$@" || status=$?
    echo "test: the native-off leg runs only without arguments"
    exit "$status"
fi
# without arguments: one pytest worker per core, at most 4 (pytest-xdist; each test file stays in one worker, so
# a file's tests share its module-level state as they do in one process); every test sets torch to one thread
workers=$(.venv/bin/python -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')
echo "test: $workers pytest workers"
.venv/bin/python -m pytest -p no:cacheprovider -n "$workers" --dist loadfile || status=$?
# the files that exercise the PyTorch fallbacks of posenc.native's callers: RoPE and its scalings, FIRE, the
# decoding kernels (KV-cache decoding of the relative encodings, DeBERTa's rows_dot), the plan (1,144 tests, about
# a minute at a load of 5 on 2 cores, 2026-11-25)
off_tests=(
    tests/test_plan.py tests/test_attention.py tests/test_models.py tests/test_offset_bias.py
    tests/test_block_bias.py tests/test_generate.py tests/test_rope_phases.py tests/test_bias_fire.py
    tests/test_fused.py tests/test_relative_deberta.py tests/test_relative_transformer_xl.py
    tests/test_fastpath_speedups.py tests/test_rotary_scaling.py
)
echo "test: pytest with the native kernels off (POSENC_NATIVE=0)"
off=0
POSENC_NATIVE=0 .venv/bin/python -m pytest -p no:cacheprovider -n "$workers" --dist loadfile "${off_tests[@]}" || off=$?
if [ "$status" -ne 0 ] || [ "$off" -ne 0 ]; then
    echo "test: FAILED (pytest exit status $status; with the native kernels off $off)"
    exit 1
fi
