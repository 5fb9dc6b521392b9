"""Loading a package's public names on first use: from a table of where each lives, and from the registry."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["lazy"]


def lazy(
    package: str, home: dict[str, str], under: str | None = None, extra: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``.

    ``home`` maps a name to the submodule defining it (relative to ``package``), imported when the name is first
    asked for, then kept as an attribute. With ``under`` (a module prefix; ``""``: every module, an installed
    package's engines included), the public names that registered engines define there
    (:func:`weightsync.registry.public_names`) are the package's too; asking for one of
    them, or for ``__all__``, loads the engines. ``__all__`` is every name, and ``extra``.
    """
    module = importlib.import_module(package)

    def engines() -> dict[str, Any]:
        if under is None:
            return {}
        registry = importlib.import_module("weightsync.registry")  # not `from . import`: that asks this hook
        return {n: v for n, v in registry.public_names().items() if _module_of(v).startswith(under)}

    def getattr_(name: str) -> Any:
        if name == "__all__":
            value: Any = sorted({*home, *engines(), *extra})
        elif name in home:
            value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        else:
            # A submodule being imported (`from . import registry`) is asked for here first: loading the engines
            # then would import them in the middle of importing the core.
            submodule = name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None
            found = None if submodule else engines().get(name)
            if found is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = _resolve(found)
        setattr(module, name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(module)) | set(home) | set(engines()))

    return getattr_, dir_


def _module_of(value: Any) -> str:
    return value.partition(":")[0] if isinstance(value, str) else getattr(value, "__module__", "")


def _resolve(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    return importlib.import_module("weightsync.registry").resolve(value)
