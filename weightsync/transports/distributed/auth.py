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
- the bytes of each update carry a keyed digest (:class:`PayloadMac`: AES-GMAC or Poly1305, whichever costs less
  on the sender's CPU for the model's size, under a one-time key drawn from the run key, the version, a fresh
  nonce and the layout): the sender publishes it, sealed, and a worker checks the bytes in its staging buffer
  against it before any of them is written into the model. Whoever holds rank 0 without the key cannot make a
  worker apply anything.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any

import torch

from ...errors import AuthenticationError, ConfigurationError, TransportError, WeightSyncError

#: Whether cryptography's AES-GMAC and Poly1305 are here (without the package, HMAC-SHA256 alone).
try:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    _CRYPTOGRAPHY = True
except ImportError:  # pragma: no cover - HMAC-SHA256 then, several times slower
    _CRYPTOGRAPHY = False

    class UnsupportedAlgorithm(Exception):  # type: ignore[no-redef]
        """(cryptography's, which only its MACs raise.)"""


__all__ = [
    "ACK_TAG_WORDS",
    "MACS",
    "NO_BYTES",
    "PayloadMac",
    "Sealer",
    "Unverifiable",
    "fastest_mac",
    "layout_tag",
    "line_proof",
    "new_nonce",
    "proof",
    "proven",
    "run_prefix",
    "worker_prefix",
]

_PREFIX_TAG = b"weightsync distributed store prefix\0"
_HELLO_TAG = b"weightsync distributed hello\0"
_SEAL_TAG = b"weightsync distributed sealed store value v1\0"
_PAYLOAD_TAG = b"weightsync distributed payload one-time key v1\0"
_ACK_TAG = b"weightsync distributed ack v1\0"
_LINE_TAG = b"weightsync distributed line v1\0"
#: The int64 words of an ack's tag (HMAC-SHA256, 32 bytes).
ACK_TAG_WORDS = 4
_MAC_HEX = 64  # HMAC-SHA256, in hex
#: GMAC's nonce: each key serves one message (:class:`PayloadMac`), so one nonce serves them all.
_GMAC_NONCE = bytes(12)
#: The MACs a worker knows for an update's bytes (the sender names its own in each announcement: :func:`fastest_mac`).
MACS = ("aes-gmac", "poly1305", "hmac-sha256")
#: The digest a sender seals for changes that carry no bytes (nothing changed): there is nothing to authenticate
#: but their description, which is sealed, and neither side derives a one-time key for them.
NO_BYTES = ""
#: The sizes :func:`_mac_costs` times each MAC over, and how many times (the fastest time of each counts).
_SMALL_BYTES, _TRIAL_BYTES, _TRIALS = 4096, 4 << 20, 3


class _Gmac:
    """AES-256-GMAC: GCM's tag over the bytes as associated data, nothing encrypted."""

    def __init__(self, key: bytes) -> None:
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(_GMAC_NONCE)).encryptor()
        self.update = self._gcm.authenticate_additional_data

    def hexdigest(self) -> str:
        self._gcm.finalize()
        return self._gcm.tag.hex()


class _Poly:
    """Poly1305, a one-time authenticator: each of its keys serves one message, as each one-time key here does."""

    def __init__(self, key: bytes) -> None:
        self._poly = Poly1305(key)
        self.update = self._poly.update

    def hexdigest(self) -> str:
        return self._poly.finalize().hex()


def _hmac_sha256(key: bytes) -> Any:
    return hmac.new(key, digestmod=hashlib.sha256)


#: Each MAC here, started with a one-time key: an object with ``update(bytes)`` and ``hexdigest()``.
_STARTS: dict[str, Callable[[bytes], Any]] = {"hmac-sha256": _hmac_sha256}
if _CRYPTOGRAPHY:
    _STARTS.update({"aes-gmac": _Gmac, "poly1305": _Poly})


@functools.cache
def _works(name: str) -> bool:
    """Whether this process's OpenSSL computes MAC ``name`` (a build may leave Poly1305 out, FIPS ones do)."""
    try:
        _STARTS[name](bytes(32)).hexdigest()
    except UnsupportedAlgorithm:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _mac_costs() -> dict[str, tuple[float, float]]:
    """For each of cryptography's MACs here: the seconds one message costs whatever its size (the start with a key
    and the finish), and the seconds each byte costs; timed once, in turn, the fastest of :data:`_TRIALS` each
    (about 10 ms in all). Empty without cryptography."""
    trials = [name for name in ("aes-gmac", "poly1305") if name in _STARTS and _works(name)]
    data, key = memoryview(bytes(_TRIAL_BYTES)), bytes(32)
    piece = _TRIAL_BYTES // 4  # (fed in pieces, as buckets and reads from the wire are)
    small: dict[str, float] = dict.fromkeys(trials, float("inf"))
    large = dict(small)
    for _ in range(_TRIALS):
        for name in trials:  # (in turn: a slow spell of the host falls on both)
            for size, best in ((_SMALL_BYTES, small), (_TRIAL_BYTES, large)):
                start = time.perf_counter()
                state = _STARTS[name](key)
                for at in range(0, size, piece):
                    state.update(data[at : min(at + piece, size)])
                state.hexdigest()
                best[name] = min(best[name], time.perf_counter() - start)
    per_byte = {name: max(large[name] - small[name], 0.0) / (_TRIAL_BYTES - _SMALL_BYTES) for name in trials}
    return {name: (max(small[name] - _SMALL_BYTES * per_byte[name], 0.0), per_byte[name]) for name in trials}


def fastest_mac(nbytes: int) -> str:
    """The MAC a sender authenticates messages of about ``nbytes`` with: of AES-GMAC and Poly1305 (cryptography's),
    the one that costs least for that size on this CPU (:func:`_mac_costs`); HMAC-SHA256 where cryptography is
    missing.

    Which one wins depends on the CPU and the size: AES-GMAC hashed 8.6 GB/s on one of our machines against 2.4 to
    3.6 for Poly1305; on another (an AMD EPYC without AVX-512) 6.3 to 7.0 GB/s against 5.7 to 6.2, but starting
    one took 70 us against 20, so that Poly1305 hashed 1 MB sooner. Either is a one-time MAC under the one-time key
    of :class:`PayloadMac`; the worker follows the name in the sealed announcement."""
    costs = _mac_costs()
    if not costs:
        return "hmac-sha256"
    return min(costs, key=lambda name: costs[name][0] + nbytes * costs[name][1])


def new_nonce() -> str:
    """A fresh nonce for one message's one-time key (128 random bits, in hex)."""
    return secrets.token_hex(16)


def _framed(*fields: bytes) -> bytes:
    """The fields, each preceded by its length: no two different lists of fields frame to the same bytes."""
    return b"".join(struct.pack(">Q", len(f)) + f for f in fields)


def run_prefix(model_id: str, key: bytes) -> str:
    """The run's prefix in the store for ``model_id``: ``weightsync/<model_id>/<16 hex digits>``. Several runs
    sharing one store keep apart by it; it is not a secret (``list_keys()`` shows it)."""
    digest = hmac.new(key, _PREFIX_TAG + model_id.encode(), hashlib.sha256).hexdigest()
    return f"weightsync/{model_id}/{digest[:16]}"


def worker_prefix(key: bytes, served: str | None, **where: Any) -> str:
    """A worker's :func:`run_prefix` (``where`` names its model and index), checked against ``served``, the
    prefix its sender named in the receiver config (``None``: none named, as in a pickled scheme): a worker under
    another prefix waits where its sender never looks, and both ended on time-outs that said nothing of why (a
    Hydra user's audit: a config whose ``model_id`` was edited).

    Raises:
        ConfigurationError: the prefixes differ, naming the model the sender serves or, for the same model, the
            run key (another run's key file).
    """
    model_id = where["model_id"]
    prefix = run_prefix(model_id, key)
    if served is None or served == prefix:
        return prefix
    theirs = served[len("weightsync/") : served.rfind("/")]
    if theirs != model_id:
        raise ConfigurationError(
            f"model_id {model_id!r} is not the model its sender serves ({theirs!r}): a receiver config's model_id "
            "must be its sender's",
            **where,
        )
    raise ConfigurationError(
        "connection.run and the key in connection.authkey_file are of different runs (a config or a key file of "
        "another run?)",
        **where,
    )


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


def line_proof(key: bytes, prefix: str, worker: int, nonce: bytes) -> bytes:
    """What worker ``worker`` answers the sender's challenge ``nonce`` with, on the line it opens in the run of
    ``prefix`` (:mod:`.line`): an HMAC-SHA256 the challenge makes good for that one connection."""
    return hmac.new(key, _LINE_TAG + _framed(prefix.encode(), str(worker).encode(), nonce), hashlib.sha256).digest()


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

    def ack_tag(self, worker: int, seq: int, held: int, status: int) -> list[int]:
        """The tag a worker sends with its ack of message ``seq`` (``held``, ``status``), as int64 words: the
        ack travels over the group, and whoever took a worker's rank there holds no key to make one."""
        said = _framed(self.prefix.encode(), self.scope.encode(), struct.pack(">qqqq", worker, seq, held, status))
        digest = hmac.new(self._key, _ACK_TAG + said, hashlib.sha256).digest()
        return list(struct.unpack(">4q", digest))

    def payload_mac(self, layout_tag: bytes, buffer: torch.Tensor, version: int, nonce: str, alg: str) -> PayloadMac:
        """A :class:`PayloadMac` of ``buffer`` under the run key (the scope plays no part: a rejoined worker is sent
        the bytes the others got, under their nonce)."""
        return PayloadMac(self._key, self.prefix, layout_tag, buffer, version, nonce, alg)


class Unverifiable:
    """In place of the :class:`PayloadMac` of a message this process cannot compute (the MAC the sender picked is
    unknown here, or missing from its libraries): its bytes are read all the same, so that the next message is
    read in step, and the message is refused with :attr:`error`. ``nbytes``: the message's."""

    def __init__(self, error: WeightSyncError, nbytes: int) -> None:
        self.error, self.nbytes = error, nbytes

    def begin(self) -> None:
        pass

    def ready(self, upto: int) -> None:
        pass


def layout_tag(layout_json: bytes) -> bytes:
    """What a payload MAC binds of the layout: the digest of its description, entries in order."""
    return hashlib.sha256(layout_json).digest()


class PayloadMac:
    """The keyed digest of one update's flat bytes (``buffer``, uint8), fed as the bytes become ready
    (:meth:`ready`: bucket by bucket, while the next buckets are copied or on the wire).

    Each message gets a one-time key, an HMAC-SHA256 with the run key of the prefix, the version, a nonce the
    sender draws for it, the layout's digest (``layout_tag``: entries in order, so that bytes are never read
    under another order) and the size; with it, ``alg`` authenticates the bytes: AES-256-GMAC (``"aes-gmac"``:
    GCM's tag over the bytes as associated data, nothing encrypted) or Poly1305 (``"poly1305"``), both from the
    ``cryptography`` package (the sender picks the cheaper here: :func:`fastest_mac`), or HMAC-SHA256
    (``"hmac-sha256"``, where ``cryptography`` is missing: about 1 GB/s). A one-time key never serves two
    messages (the nonce of each send is fresh), which is what Poly1305 asks of its key, and what lets GMAC's own
    nonce be fixed.
    """

    def __init__(
        self, key: bytes, prefix: str, layout_tag: bytes, buffer: torch.Tensor, version: int, nonce: str, alg: str
    ) -> None:
        if alg not in MACS:
            raise TransportError(f"unknown MAC {alg[:40]!r} named by the sender")
        if alg not in _STARTS:
            raise ConfigurationError(
                f"the sender authenticates updates with {alg}, from the cryptography package: pip install cryptography"
            )
        if not _works(alg):  # (a build of OpenSSL without it: its start would fail)
            raise ConfigurationError(f"the sender authenticates updates with {alg}, which this process's OpenSSL lacks")
        flat = buffer.detach().reshape(-1)
        self._buffer, self.nbytes, self._alg = flat, flat.numel(), alg
        size = str(self.nbytes).encode()
        self._said = _framed(prefix.encode(), str(version).encode(), nonce.encode(), layout_tag, size)
        self._key = key
        self._state: Any = None  # made by begin()
        self._next = 0  # the first byte not yet hashed

    def begin(self) -> None:
        """Derive the one-time key and start the MAC (done by the first :meth:`ready` otherwise): a worker does it
        once its receives are posted, while the bytes are on their way."""
        if self._state is None:  # (the MAC works here: checked when this was made)
            once = hmac.new(self._key, _PAYLOAD_TAG + self._said, hashlib.sha256).digest()
            self._state = _STARTS[self._alg](once)

    def ready(self, upto: int) -> None:
        """Bytes ``[0, upto)`` are final: hash those not hashed yet (hashlib and cryptography release the GIL)."""
        self.begin()
        if upto <= self._next:
            return
        part = self._buffer[self._next : upto]
        if part.device.type != "cpu":  # NCCL: the bytes are on the GPU, and hashed from a host copy
            part = part.cpu()
        self._state.update(part.numpy().data)
        self._next = upto

    def hexdigest(self) -> str:
        """The digest, once every byte is hashed (the rest is hashed now)."""
        self.ready(self.nbytes)
        return str(self._state.hexdigest())
