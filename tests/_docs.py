"""The fenced code blocks of the documentation, and what each is for (standard library only: ``.ci/run`` uses it).

Every ``bash`` and ``python`` block of README.md, docs/*.md and examples/*/README.md runs as written:
``tests/test_docs.py`` runs each in a copy of the repository, and ``.ci/run`` runs the install commands (they
change the environment the tests run in). A block says otherwise with an HTML comment on the line before its
fence:

- ``<!-- main-command -->``, ``<!-- install -->``, ``<!-- test-command -->``: ``.ci/run`` runs it, in that order
  of kinds, in its fresh virtual environment (the test command last: it is the suite itself);
- ``<!-- skip: needs two hosts ... -->`` or ``<!-- skip: needs a GPU ... -->``: it cannot run on one CPU-only
  machine (no other reason is accepted);
- ``<!-- timeout: N -->``: it runs, within N seconds instead of the default.

Run as a script, ``python3 tests/_docs.py --ci`` prints the commands ``.ci/run`` runs, one per line.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ("bash", "python")
CI_KINDS = ("main-command", "install", "test-command")  # the order .ci/run runs them in
SKIP_REASONS = ("needs two hosts", "needs a GPU")
DEFAULT_TIMEOUT_S = 120

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*(?P<text>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    code: str
    marker: str  # the comment on the line before the fence, "" if none

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def ci_kind(self) -> str | None:
        return self.marker if self.marker in CI_KINDS else None

    @property
    def skip(self) -> str | None:
        return self.marker[len("skip:") :].strip() if self.marker.startswith("skip:") else None

    @property
    def timeout_s(self) -> int:
        match = re.fullmatch(r"timeout:\s*(\d+)", self.marker)
        return int(match.group(1)) if match else DEFAULT_TIMEOUT_S


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(root.glob("examples/*/README.md"))]


def blocks(root: Path = ROOT) -> list[Block]:
    """Every fenced block of the documentation, in file order."""
    found = []
    for path in doc_files(root):
        text = path.read_text()
        for fence in _FENCE.finditer(text):
            before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.fullmatch(before.strip())
            found.append(
                Block(
                    path=str(path.relative_to(root)),
                    line=text.count("\n", 0, fence.start()) + 1,
                    lang=fence.group("lang"),
                    code=fence.group("code"),
                    marker=marker.group("text") if marker else "",
                )
            )
    return found


def ci_commands(root: Path = ROOT) -> list[str]:
    """The blocks ``.ci/run`` runs: the main command, the install commands, then the test command."""
    marked = [b for b in blocks(root) if b.ci_kind]
    return [b.code.strip() for kind in CI_KINDS for b in marked if b.ci_kind == kind]


if __name__ == "__main__":
    if sys.argv[1:] != ["--ci"]:
        sys.exit("usage: python3 tests/_docs.py --ci")
    for command in ci_commands():
        if "\n" in command:
            sys.exit(f"a block .ci/run runs must be one command line, not:\n{command}")
        print(command)
