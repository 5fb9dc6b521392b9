"""Untrusted config input as a plain tree: parsed strictly, bounded, nothing resolved, nothing called.

A receiver config may come from a file another host wrote. Before anything
looks at what it means, :func:`plain_tree` turns it into a tree of exactly
``dict``, ``list``, ``str``, ``int``, ``float``, ``bool`` and ``None``, or
refuses it with a :class:`~weightsync.errors.ConfigurationError` that names
the place:

- YAML text is read by a safe loader that also refuses anchors and aliases
  (no "billion laughs"), merge keys, duplicate keys (YAML keeps the last one
  silently) and any value that is not a plain scalar, list or mapping
  (``!!python/...`` tags never get as far as a constructor);
- a ``DictConfig`` is converted without resolving anything: interpolations
  (``${oc.env:...}``, a resolver registered by anyone) read the environment or
  run code, so a string holding ``${`` is refused, never resolved;
- a ``dict`` is walked with exact type checks, so no object of a class of the
  caller's (or of anyone's) survives into the tree;
- sizes are bounded: bytes of text, nodes, depth, string and key lengths.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ..errors import ConfigurationError

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_NODES", "MAX_STRING", "plain_tree"]

#: The largest YAML text accepted (a receiver config is well under 2 kB).
MAX_CONFIG_BYTES = 64 * 1024
#: The most nodes (mappings, lists and scalars) a tree may hold.
MAX_NODES = 512
#: The deepest nesting accepted (a receiver config is 3 deep).
MAX_DEPTH = 8
#: The longest string value accepted.
MAX_STRING = 4096
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


def _parse_yaml(text: str) -> Any:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigurationError(f"config text is over {MAX_CONFIG_BYTES} bytes; refusing to parse it")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - the strict safe loader above
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"config is not plain YAML: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def plain_tree(cfg: Any, what: str = "config") -> dict[str, Any]:
    """``cfg`` (a ``dict``, a ``DictConfig`` or YAML text) as a tree of plain data, checked and bounded.

    Nothing in it is resolved, imported or called.

    Raises:
        ConfigurationError: naming the first place that is not plain data, or the limit passed.
    """
    if isinstance(cfg, str):
        tree = _parse_yaml(cfg)
    elif type(cfg) is dict:
        tree = cfg
    else:
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(cfg, DictConfig):
            raise ConfigurationError(f"a {what} is a dict, a DictConfig or YAML text, got {type(cfg).__name__}")
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
    elif kind not in _PLAIN_SCALARS:
        raise ConfigurationError(f"{where} holds a {kind.__name__}, which is not plain data")
