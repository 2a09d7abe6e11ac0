"""The version of posenc, in a module of its own so that the lowest layers can read it without importing the package's
public face (posenc/__init__.py imports the models)."""

__version__ = "0.1.0"

#: The releases of posenc's dependencies that its test suite ran on: (oldest, newest) minor release, both ends
#: included. The oldest is the one constraints.txt pins (``bash scripts/test.sh``, CI); the newest is the one
#: constraints-latest.txt pins (``bash scripts/test.sh --latest``, a second leg run by hand). pyproject.toml's
#: ranges (torch in the dependencies, transformers in the extras) and the README's "Supported versions" say the same,
#: and tests/test_supported_versions.py keeps the four equal. posenc.hf warns on a transformers outside this range.
TESTED_RANGES: dict[str, tuple[str, str]] = {
    "torch": ("2.13", "2.15"),
    "transformers": ("5.24", "5.25"),
}
