"""Loading a package's public names on first use, from a table of where each lives."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy"]


def lazy(package: str, home: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``home`` maps each name to the submodule defining it
    (relative to ``package``), imported when the name is first asked for, and then kept as an attribute."""
    module = importlib.import_module(package)

    def getattr_(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        setattr(module, name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(module)) | set(home))

    return getattr_, dir_
