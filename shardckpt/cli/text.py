"""Untrusted text (names, paths, values, error messages) for the terminal: control characters shown escaped, never
interpreted, and never read as rich markup or emoji codes; what the commands print for people goes through here.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

# What a terminal must never be handed raw: controls (Cc: ESC, the 8-bit CSI U+009B, BEL, newline...), format
# characters (Cf: bidirectional overrides that make a name read backwards, zero-width spaces that make two names look
# alike), lone surrogates (Cs: a file name that is not UTF-8, which stdout cannot even encode) and line separators.
_ESCAPED = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str, *, name: bool = False) -> str:
    """`text` with every control (ESC, the 8-bit CSI U+009B, BEL, newlines, DEL...), invisible format character
    (bidirectional overrides, zero-width spaces) and lone surrogate shown as an escape (\\x1b, \\x9b, \\n, \\u202e),
    as --json shows them, so a name can neither drive the terminal nor pass for another.

    name=True also doubles every backslash, so that two different names never look the same (a name holding the four
    characters \\x1b and one holding ESC); messages keep their backslashes (Windows paths, quoted reprs).
    """
    if text.isprintable() and not (name and "\\" in text):
        return text  # the common case: nothing to look at twice
    out = []
    for char in text:
        if char == "\\" and name:
            out.append("\\\\")
        elif unicodedata.category(char) in _ESCAPED:
            out.append(_escape(char))
        else:
            out.append(char)
    return "".join(out)


def styled(value: object, style: str = "") -> Text:
    """A Text of `value` (escaped by printable) in `style`: never parsed for markup, whatever it holds."""
    return Text(printable(str(value)), style=style)


def line(*parts: str | Text | tuple[str, str]) -> Text:
    """One message from its parts: a str is untrusted text (escaped), a (text, style) pair untrusted text in that
    style, a Text is taken as built (its text already escaped)."""
    out = Text()
    for part in parts:
        if isinstance(part, Text):
            out.append_text(part)
        elif isinstance(part, tuple):
            out.append(printable(part[0]), style=part[1])
        else:
            out.append(printable(part))
    return out


VERDICT_STYLES = {"skipped": "yellow", "imported": "green", "OK": "green", "BAD": "red", "FAILED": "red"}


def print_report(console: Console, lines: Sequence[tuple[str, str]]) -> None:
    """Print (verdict, rest) lines, the verdict word coloured and the rest escaped, one line each however long."""
    for verdict, rest in lines:
        console.print(line((verdict, VERDICT_STYLES.get(verdict, "")), " ", rest), soft_wrap=True)
