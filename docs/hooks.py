"""MkDocs hook: the command-line reference is `jaxtrain COMMAND --help`, written at build time.

A page line `<!-- jaxtrain-help: train --task dpo -->` becomes a text block holding the help
of that command line, generated from the same argument tables the CLI parses
(jaxtrain/cli/help.py), so the reference cannot drift from the code. A hook is a plain MkDocs
feature (no plugin): it runs inside `mkdocs build`.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from typing import Any

MARKER = re.compile(r"^<!-- jaxtrain-help: (.+?) -->$", re.M)


def command_help_text(line: str) -> str:
    """What `jaxtrain LINE --help` prints (exit 0 or the build fails)."""
    from jaxtrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*shlex.split(line), "--help"] if line != "jaxtrain" else ["--help"])
    if code != 0:
        raise RuntimeError(f"`jaxtrain {line} --help` exited {code}")
    return out.getvalue().rstrip()


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    def block(match: re.Match) -> str:
        return f"```text\n{command_help_text(match.group(1).strip())}\n```"

    return MARKER.sub(block, markdown)
