"""MkDocs hook: the Python API reference page is generated from the public names' signatures and docstrings.

The names are the package's own lists (shardckpt._LAZY, shardckpt.__all__, shardckpt.dcp), so a new public name appears.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:  # `mkdocs` runs from its own bin/: document this checkout, not an installed copy
    sys.path.insert(0, REPO)

PAGE = "reference/api.md"
MARKER = "<!-- api-reference: generated from the docstrings by docs/hooks/api_reference.py -->"


def _signature(name: str, obj: Any) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):  # a builtin or a class without an introspectable __init__
        return name


def _entry(title: str, anchor: str, obj: Any, level: int = 2) -> list[str]:
    """A heading, the signature as Python, the docstring as preformatted text (docstrings are not Markdown)."""
    signature = _signature(title.split(".")[-1], obj)
    lines = [f"{'#' * level} `{title}` {{#{anchor}}}", "", "```python", signature, "```", ""]
    doc = inspect.getdoc(obj)
    if doc:
        lines += ["```text", doc, "```", ""]
    return lines


def _methods(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties a class defines itself, in source order."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property) or inspect.isfunction(value):
            found.append((name, value.fget if isinstance(value, property) else value))
    return found


def public_names() -> dict[str, Any]:
    """Every public name of the package (functions, classes, errors) and of shardckpt.dcp, by dotted name."""
    import shardckpt

    names: dict[str, Any] = {}
    for name in [*shardckpt._LAZY, *shardckpt.__all__]:
        value = getattr(shardckpt, name)
        if inspect.ismodule(value):  # shardckpt.dcp: its own public names
            for sub in getattr(value, "__all__", []):
                names[f"shardckpt.{name}.{sub}"] = getattr(value, sub)
        elif callable(value):
            names[f"shardckpt.{name}"] = value
    return names


def api_reference_markdown() -> str:
    functions, classes, errors = [], [], []
    for dotted, value in public_names().items():
        anchor = dotted.removeprefix("shardckpt.").replace(".", "-").lower()
        if inspect.isclass(value) and issubclass(value, BaseException):
            errors += _entry(dotted, anchor, value, level=3)
        elif inspect.isclass(value):
            classes += _entry(dotted, anchor, value)
            for method, function in _methods(value):
                classes += _entry(f"{dotted.split('.')[-1]}.{method}", f"{anchor}-{method.lower()}", function, 3)
        else:
            functions += _entry(dotted, anchor, value)
    return "\n".join([*functions, *classes, "## Errors {#errors}", "", *errors])


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER!r}: the generated reference has nowhere to go")
    return markdown.replace(MARKER, api_reference_markdown())
