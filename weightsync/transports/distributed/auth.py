"""The run key of a ``distributed`` scheme: what each side proves with it, to the other.

The sender draws a random key per run. Workers get it out of band, as the key file a receiver config names (or
inside a pickled scheme), never inside the config itself. The TCP store is readable and writable by anyone who
reaches its port (torch's store authenticates nobody, and ``list_keys()`` names every key, so the run's prefix is
no secret), and so is the group's formation: anyone may claim rank 0. Hence, with the key:

- a worker proves itself with its hello: an HMAC of what it says, its index and its generation. The sender admits
  no worker, at the rendez-vous or later, without a proof it checks (:func:`proof`, :func:`proven`);
- everything a worker acts on from the sender is sealed (:class:`Sealer`): an HMAC-SHA256 over a domain-separated
  message binding the run's prefix, the key's name, the version and the content (layout, verdicts, ``initial``,
  announcements, digests, the word that a worker was dropped). A worker refuses anything unsealed;
- the bytes of each update carry a keyed digest (:class:`PayloadMac`: HMAC-SHA256 of fixed-size chunks, hashed on
  threads as the bytes become ready, then of the chunks' MACs with the layout's digest): the sender publishes it,
  sealed, once every byte went out, and a worker checks the bytes in its staging buffer against it before any of
  them is written into the model. Whoever holds rank 0 without the key cannot make a worker apply anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...errors import AuthenticationError

__all__ = ["CHUNK_BYTES", "PayloadMac", "Sealer", "hash_pool", "layout_tag", "proof", "proven", "run_prefix"]

_PREFIX_TAG = b"weightsync distributed store prefix\0"
_HELLO_TAG = b"weightsync distributed hello\0"
_SEAL_TAG = b"weightsync distributed sealed store value v1\0"
_CHUNK_TAG = b"weightsync distributed payload chunk v1\0"
_PAYLOAD_TAG = b"weightsync distributed payload v1\0"
_MAC_HEX = 64  # HMAC-SHA256, in hex
#: The bytes of a payload hashed as one chunk: the chunks of a large update are hashed on several threads at once
#: (hashlib releases the GIL), and the first ones while the later ones are still being copied or received.
CHUNK_BYTES = 8 * 1024 * 1024


def hash_pool(name: str) -> ThreadPoolExecutor:
    """The threads an engine hashes chunks on (hashlib releases the GIL on large buffers: they run in parallel
    with each other and with the transfer); its owner shuts it down when it closes."""
    return ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix=f"weightsync-{name}")


def _framed(*fields: bytes) -> bytes:
    """The fields, each preceded by its length: no two different lists of fields frame to the same bytes."""
    return b"".join(struct.pack(">Q", len(f)) + f for f in fields)


def run_prefix(model_id: str, key: bytes) -> str:
    """The run's prefix in the store for ``model_id``: ``weightsync/<model_id>/<16 hex digits>``. Several runs
    sharing one store keep apart by it; it is not a secret (``list_keys()`` shows it)."""
    digest = hmac.new(key, _PREFIX_TAG + model_id.encode(), hashlib.sha256).hexdigest()
    return f"weightsync/{model_id}/{digest[:16]}"


def proof(key: bytes, worker: int, gen: int, hello: dict[str, Any]) -> str:
    """The proof worker ``worker`` (its ``gen``-th process) sends with ``hello`` (everything but the proof)."""
    said = json.dumps({k: v for k, v in hello.items() if k != "proof"}, sort_keys=True).encode()
    return hmac.new(key, _HELLO_TAG + f"{worker}/{gen}\0".encode() + said, hashlib.sha256).hexdigest()


def proven(key: bytes, worker: int, gen: int, hello: dict[str, Any]) -> bool:
    """Whether ``hello`` carries the proof that its sender holds ``key`` (compared in constant time)."""
    given = hello.get("proof")
    try:
        expected = proof(key, worker, gen, hello)
    except (TypeError, ValueError):  # not what a worker writes (json.dumps refused it): no proof
        return False
    return isinstance(given, str) and hmac.compare_digest(given, expected)


class Sealer:
    """Seals what the sender writes to the store, and opens it on a worker (the run key, the run's prefix and a
    scope: ``""`` for the run's group, ``"pair/<w>/<gen>/"`` for a rejoined worker's own)."""

    def __init__(self, key: bytes, prefix: str, scope: str = "") -> None:
        self._key, self.prefix, self.scope = key, prefix, scope

    def scoped(self, scope: str) -> Sealer:
        return Sealer(self._key, self.prefix, scope)

    def _mac(self, name: str, version: int | None, content: bytes) -> str:
        said = _framed(
            self.prefix.encode(),
            (self.scope + name).encode(),
            str(-1 if version is None else version).encode(),
            content,
        )
        return hmac.new(self._key, _SEAL_TAG + said, hashlib.sha256).hexdigest()

    def seal(self, name: str, content: str | bytes, version: int | None = None) -> bytes:
        """The value to store under ``name`` (in this scope): the MAC, a colon, ``content``."""
        data = content.encode() if isinstance(content, str) else content
        return self._mac(name, version, data).encode() + b":" + data

    def open(self, raw: bytes, name: str, version: int | None = None, /, **where: Any) -> bytes:
        """The content of ``raw``, read under ``name``, once its MAC is checked.

        Raises:
            AuthenticationError: ``raw`` was not sealed with the run key for this name, scope and version (a
                process that reached the store but holds no key wrote it, or it was moved from another key).
        """
        given, colon, content = raw.partition(b":")
        if not colon or len(given) != _MAC_HEX:
            raise AuthenticationError(
                f"store key {self.scope + name!r} is not sealed by the sender; refusing it", **where
            )
        if not hmac.compare_digest(given, self._mac(name, version, content).encode()):
            raise AuthenticationError(
                f"store key {self.scope + name!r} is not sealed with the run key (written by a process that does "
                "not hold it, or for another key or version); refusing it",
                **where,
            )
        return content

    def payload_mac(self, layout_tag: bytes, buffer: torch.Tensor, pool: ThreadPoolExecutor) -> PayloadMac:
        """A :class:`PayloadMac` of ``buffer`` under the run key (the scope plays no part: a rejoined worker is sent
        the bytes the others got)."""
        return PayloadMac(self._key, self.prefix, layout_tag, buffer, pool)


def layout_tag(layout_json: bytes) -> bytes:
    """What a payload MAC binds of the layout: the digest of its description, entries in order."""
    return hashlib.sha256(layout_json).digest()


class PayloadMac:
    """The keyed digest of one update's flat bytes (``buffer``, uint8), computed chunk by chunk on threads as the
    bytes become ready (:meth:`ready`), so that hashing overlaps the copy and the transfer.

    The chunks' MACs bind the prefix and each chunk's place; the digest binds them, the version, the layout's
    digest (``layout_tag``: entries in order, so that bytes are never read under another order) and the size.
    The version enters last: a worker learns it (for the initial weights) once the bytes are in.
    """

    def __init__(
        self, key: bytes, prefix: str, layout_tag: bytes, buffer: torch.Tensor, pool: ThreadPoolExecutor
    ) -> None:
        self._key, self._head, self._pool = key, _framed(prefix.encode()), pool
        self._layout_tag = layout_tag
        flat = buffer.detach().reshape(-1)
        self._buffer = flat if flat.device.type == "cpu" else None
        self._device_buffer = flat  # a GPU buffer is hashed from a host copy of each chunk
        self.nbytes = flat.numel()
        self._chunks: list[Future] = []
        self._next = 0  # the first byte not yet handed to a thread

    def _chunk(self, index: int, start: int, end: int) -> bytes:
        part = self._buffer[start:end] if self._buffer is not None else self._device_buffer[start:end].cpu()
        mac = hmac.new(self._key, _CHUNK_TAG + self._head + struct.pack(">QQQ", index, start, end), hashlib.sha256)
        mac.update(memoryview(part.numpy()))
        return mac.digest()

    def ready(self, upto: int) -> None:
        """Bytes ``[0, upto)`` are final: hash every whole chunk among them (and the last, short one at the end)."""
        while self._next < self.nbytes:
            end = min(self._next + CHUNK_BYTES, self.nbytes)
            if end > upto:
                return
            self._chunks.append(self._pool.submit(self._chunk, len(self._chunks), self._next, end))
            self._next = end

    def hexdigest(self, version: int) -> str:
        """The digest of version ``version``, once every chunk is hashed (this waits for them: local work, bounded
        by the size)."""
        self.ready(self.nbytes)
        macs = b"".join(chunk.result() for chunk in self._chunks)
        said = self._head + _framed(str(version).encode(), self._layout_tag, str(self.nbytes).encode(), macs)
        return hmac.new(self._key, _PAYLOAD_TAG + said, hashlib.sha256).hexdigest()
