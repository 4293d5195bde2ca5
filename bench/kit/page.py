"""docs/benchmarks.md's pieces: figures and tables in markdown, and the page's marked sections.

Each scenario's section sits between `<!-- name:begin -->` and `<!-- name:end -->`: a partial run
(`--only`) replaces the sections of the scenarios it ran (or adds them at the end) and keeps
everything else in the page as the last run wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table(rows: Sequence[Sequence[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def marked(name: str, lines: list[str]) -> list[str]:
    return [f"<!-- {name}:begin -->", *lines, f"<!-- {name}:end -->"]


def splice(text: str, name: str, block: str) -> str:
    """`text` with scenario `name`'s marked section replaced by `block` (or added at the end)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def splice_page(page: Path, named: list[tuple[str, list[str]]]) -> None:
    """Replace (or add) these scenarios' marked sections of the page, keeping the rest."""
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    for name, lines in named:
        text = splice(text, name, "\n".join(marked(name, lines)))
    page.write_text(text)
