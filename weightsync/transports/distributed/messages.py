"""The announcements a ``distributed`` sender writes for a worker (sealed: in the store and on its doorbell, or on
its line), and the check a worker makes of one once it opened it: both sides of their shape in one place; and how a
worker opens the other objects the sender seals in the store (its layout, its verdicts, its line's address)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from ...errors import AuthenticationError, TransportError
from ...tensors.layout import FlatLayout
from ..plainjson import loads_object
from ..store import MAX_STORE_JSON, store_read, store_value
from .auth import MACS, Sealer, layout_tag

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["addressed", "announcement", "checked_announcement", "sealed_layout", "sealed_object", "sealed_word"]

log = logging.getLogger("weightsync.transports.distributed")


def announcement(
    version: int,
    nonce: str,
    mac: str,
    delta: dict[str, Any] | None = None,
    taken: bool = False,
    digest: str | None = None,
    inline: bool = False,
) -> dict[str, Any]:
    """What a sender says of message ``version``: its one-time key ``nonce`` and ``mac``; ``delta``: the description
    of the changes its one part holds; ``digest``: the keyed digest of what it sends (the changes, or a small
    version hashed before it was announced): known before the bytes are sent, the worker needs no other word to
    check them; ``taken``: the worker is to say when it took it; ``inline``: its bytes follow it on the worker's line
    (:mod:`.line`), not over the group."""
    said: dict[str, Any] = {"version": version, "nonce": nonce, "mac": mac}
    if delta is not None:
        said["delta"] = delta
    if digest is not None:
        said["digest"] = digest
    if taken:
        said["taken"] = True
    if inline:
        said["inline"] = True
    return said


def checked_announcement(content: bytes, key: str, **where: Any) -> dict[str, Any]:
    """An opened announcement (read at ``key``), checked to be one a sender writes: :func:`announcement`'s,
    ``{"closed": True}`` or ``{"dropped": str}``.

    Raises:
        TransportError: it is none of these.
    """
    msg = loads_object(content, f"store key {key!r}", max_bytes=MAX_STORE_JSON)
    version, nonce = msg.get("version"), msg.get("nonce")
    if (
        set(msg) - {"delta", "taken", "digest", "inline"} == {"version", "nonce", "mac"}
        and isinstance(msg.get("delta", {}), dict)
        and ("digest" not in msg or (isinstance(msg["digest"], str) and len(msg["digest"]) <= 128))
        and msg.get("taken", True) is True
        and msg.get("inline", True) is True
        and type(version) is int
        and version >= 0
        and isinstance(nonce, str)
        and 0 < len(nonce) <= 64
        and msg["mac"] in MACS
    ):
        return msg
    if msg == {"closed": True} or (set(msg) == {"dropped"} and isinstance(msg["dropped"], str)):
        return msg
    raise TransportError(f"store key {key!r} holds no announcement a sender makes; refusing it", **where)


def sealed_object(sealer: Sealer, store: dist.Store, key: str, **where: Any) -> dict[str, Any]:
    """The JSON object the sender sealed under ``key`` in ``store``.

    Raises:
        AuthenticationError: it is not sealed with the run key (for this key).
        TransportError: it holds nothing (deleted once seen), or no bounded JSON object.
    """
    return loads_object(
        sealer.open(store_value(store, key), key, **where), f"store key {key!r}", max_bytes=MAX_STORE_JSON
    )


def addressed(said: dict[str, Any], key: str, nonce: str, **where: Any) -> None:
    """Check that the verdict ``said`` (read under ``key``) answers this request of its worker: the one whose hello
    carried ``nonce``, made for it (the sender names, per worker it lets in, the nonce of the hello it read). A
    verdict sealed for an earlier request (an earlier process of the worker, or this one's earlier rejoin) opens as
    well: its store key came back when a process that reached the store set the worker's count of connections
    back, and would let this one apply what was sent after that earlier answer.

    Raises:
        AuthenticationError: it answers another request of this worker, not this one.
    """
    nonces = said.get("nonces")
    if not isinstance(nonces, dict) or nonces.get(str(where["worker_idx"])) != nonce:
        raise AuthenticationError(
            f"store key {key!r} answers another request of this worker (an earlier one's answer, replayed: the "
            "store's count of its connections was set back); refusing it",
            **where,
        )


def sealed_layout(sealer: Sealer, store: dist.Store, **where: Any) -> tuple[FlatLayout, bytes]:
    """The sender's layout, sealed, and described exactly as a sender describes one (its entries in the order the
    sender packs them: byte offsets follow that order; each key once), with its tag (:func:`~.auth.layout_tag`).

    Raises:
        AuthenticationError: it is not sealed with the run key.
        TransportError: it is no layout, or not one as a sender describes it.
    """
    content = sealer.open(store_value(store, "layout"), "layout", **where)
    plain = loads_object(content, "store key 'layout'", max_bytes=MAX_STORE_JSON)
    layout = FlatLayout.from_plain(plain)
    if layout.to_plain() != plain:
        raise TransportError(
            "store key 'layout' is not a layout as the sender describes one (entries repeated or out of the order "
            "they are packed in); refusing it",
            **where,
        )
    return layout, layout_tag(content)


def sealed_word(sealer: Sealer, store: dist.Store, key: str, **where: Any) -> bool:
    """Whether the sender's word ``key`` (that it dropped this worker, or shut down) is in ``store``, sealed. One not
    sealed with the run key is a stranger's: logged, neither obeyed nor raised (a worker that stopped at it was held
    for good by anyone who reaches the store; what it applies is checked against the sender's sealed digest all the
    same)."""
    raw = store_read(store, key)
    if raw is None:
        return False
    try:
        sealer.open(raw, key, **where)
    except AuthenticationError as exc:
        _warn_once(f"{exc}; not obeyed")
        return False
    return True


@functools.lru_cache(maxsize=64)
def _warn_once(text: str) -> None:
    log.warning("%s", text)
