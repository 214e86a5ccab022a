"""MkDocs hook: the CLI reference page is generated from the argparse parsers at build time.

Every subcommand registered in shardckpt.cli.main appears with its own --help text, so a new command needs no doc edit.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# `mkdocs` runs from its own bin/: document this checkout's CLI, not whichever shardckpt the venv has installed.
REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PAGE = "reference/cli.md"
MARKER = "<!-- cli-reference: generated from the parsers by docs/hooks/cli_reference.py -->"
WIDTH = 100  # the width the help texts are wrapped to on the page


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse (and the CLI's own help formatter) wrap to $COLUMNS."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subparsers of `parser`, in the order `shardckpt --help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _train_help() -> str:
    """`shardckpt train --help`: the training loop parses its own options (and imports torch to do so)."""
    from shardckpt.train.common import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_args(["--help"])
    return out.getvalue()


def _block(title: str, anchor: str, text: str) -> str:
    return f"## {title} {{#{anchor}}}\n\n```text\n{text.rstrip()}\n```\n"


def cli_reference_markdown(width: int = WIDTH) -> str:
    """The reference: `shardckpt --help`, then each command's --help, as Markdown."""
    from shardckpt.cli.main import build_parser

    with _columns(width):
        parser = build_parser()
        sections = [_block("shardckpt", "shardckpt", parser.format_help())]
        for name, sub in _subcommands(parser).items():
            text = _train_help() if name == "train" else sub.format_help()
            sections.append(_block(f"shardckpt {name}", name, text))
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER!r}: the generated reference has nowhere to go")
    return markdown.replace(MARKER, cli_reference_markdown())
