"""Write a benchmark's section of docs/benchmarks.md: the text between its ``<!-- name:begin -->`` and
``<!-- name:end -->`` markers, the rest of the page left as it is."""

from __future__ import annotations

from pathlib import Path


def replace_section(page: Path, name: str, text: str) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = page.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{page} has no {begin} ... {end} section to write into")
    start, stop = doc.index(begin) + len(begin), doc.index(end)
    page.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])
