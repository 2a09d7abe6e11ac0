"""``python -m posenc.lm_eval ARGS``: the harness's own CLI (``lm_eval ARGS``) with ``--model posenc`` registered."""

from . import main

if __name__ == "__main__":
    main()
