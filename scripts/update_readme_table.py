"""Rewrite the encodings table in README.md from the registry (`posenc list --markdown`)."""

import contextlib
import io
import pathlib
import re

from posenc.cli import main

readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(["list", "--markdown"])
text = readme.read_text()
new = re.sub(
    r"(<!-- encodings:start -->\n).*?(<!-- encodings:end -->)",
    lambda m: m.group(1) + buf.getvalue() + m.group(2),
    text,
    flags=re.S,
)
readme.write_text(new)
print(f"README.md: {buf.getvalue().count(chr(10)) - 2} encodings")
