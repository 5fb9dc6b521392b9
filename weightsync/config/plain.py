"""Untrusted config input as a plain tree: parsed strictly, bounded, nothing resolved, nothing called.

A receiver config may come from a file another host wrote. Before anything
looks at what it means, :func:`plain_tree` turns it into a tree of exactly
``dict``, ``list``, ``str``, ``int``, ``float``, ``bool`` and ``None``, or
refuses it with a :class:`~weightsync.errors.ConfigurationError` that names
the place:

- YAML text (or a file, given as a :class:`pathlib.Path`: read here, at most
  :data:`MAX_CONFIG_BYTES` of it, so that no other loader expands it first) is
  read by a safe loader that also refuses anchors and aliases (no "billion
  laughs": ``OmegaConf.load`` expands 360 bytes of them into 900 MB), merge
  keys, duplicate keys (YAML keeps the last one silently), numbers written in
  more than :data:`MAX_NUMBER_TEXT` characters (Python's ``int()`` raises
  ``ValueError`` past 4,300 digits) and any value that is not a plain scalar,
  list or mapping (``!!python/...`` tags never get as far as a constructor);
- a ``DictConfig`` is converted without resolving anything: interpolations
  (``${oc.env:...}``, a resolver registered by anyone) read the environment or
  run code, so a string holding ``${`` is refused, never resolved;
- a ``dict`` is walked with exact type checks, so no object of a class of the
  caller's (or of anyone's) survives into the tree;
- sizes are bounded: bytes of text, nodes, depth, string and key lengths, and
  integers to :data:`MAX_INT_BITS` bits (in a dict too).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

import yaml

from ..errors import ConfigurationError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "MAX_NODES",
    "MAX_NUMBER_TEXT",
    "MAX_STRING",
    "plain_tree",
    "read_config_file",
]

#: The largest YAML text accepted (a receiver config is well under 2 kB).
MAX_CONFIG_BYTES = 64 * 1024
#: The most nodes (mappings, lists and scalars) a tree may hold.
MAX_NODES = 512
#: The deepest nesting accepted (a receiver config is 3 deep).
MAX_DEPTH = 8
#: The longest string value accepted.
MAX_STRING = 4096
#: The most characters a YAML number may be written in, checked before ``int()`` or ``float()`` reads it
#: (a 64-bit int is 20 digits; 0b and 64 binary digits with separators fit too).
MAX_NUMBER_TEXT = 100
#: The widest integer accepted (no field of a receiver config comes near it; ``repr`` and ``int()`` of wider
#: ones cost time, and past 4,300 digits raise ``ValueError``).
MAX_INT_BITS = 64
_KEY = re.compile(r"_target_|[A-Za-z][A-Za-z0-9_]{0,63}")
_PLAIN_SCALARS = (str, int, float, bool, type(None))


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` minus anchors, aliases, merge keys, duplicate keys and deep nesting."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConfigurationError(f"YAML anchors and aliases are not accepted in a config ({event.start_mark})")
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigurationError(f"config nests deeper than {MAX_DEPTH} levels ({event.start_mark})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigurationError(f"YAML merge keys (<<) are not accepted in a config ({key_node.start_mark})")
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ConfigurationError(f"config keys must be strings, got {key!r:.80} ({key_node.start_mark})")
            if key in seen:
                raise ConfigurationError(f"duplicate key {key!r:.80} in a config ({key_node.start_mark})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def _short_number(self, node: Any) -> None:
        if len(node.value) > MAX_NUMBER_TEXT:
            raise ConfigurationError(
                f"a number in a config is written in {len(node.value)} characters (at most {MAX_NUMBER_TEXT}) "
                f"({node.start_mark})"
            )

    def construct_yaml_int(self, node: Any) -> Any:
        self._short_number(node)  # before int() runs: it raises ValueError past 4,300 digits
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: Any) -> Any:
        self._short_number(node)
        return super().construct_yaml_float(node)


# The constructors are looked up by tag in a table, not as methods: register the bounded ones.
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_yaml_float)


def _parse_yaml(text: str) -> Any:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigurationError(f"config text is over {MAX_CONFIG_BYTES} bytes; refusing to parse it")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - the strict safe loader above
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"config is not plain YAML: {_first_line(exc)}") from None


def read_config_file(path: str | os.PathLike[str]) -> str:
    """The text of the config file at ``path``: a plain file, at most :data:`MAX_CONFIG_BYTES`, UTF-8.

    Reads at most one byte past the limit, and never blocks on a FIFO planted in place of the file.

    Raises:
        ConfigurationError: naming the path: missing, unreadable, not a plain file, too long or not UTF-8.
    """
    shown = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {shown!r:.300}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigurationError(f"config file {shown!r:.300} is not a plain file; refusing it")
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {shown!r:.300}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigurationError(f"config file {shown!r:.300} is over {MAX_CONFIG_BYTES} bytes; refusing to parse it")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"config file {shown!r:.300} is not UTF-8 text ({exc.reason})") from None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def plain_tree(cfg: Any, what: str = "config") -> dict[str, Any]:
    """``cfg`` (a ``dict``, a ``DictConfig``, YAML text, or a YAML file as a :class:`pathlib.Path`) as a tree
    of plain data, checked and bounded.

    Nothing in it is resolved, imported or called. A file is read by :func:`read_config_file` and parsed
    here, strictly: load a config that came from elsewhere this way, never with ``OmegaConf.load`` or
    ``yaml.load`` first (they expand aliases before anything can refuse them).

    Raises:
        ConfigurationError: naming the first place that is not plain data, or the limit passed.
    """
    if isinstance(cfg, str):
        tree = _parse_yaml(cfg)
        if type(tree) is str:  # most likely a file's name
            raise ConfigurationError(
                f"a {what} is a mapping, got str ({cfg!r:.200}): to read a file, pass a pathlib.Path"
            )
    elif isinstance(cfg, os.PathLike):
        text = read_config_file(cfg)
        try:
            tree = _parse_yaml(text)
        except ConfigurationError as exc:  # the parser's marks say "<unicode string>": name the file
            raise ConfigurationError(f"config file {os.fspath(cfg)!r:.300}: {exc}") from None
    elif type(cfg) is dict:
        tree = cfg
    else:
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(cfg, DictConfig):
            raise ConfigurationError(
                f"a {what} is a dict, a DictConfig, YAML text or a pathlib.Path, got {type(cfg).__name__}"
            )
        tree = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    if type(tree) is not dict:
        raise ConfigurationError(f"a {what} is a mapping, got {type(tree).__name__}")
    _check(tree, "", 1, [0])
    return tree


def _check(node: Any, path: str, depth: int, count: list[int]) -> None:
    count[0] += 1
    where = path or "<root>"
    if count[0] > MAX_NODES:
        raise ConfigurationError(f"config holds more than {MAX_NODES} values; refusing it (at {where})")
    if depth > MAX_DEPTH:
        raise ConfigurationError(f"config nests deeper than {MAX_DEPTH} levels at {where}")
    kind = type(node)
    if kind is dict:
        for key, value in node.items():
            if type(key) is not str or not _KEY.fullmatch(key):
                raise ConfigurationError(
                    f"config key {key!r:.80} at {where} is not a plain name: letters, digits and _, or _target_ "
                    "(Hydra's other special keys, such as _args_ and _partial_, are not taken)"
                )
            _check(value, f"{path}.{key}" if path else key, depth + 1, count)
    elif kind is list:
        for i, value in enumerate(node):
            _check(value, f"{path}[{i}]", depth + 1, count)
    elif kind is str:
        if len(node) > MAX_STRING:
            raise ConfigurationError(f"{where} holds a string of {len(node)} characters (at most {MAX_STRING})")
        if "${" in node:
            raise ConfigurationError(
                f"{where} holds an interpolation ({node!r:.80}): configs are data, and interpolations are never "
                "resolved (they read the environment or run resolvers)"
            )
    elif kind is int and node.bit_length() > MAX_INT_BITS:
        raise ConfigurationError(f"{where} holds an integer of {node.bit_length()} bits (at most {MAX_INT_BITS})")
    elif kind not in _PLAIN_SCALARS:
        raise ConfigurationError(f"{where} holds a {kind.__name__}, which is not plain data")
