"""Text from the traced processes, made safe to show on a terminal.

Kernel names, host names and job names come from the targets (their libraries' arguments, their
environment): a name holding rich markup (`k[/]x`) made the live table raise instead of drawing,
and one holding escape sequences would drive the viewer's terminal. Views show such strings as
`Text` (never parsed as markup) with control characters written out (`\\x1b`).
"""

from __future__ import annotations

from typing import Dict

from rich.text import Text

_CONTROL: Dict[int, str] = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(s: str) -> str:
    """`s` with C0/C1 control characters and DEL written as `\\xNN`."""
    return s.translate(_CONTROL)


def plain(s: str, style: str = "") -> Text:
    """A table cell showing `s` literally: no markup, no control characters."""
    return Text(printable(s), style=style)
