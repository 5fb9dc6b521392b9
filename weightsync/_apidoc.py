"""Writes ``docs/api.md``, the API reference, from the public names and their docstrings.

``python -m weightsync._apidoc docs/api.md``; a test checks that the file is current. With ``--installed``, the
engines of installed packages are listed too (an engine's author documents their own this way).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import weightsync as ws
import weightsync.config as wsc
from weightsync import registry


def groups(own: bool = False) -> list[tuple[str, list[str]]]:
    """The reference's sections and the public names in each: the core's, then what every registered engine
    defines (:mod:`weightsync.registry`), in the order registered (``own``: weightsync's own engines only)."""
    engines = {n: v for n, v in registry.public_names().items() if not own or _ours(v)}
    schemes = [s.__name__ for s in map(registry.get_backend, registry.schemes()) if not own or _ours(s)]
    transports = []
    for settings in [s for s in registry.transports().values() if not own or _ours(s)]:
        transports += [n for n in (settings.transport and settings.transport.rpartition(":")[2],) if n]
    settings_names = [s.__name__ for s in registry.transports().values() if not own or _ours(s)]
    others = sorted(set(engines) - {*schemes, *transports, *settings_names})
    return [
        ("Schemes", ["WeightSyncScheme", *dict.fromkeys(schemes)]),
        ("Sender and receiver facades", ["WeightSender", "WeightReceiver", *others]),
        ("Transports", ["TransportBackend", *transports]),
        ("Transport settings", ["TransportSettings", *settings_names]),
        ("Weights", ["WeightStrategy", "FlatLayout", "ExternalModel", "resolve_model"]),
        ("Metrics", ["SendRecord"]),
        ("Registry", ["available_backends", "get_backend", "register_backend"]),
        ("Errors", sorted(n for n in ws.__all__ if n.endswith("Error"))),
    ]


CONFIG_NAMES = ["from_config", "check_receiver_config", "make_receiver", "allow_targets", "allowed_targets"]


SECTIONS = ("Args:", "Attributes:", "Raises:", "Returns:")


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _markdown(doc: str) -> str:
    """A Google-style docstring as Markdown: sections become bold headers and their entries bullets."""
    doc = re.sub(r":(?:class|meth|func|attr|data|mod):`~?([\w.]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", doc)
    doc = doc.replace("``", "`").replace("::\n", ":\n")
    out: list[str] = []
    in_section = False
    for line in doc.splitlines():
        if line.strip() in SECTIONS:
            out += ["", f"**{line.strip()[:-1]}**", ""]
            in_section = True
        elif in_section and line.startswith("        "):
            out[-1] += " " + line.strip()
        elif in_section and line.startswith("    "):
            entry = re.match(r"\s+([^:]+):\s*(.*)", line)
            out.append(f"- `{entry.group(1)}`: {entry.group(2)}" if entry else f"- {line.strip()}")
        else:
            in_section = in_section and line.strip() != "" and line.startswith(" ")
            out.append(line)
    return "\n".join(out).strip()


def _signature(obj: Any) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    # `ray.remote(cls)` wraps the methods of `cls` itself (ModuleActor's, once a process used it) with
    # tracing wrappers that add `_ray_trace_ctx`: not part of our API.
    params = [p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"]
    text = str(signature.replace(parameters=params))
    return re.sub(
        r"'([^']*)'",
        lambda m: (
            m.group(1)
            if (
                "|" in m.group(1)
                or m.group(1)[:1].isupper()
                or m.group(1) in ("int", "str", "float", "bool", "None", "dict", "list", "tuple")
            )
            else m.group(0)
        ),
        text,
    )


def _members(cls: type) -> list[str]:
    """Public methods and properties defined on ``cls`` or a weightsync base, in source order."""
    lines = []
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("weightsync"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(value, property):
                first = _doc(value).split("\n\n")[0].replace("\n", " ")
                lines.append(f"- `{name}` (property){': ' + first if first else ''}")
            elif inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
                func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                sig = _signature(func).replace("(self, ", "(").replace("(self)", "()").replace("(cls, ", "(")
                first = _doc(func).split("\n\n")[0].replace("\n", " ")
                lines.append(f"- `{name}{sig}`{': ' + first if first else ''}")
    return lines


def _options(obj: Any) -> list[str]:
    """A table of the options a class declares (a scheme's, with its transport's settings; a transport's)."""
    rows = obj.__dict__.get("OPTIONS") if inspect.isclass(obj) else None
    if not rows:
        return []
    transport = set(obj.setting_names()) if hasattr(obj, "setting_names") else set()
    out = ["Options:", "", "| option | default | meaning |", "|---|---|---|"]
    for o in rows:
        where = " (a setting of its transport)" if o.name in transport else ""
        out.append(f"| `{o.name}` | `{o.default!r}` | {_markdown(o.doc)}{where} |")
    return [*out, ""]


def _entry(name: str, obj: Any, prefix: str = "weightsync") -> list[str]:
    out = [f"### `{prefix}.{name}`", ""]
    if inspect.isclass(obj):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        out += [f"`class {name}{_signature(obj)}`" + (f" (bases: {', '.join(bases)})" if bases else ""), ""]
    else:
        out += [f"`{name}{_signature(obj)}`", ""]
    doc = _markdown(_doc(obj))
    if doc:
        out += [doc, ""]
    out += _options(obj)
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        members = _members(obj)
        if members:
            out += ["Members:", "", *members, ""]
    return out


def _ours(obj: Any) -> bool:
    module = obj.partition(":")[0] if isinstance(obj, str) else obj.__module__
    return module.startswith("weightsync.")


def render(own: bool = False) -> str:
    """The reference as Markdown: every public name, an installed package's engines included (``own``:
    weightsync's own only, as ``docs/api.md`` holds it)."""
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python -m weightsync._apidoc docs/api.md`; do not edit.",
        "The guide (`docs/guide.md`) explains how the pieces fit; this page lists every public name.",
        "",
    ]
    listed = set()
    for title, names in groups(own):
        lines += [f"## {title}", ""]
        for name in names:
            lines += _entry(name, getattr(ws, name))
            listed.add(name)
    lines += ["## Configs (`weightsync.config`)", ""]
    for name in CONFIG_NAMES:
        lines += _entry(name, getattr(wsc, name), "weightsync.config")
    for name in sorted(n for n in wsc.__all__ if n.endswith("Config")):
        cls = getattr(wsc, name)
        if own and not (cls._target_.startswith("weightsync.") or name == "WeightStrategyConfig"):
            continue
        fields = ", ".join(f"`{f}`" for f in cls.__dataclass_fields__)
        lines += [f"### `weightsync.config.{name}`", "", _doc(cls).split("\n\n")[0], "", f"Fields: {fields}.", ""]
    public = {n for n in ws.__all__ if not own or _ours(getattr(ws, n))}
    missing = sorted(public - listed - {"from_config"})
    if missing:
        raise SystemExit(f"public names missing from the API reference groups: {missing}")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync._apidoc", description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", help="the file to write (default: standard output)")
    parser.add_argument(
        "--installed",
        action="store_true",
        help="list the engines of installed packages too (docs/api.md lists weightsync's own only)",
    )
    args = parser.parse_args(argv)
    text = render(own=not args.installed)
    if args.path:
        Path(args.path).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
