#!/usr/bin/env bash
# The GPU leg (issue 39): on a machine with one CUDA GPU, run the test suite's CUDA tests (flex_attention's backward
# through learnable tables, bf16 and fp32, against the reference path), then the training-step benchmark
# (benchmarks/bench_gpu.py: flex vs SDPA with the dense bias vs none on flash, L = 4k, 16k, 32k, bf16), in about
# ten minutes. Writes benchmarks/results/gpu-<date>.md; paste its table into benchmarks/README.md with the GPU's name.
#
#   bash benchmarks/gpu.sh              # tests + benchmark (needs CUDA and the test .venv: bash scripts/setup.sh test)
#   bash benchmarks/gpu.sh --dry-run    # on any machine: builds every benchmark case tiny on the CPU, runs nothing
#
# Extra arguments after --dry-run (or alone) go to bench_gpu.py (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ "${1:-}" = "--dry-run" ]; then
  shift
  exec "$PY" benchmarks/bench_gpu.py --dry-run "$@"
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu.sh: no CUDA device on this machine; 'bash benchmarks/gpu.sh --dry-run' checks the cases on the CPU" >&2
  exit 2
fi
out=benchmarks/results/gpu-$(date -u +%Y-%m-%d).md
echo "gpu.sh: the CUDA tests (tests/test_flex.py)"
"$PY" -m pytest -p no:cacheprovider -q tests/test_flex.py -k cuda 2>&1 | tail -n 15
echo "gpu.sh: the benchmark (benchmarks/bench_gpu.py, at most ${GPU_BUDGET:-420} s of cases)"
"$PY" benchmarks/bench_gpu.py --budget "${GPU_BUDGET:-420}" "$@" | tee "$out"
echo "gpu.sh: wrote $out"
