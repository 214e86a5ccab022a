"""Tables that fit the console without losing a character of a name (names fold, low-value columns go first), plain
records (one a line) for a pipe; a tree view groups dotted names by prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardckpt.cli.text import printable, styled

MIN_NAME_WIDTH = 16  # a name narrower than this folds into too many lines to read: other columns go first
MIN_CROP_WIDTH = 12  # a value preview narrower than this says nothing: the column goes instead


@dataclass(frozen=True)
class Column:
    """A table column: `drop` ranks the columns given up, lowest first, when the names would have to fold narrower
    than two thirds of the console (None: never dropped); `crop` marks a value preview, which may lose its end."""

    header: str
    right: bool = False  # numbers
    drop: int | None = None
    crop: bool = False


Cell = str | Text  # a str is untrusted plain text (escaped, never markup); a Text was built escaped (text.styled)


def print_table(
    console: Console, columns: Sequence[Column], rows: Sequence[Sequence[Cell]], *, title: str | None = None
) -> None:
    """Print `rows` under `columns`; column 0 holds the names, which are always shown whole and distinct.

    On a terminal the table fits the console: the names fold onto more lines rather than lose a character, and
    columns are dropped (by `drop`) before the names fold narrower than two thirds of the console; no other cell is
    ever cut but a value preview's end. A pipe gets plain text, one record per line (columns padded to their widest
    cell, nothing cut or folded), for grep and awk.
    """
    cells = [[_cell(cell, name=(i == 0)) for i, cell in enumerate(row)] for row in rows]
    if title is not None:
        console.print(styled(title, "bold"), soft_wrap=not console.is_terminal)
    if not console.is_terminal:
        _print_plain(console, columns, cells)
        return
    kept, widths = _fit(console.width, columns, cells)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for i in kept:
        column = columns[i]
        table.add_column(
            column.header,
            justify="right" if column.right else "left",
            no_wrap=i != 0,
            overflow="fold" if i == 0 else "ellipsis" if column.crop else "crop",
            width=widths[i],
            min_width=widths[i],
            max_width=widths[i],
        )
    for row in cells:
        table.add_row(*(row[i] for i in kept))
    console.print(table)
    console.print()  # the end of the table: a name that fills its column may fold onto the next line


def _cell(cell: Cell, *, name: bool) -> Text:
    return cell if isinstance(cell, Text) else Text(printable(cell, name=name))


_GAP = 3  # between two columns of a terminal table: a padding cell, the divider and a padding cell


def _fit(width: int, columns: Sequence[Column], cells: list[list[Text]]) -> tuple[list[int], dict[int, int]]:
    """The columns kept and their widths on a console `width` columns wide (see print_table)."""
    natural = {i: max([len(column.header)] + [row[i].cell_len for row in cells]) for i, column in enumerate(columns)}
    kept = list(range(len(columns)))
    crops = [i for i in kept if columns[i].crop]

    def room() -> int:  # what the names get beside the fixed columns (a preview counted at its least)
        fixed = sum(min(natural[i], MIN_CROP_WIDTH) if i in crops else natural[i] for i in kept if i != 0)
        return width - fixed - _GAP * (len(kept) - 1)

    want = min(natural[0], max(MIN_NAME_WIDTH, len(columns[0].header), width * 2 // 3))
    for i in sorted((i for i in kept if columns[i].drop is not None), key=lambda i: columns[i].drop or 0):
        if room() >= want:
            break
        kept.remove(i)
        crops = [c for c in crops if c != i]
    widths = {i: natural[i] for i in kept}
    free = width - sum(natural[i] for i in kept if i != 0 and i not in crops) - _GAP * (len(kept) - 1)
    whole = free - sum(natural[i] for i in crops)  # the names' room when every preview is shown whole
    least = free - MIN_CROP_WIDTH * len(crops)  # their room when every preview is at its narrowest
    widths[0] = max(len(columns[0].header), min(natural[0], max(whole, min(want, least))), 1)
    for i in crops:  # the previews share what the names leave, each up to its own width
        widths[i] = max(4, min(natural[i], (free - widths[0]) // len(crops)))
    return kept, widths


def _print_plain(console: Console, columns: Sequence[Column], cells: list[list[Text]]) -> None:
    natural = [max([len(column.header)] + [row[i].cell_len for row in cells]) for i, column in enumerate(columns)]

    def record(row: Sequence[Text]) -> Text:
        out = Text()
        for i, (cell, column) in enumerate(zip(row, columns)):
            pad = " " * (natural[i] - cell.cell_len)
            last = i == len(columns) - 1
            out.append_text(Text(pad) + cell if column.right else cell + Text("" if last else pad))
            if not last:
                out.append("  ")
        out.rstrip()
        return out

    console.print(record([Text(column.header) for column in columns]), soft_wrap=True)
    for row in cells:
        console.print(record(row), soft_wrap=True)


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
