"""What the commands print and write.

Text that comes from a file (a plan's model type, layer names, solver status) is printed as plain
text: never parsed as console markup or emoji codes, control characters shown escaped, so a crafted
plan cannot render links, move the cursor or crash the printer. Tables stay readable at 80 columns,
the width of a pipe with COLUMNS unset: columns may wrap but never cut a header word. Output paths
are checked before the work that fills them, so a typo in `--out` costs nothing; plots need the
optional matplotlib and are skipped with a note without it.
"""

from __future__ import annotations

import os
import unicodedata
from importlib.util import find_spec
from pathlib import Path

from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from autopar.errors import AutoparError

PLOT_EXTRA = "pip install 'autopar[plot]'"


def escape_controls(text: str) -> str:
    """Control and format characters (escape sequences, bidirectional overrides) as \\xNN or
    \\uNNNN, so that what a terminal shows is what the file holds."""
    return "".join(
        (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        if unicodedata.category(c) in ("Cc", "Cf") else c
        for c in text)


def plain(value, style: str = "") -> Text:
    """`value` as console text that is shown literally."""
    return Text(escape_controls(str(value)), style=style)


class FittedTable(Table):
    """A table that fits the console: if the natural widths are too wide, only the `wrap` columns
    (long free text) give up width, widest first, never below their header's longest word. Rich's
    own shrinking takes width evenly from every column and then restores each one's minimum, so a
    table of short columns ends up wider than the console and is cut at its right edge."""

    def __init__(self, *args, wrap: set[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.wrap = wrap     # indices of the columns that may give up width

    def __rich_console__(self, console, options):
        for column in self.columns:
            column.width = None
        natural = [max(Measurement.get(console, options, cell).maximum
                       for cell in [column.header, *column.cells]) for column in self.columns]
        padding = sum(self._get_padding_width(i) for i in range(len(self.columns)))
        room = options.max_width - self._extra_width - padding
        widths = list(natural)
        while sum(widths) > room:
            shrinkable = [i for i, column in enumerate(self.columns)
                          if i in self.wrap and widths[i] > (column.min_width or 1)]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1
        if widths != natural:
            for column, width in zip(self.columns, widths):
                column.width = width
        yield from super().__rich_console__(console, options)


def table(title: str, columns: list[str | Text], right: tuple[str, ...] = (),
          wrap: tuple[str, ...] = ()) -> Table:
    """A table whose headers wrap at spaces but are never cut: each column is at least as wide
    as the longest word of its header, and long cells fold instead of ending in an ellipsis.
    When it is too wide, the `wrap` columns (default: all) give up width. Headers that come
    from files are given as `plain` Text."""
    names = [str(column) for column in columns]
    result = FittedTable(title=title, title_justify="left", show_edge=False, pad_edge=False,
                         wrap={i for i, name in enumerate(names) if not wrap or name in wrap})
    for column, name in zip(columns, names):
        result.add_column(column, justify="right" if name in right else "left", overflow="fold",
                          min_width=min(max(len(word) for word in name.split() or [""]), 20))
    return result


def check_output(path: str | Path, what: str, *, directory: bool = False) -> Path:
    """Refuse an output path that cannot be written, before any work: its folder must exist (or,
    for a folder, its nearest existing parent) and be writable, and a file must not be a folder."""
    path = Path(path)
    if directory:
        if path.exists() and not path.is_dir():
            raise AutoparError(f"{what} {path} is a file, not a folder; name a folder to write into")
        parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    else:
        if path.is_dir():
            raise AutoparError(f"{what} {path} is a folder; name a file, e.g. {path / 'out'}")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise AutoparError(f"{what} {path}: folder {parent} does not exist; create it first")
        if path.exists() and not os.access(path, os.W_OK):
            raise AutoparError(f"{what} {path} exists and is not writable")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AutoparError(f"{what} {path}: folder {parent} is not writable")
    return path


def can_plot() -> bool:
    return find_spec("matplotlib") is not None
