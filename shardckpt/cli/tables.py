"""Tables that fit the console: long names lose their middle (both ends say most), never their end; a tree view
groups dotted names by prefix. Pipes get plain tables without borders (the console decides the width).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

ELLIPSIS = "..."
MIN_NAME_WIDTH = 16


def elide_middle(text: str, width: int) -> str:
    """`text` cut to `width` characters by dropping its middle: "optim.state.blocks.0...weight.exp_avg"."""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS) + 2:
        return text[:width]
    keep = width - len(ELLIPSIS)
    head = keep // 2
    return text[:head] + ELLIPSIS + text[len(text) - (keep - head) :]


Cell = str | Text  # a str is plain text (never markup: names may hold "["); a Text carries its own style


def _text(cell: Cell) -> Text:
    return cell if isinstance(cell, Text) else Text(cell)


def fitted_table(
    console: Console,
    headers: Sequence[str],
    rows: Sequence[Sequence[Cell]],
    *,
    title: str | None = None,
    elide: int = 0,
    right: Sequence[int] = (),
    crop: int | None = None,
) -> Table:
    """A table of `rows` no wider than the console: column `elide` (the names) is shortened in
    the middle to what the other columns leave; columns in `right` are right-aligned (numbers); column `crop` (a
    value preview) instead gives up its end ("...") when the table is too wide."""
    plain = not console.is_terminal
    # Between two columns: their padding (1 cell each) and, with a box, a divider (1 cell); no outer edges.
    overhead = (2 if plain else 3) * (len(headers) - 1)
    others = sum(
        max([len(header)] + [_text(row[i]).cell_len for row in rows])
        for i, header in enumerate(headers)
        if i not in (elide, crop)
    )
    budget = max(MIN_NAME_WIDTH, console.width - others - overhead)
    if crop is not None:  # leave the cropped column room for a useful preview
        budget = max(MIN_NAME_WIDTH, min(budget - 24, console.width // 2))
    table = Table(
        title=None if title is None else elide_middle(title, console.width),
        title_justify="left",
        box=None if plain else box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        header_style="" if plain else "bold",
    )
    for i, header in enumerate(headers):
        table.add_column(
            header,
            justify="right" if i in right else "left",
            no_wrap=True,
            overflow="ellipsis" if i == crop else "fold",
        )
    named = max([len(headers[elide])] + [min(budget, _text(row[elide]).cell_len) for row in rows])
    room = max(len(ELLIPSIS) + 1, console.width - overhead - others - named)
    for row in rows:
        cells = [_text(cell) for cell in row]
        cells[elide] = Text(elide_middle(cells[elide].plain, budget))
        if crop is not None and cells[crop].cell_len > room:
            cells[crop] = Text(cells[crop].plain[: room - len(ELLIPSIS)] + ELLIPSIS)
        table.add_row(*cells)
    return table


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    leaf: int | None = None  # index of the row whose full name ends here


def tree_rows(
    names: Sequence[str], row: Callable[[int], list[Cell]], group: Callable[[list[int]], list[Cell]]
) -> list[list[Cell]]:
    """Rows of a tree view of dotted `names`: a group row (`group(indices under it)`) per shared prefix, then the
    rows of its members (`row(index)`) indented under it, each name shown without the prefix above it. Chains of
    single children fold into one line ("model.blocks.0"), so the tree stays short."""
    root = _Node()
    for index, name in enumerate(names):
        node = root
        for part in name.split("."):
            node = node.children.setdefault(part, _Node())
        node.leaf = index
    out: list[list[Cell]] = []

    def indices(node: _Node) -> list[int]:
        found = [] if node.leaf is None else [node.leaf]
        for child in node.children.values():
            found.extend(indices(child))
        return found

    def walk(node: _Node, depth: int) -> None:
        for part, child in node.children.items():
            label = part
            while child.leaf is None and len(child.children) == 1:  # fold a chain of single children
                (next_part, child) = next(iter(child.children.items()))
                label = f"{label}.{next_part}"
            indent = "  " * depth
            if child.leaf is not None and not child.children:
                cells = row(child.leaf)
                out.append([indent + label, *cells[1:]])
                continue
            cells = group(indices(child))
            out.append([f"{indent}{label}.", *cells[1:]])
            if child.leaf is not None:
                cells = row(child.leaf)
                out.append([indent + "  (itself)", *cells[1:]])
            walk(child, depth + 1)

    walk(root, 0)
    return out
