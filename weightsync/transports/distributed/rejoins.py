"""What the distributed sender reads of workers that join and rejoin: hellos, checked before anything in them is
believed, and the requests to rejoin that restarted workers leave in the store (read by the rejoin thread, on a
client of the store of its own); and a worker's side of a rejoin, its request (:func:`ask_to_rejoin`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...core.timing import deadline_after, remaining
from ...errors import SyncTimeoutError, TransportError, WeightSyncError, first_line
from ...tensors.copies import copy_tensors
from ..processes import process_is_gone
from ..store import MAX_HELLO_JSON, put_back_count, store_count, store_counted, store_json, store_set
from ..storeclient import connect_store
from .auth import Sealer, new_nonce, proof, proven
from .group import GROUP_TIMEOUT_FACTOR, gpu_identity, new_group_within
from .messages import addressed, announcement, sealed_object, sealed_word
from .transport import MAX_ERROR_TEXT, DistributedTransport

if TYPE_CHECKING:
    from ...core.engine import Sink
    from ..staging import Staging, StagingPool
    from .settings import DistributedSettings

__all__ = [
    "ASK_AGAIN_S",
    "NO_WHOLE_VERSION",
    "REJOIN_POLL_S",
    "REJOIN_SCAN_S",
    "UNPROVEN",
    "Admitting",
    "RejoinRequests",
    "ask_to_rejoin",
    "place_taken",
    "read_hello",
]

log = logging.getLogger("weightsync.transports.distributed")

#: Seconds between two looks at the store for requests to rejoin (the sender), or for the answer (a worker).
REJOIN_POLL_S = 0.05
#: Seconds between two looks at every worker's count of connections, whether or not the count of rejoins moved: that
#: count is a hint anyone who reaches the store can set (a count set high, then back, hid every later request).
REJOIN_SCAN_S = 1.0
#: Seconds a worker told to ask again (:data:`NO_WHOLE_VERSION`) waits before it does.
ASK_AGAIN_S = 0.2
#: Why a hello without a valid proof is refused.
UNPROVEN = "the process did not prove it holds the run key (the receiver config's authkey_file)"
#: Why a worker that rejoins is turned away while the trainer holds no whole copy of the newest version: a send is
#: staging one (the rejoin thread looks without waiting for the send), or the newest went as changes alone and a
#: send after it failed before it was published. The worker is told to ask again (:meth:`RejoinRequests.answer`),
#: which it does within its bound: the next send that succeeds publishes a whole version.
NO_WHOLE_VERSION = (
    "no whole version to send yet (a send is staging one, or the newest went as changes alone and a send after it "
    "failed before it was published)"
)


def read_hello(store: dist.Store, key: str, key_bytes: bytes, w: int, gen: int) -> tuple[dict[str, Any], str | None]:
    """The hello (or request to rejoin) at ``key``, and why it is refused (``None``: it is proven and well formed).

    Anyone who reaches the store may write there: it is read bounded, its fields are checked for type, and its
    proof with the run key; whatever is wrong refuses that worker and nothing else.
    """
    try:
        hello = store_json(store, key, MAX_HELLO_JSON)  # (parsed and proven only once it is that small)
    except TransportError as exc:
        return {}, f"{exc}"
    if not proven(key_bytes, w, gen, hello):
        return {}, UNPROVEN
    process, gpu = hello.get("process"), hello.get("gpu")
    if (
        type(hello.get("ok")) is not bool
        or not isinstance(hello.get("type", ""), str)
        or not isinstance(hello.get("message", ""), str)
        or not (process is None or (isinstance(process, dict) and all(isinstance(k, str) for k in process)))
        or not (gpu is None or isinstance(gpu, str))
        or not (isinstance(hello.get("nonce"), str) and 0 < len(hello["nonce"]) <= 64)
    ):
        return {}, f"store key {key!r} is not a hello a worker writes"
    return hello, None


def place_taken(
    w: int,
    hello: dict[str, Any],
    hellos: dict[int, dict[str, Any]],
    is_dead: Callable[[int], bool],
    model_id: str | None,
) -> str | None:
    """Why a new process of worker ``w`` (its ``hello``) may not take the worker's place, by what every worker said
    when it last joined (``hellos``): its earlier process is alive (and not the one asking: a worker whose
    connection closed asks back itself), or its GPU is another rank's (NCCL needs one GPU per rank). ``None``: it
    may (with a warning if it comes from another machine, where its earlier process cannot be looked at)."""
    earlier = hellos.get(w, {}).get("process")
    itself = earlier is not None and hello.get("process") == earlier  # (its connection closed: it asks back)
    gone = True if is_dead(w) or itself else process_is_gone(earlier)
    if gone is False:
        return f"worker {w} is already connected (its process {earlier['pid']} is alive)"  # type: ignore[index]
    if gone is None:
        log.warning("model %r: worker %d connected again from another machine; it replaces the earlier process",
                    model_id, w)  # fmt: skip
    gpu = hello.get("gpu")
    if gpu is not None:
        live = {v.get("gpu") for u, v in hellos.items() if u != w and not is_dead(u)}
        if gpu == gpu_identity() or gpu in live:
            return f"its GPU {gpu} is already used by another rank, and NCCL needs one GPU per rank"
    return None


def ask_to_rejoin(
    store: dist.Store, key: bytes, sealer: Sealer, gen: int, hello: dict[str, Any], deadline: float, where: dict
) -> tuple[int, str | None]:
    """A worker's side of a rejoin: ask the sender to take this process back as generation ``gen`` of worker
    ``where["worker_idx"]`` (``hello`` proven with the run ``key``), and as the next generations while the sender
    says to ask again (it holds no whole version to send yet: :data:`NO_WHOLE_VERSION`), every
    :data:`ASK_AGAIN_S`. Returns the generation the sender answered last, and ``None`` if it took it in, else why
    not ("the sender shut down": it did).

    Raises:
        SyncTimeoutError: the sender did not answer by ``deadline``.
        AuthenticationError: its answer is not sealed with the run key.
    """
    w, asked = where["worker_idx"], False
    while True:
        hello = {**hello, "nonce": new_nonce()}  # (each request's own: a process that rejoins twice, too)
        store.set(f"rejoin/{w}/{gen}", json.dumps({**hello, "proof": proof(key, w, gen, hello)}))
        store.add("rejoins", 1)
        verdict = f"verdict/{w}/{gen}"
        while not store.check([verdict]):
            if sealed_word(sealer, store, "shutdown", **where):
                return gen, "the sender shut down"
            if remaining(deadline) <= 0:
                raise SyncTimeoutError("the sender did not answer this request to rejoin in time", **where)
            time.sleep(min(REJOIN_POLL_S, remaining(deadline)))
        said = sealed_object(sealer, store, verdict, **where)
        if said.get("refused") is None:
            addressed(said, verdict, hello["nonce"], **where)
            return gen, None
        if said.get("again") is not True or remaining(deadline) <= ASK_AGAIN_S:
            note = " (it asked again until its deadline)" if asked else ""
            return gen, f"{str(said['refused'])[:MAX_ERROR_TEXT]}{note}"
        asked = True
        time.sleep(ASK_AGAIN_S)
        gen = int(store.add(f"gen/{w}", 1))


class RejoinRequests:
    """The requests to rejoin, as the rejoin thread finds them in the store: a restarted worker ``w`` bumps
    ``gen/<w>`` and ``rejoins``, and leaves its hello at ``rejoin/<w>/<gen>``; each is read once, whatever it holds
    (garbage is answered, never read again), and answered with a sealed verdict. The workers' counts are looked at
    when the count of rejoins changed, and every :data:`REJOIN_SCAN_S` whatever it holds; a worker's count found
    lower than a generation read before is put back (it only grows: a process that reached the store set it back).

    Args:
        prefix: the run's prefix in the store.
        address: the store's host and port.
        num_workers: how many workers may ask.
        model_id: the model's name (in log lines).
    """

    def __init__(self, prefix: str, address: tuple[str, int], num_workers: int, model_id: str | None) -> None:
        self.prefix, self.address, self.num_workers, self.model_id = prefix, address, num_workers, model_id
        #: The thread's own client of the store (``None``: closed, or not open yet).
        self.store: dist.Store | None = None
        #: worker -> the generation (connection count) read last: every worker joined as the first, at the rendez-vous
        self._gens: dict[int, int] = dict.fromkeys(range(num_workers), 1)
        self._seen = 0  # the count of rejoins at the last look at the workers' counts
        self._next_scan = 0.0  # (time.monotonic()) when the workers' counts are looked at, unless it moved first
        self._set_back: set[int] = set()  # the workers whose count was found set back (said once each)
        #: Whether the last reconnect failed (the store gone): the failures that follow are logged at debug level.
        self.unreachable = False

    def open(self, timeout: float) -> None:
        """Connect the thread's client (within ``timeout``)."""
        self.store = dist.PrefixStore(self.prefix, connect_store(*self.address, timeout, model_id=self.model_id))

    def next(self) -> tuple[int, int] | None:
        """The worker and generation of a request not read yet (``None``: none).

        Raises:
            EOFError: closed.
            dist.DistError, ValueError: the store failed, or a counter there is no number.
        """
        store = self.store
        if store is None:
            raise EOFError
        try:
            asked = store_count(store, "rejoins")
        except ValueError:  # a process that reached the store wrote there: put back what this thread counted
            log.warning("model %r: the store's count of rejoins was overwritten; restored", self.model_id)
            store.set("rejoins", str(self._seen))
            asked = self._seen
        now = time.monotonic()
        if asked == self._seen and now < self._next_scan:
            return None
        self._seen, self._next_scan = asked, now + REJOIN_SCAN_S
        for w in range(self.num_workers):
            try:
                gen, read = store_counted(store, f"gen/{w}")
            except ValueError:  # that worker's count was overwritten: it cannot rejoin, the others can
                continue
            if gen < self._gens[w]:  # (a process that counted itself from the lower count meanwhile is refused)
                if w not in self._set_back:
                    log.warning("model %r: worker %d's count of connections was set back; put back (said once)",
                                self.model_id, w)  # fmt: skip
                    self._set_back.add(w)
                put_back_count(store, f"gen/{w}", read, self._gens[w])
            elif gen > self._gens[w] and store.check([f"rejoin/{w}/{gen}"]):
                self._gens[w] = gen
                self._next_scan = now  # (more may wait: looked for at the next poll)
                return w, gen
        return None

    def answer(self, w: int, gen: int, hello: dict[str, Any], problem: str | None, sealer: Sealer) -> None:
        """Tell worker ``w`` (generation ``gen``, its request ``hello``) whether it may rejoin (``problem``: why
        not), sealed; a refusal for want of a whole version (:data:`NO_WHOLE_VERSION`) says to ask again. A process
        let in is named by its hello's nonce (:func:`~.messages.addressed`)."""
        assert self.store is not None
        key = f"verdict/{w}/{gen}"
        said: dict[str, Any] = {"refused": problem} if problem else {"ok": True, "nonces": {str(w): hello["nonce"]}}
        if problem == NO_WHOLE_VERSION:
            said["again"] = True
        store_set(self.store, key, sealer.seal(key, json.dumps(said)))

    def reconnect(self) -> None:
        """A new client of the store (torch's client never reconnects once the store closed it), or none until the
        next failure, if the store does not answer within a second."""
        try:
            fresh = dist.PrefixStore(self.prefix, connect_store(*self.address, 1.0, model_id=self.model_id))
        except (dist.DistError, WeightSyncError) as exc:
            level, self.unreachable = logging.DEBUG if self.unreachable else logging.WARNING, True
            log.log(level, "model %r: could not reach the store again (tried each second, said once): %s",
                    self.model_id, first_line(exc))  # fmt: skip
            return
        self.unreachable = False
        if self.store is not None:  # not closed meanwhile
            self.store = fresh

    def close(self) -> None:
        self.store = None


class Admitting:
    """The sender's side of a rejoin (:class:`~.sender.DistributedSender` holds the state it uses): the request
    read and answered, the two-rank group formed, and the newest version sent as the initial weights."""

    if TYPE_CHECKING:
        authkey: bytes
        address: tuple[str, int]
        buckets: list[tuple[int, int, int, int]]
        device: torch.device
        hellos: dict[int, dict[str, Any]]
        layout_tag: bytes
        mac: str
        newest: tuple[Staging, int, str, str] | None
        pool: StagingPool | None
        requests: RejoinRequests
        sealer: Sealer
        settings: DistributedSettings
        sink: Sink
        transports: dict[int, DistributedTransport]
        _unstaged: tuple[torch.Tensor | None, int] | None

        def _gone(self, w: int, exc: BaseException) -> None: ...

    def poll_rejoin(self) -> tuple[int, int, dict[str, Any], Any, dist.Store] | None:
        """A worker connecting again, answered and with its two-rank group formed.

        A restarted worker announces itself by bumping ``gen/<w>`` and ``rejoins``; it is refused if its
        earlier process is still alive.
        """
        requests = self.requests
        try:
            found = requests.next()
            if found is None:
                time.sleep(REJOIN_POLL_S)
                return None
            w, gen = found
            store = requests.store
            assert store is not None
            hello, problem = read_hello(store, f"rejoin/{w}/{gen}", self.authkey, w, gen)
            if problem is None:
                problem = self._rejoin_problem(w, hello)
            requests.answer(w, gen, hello, problem, self.sealer)
            if problem is not None:
                log.warning("model %r: refused worker %d connecting again: %s", self.sink.model_id, w, problem)
                return None
            pair = dist.PrefixStore(f"pair/{w}/{gen}", store)
            connect_timeout = self.sink.connect_timeout
            timeout = max(connect_timeout, GROUP_TIMEOUT_FACTOR * self.sink.timeout)
            # A process that reached the store may claim the pair's other rank: the wait ends at connect_timeout.
            pg = new_group_within(
                deadline_after(connect_timeout),
                f"the group of worker {w} connecting again",
                self.settings.backend,
                pair,
                0,
                2,
                timeout,
                self.address[0],
                model_id=self.sink.model_id,
                worker_idx=w,
            )
        except (dist.DistError, WeightSyncError, ValueError) as exc:  # ValueError: a counter that is no number
            if requests.store is None:  # closed meanwhile
                raise EOFError from None
            level = logging.DEBUG if requests.unreachable else logging.WARNING  # (said once while the store is gone)
            log.log(level, "model %r: a worker connecting again could not join: %s", self.sink.model_id,
                    first_line(exc))  # fmt: skip
            if isinstance(exc, dist.DistError):  # the store dropped this client (a counter it could not add to)
                requests.reconnect()
            time.sleep(REJOIN_POLL_S)  # whatever failed may fail again at once: never a loop without a pause
            return None
        return w, gen, hello, pg, pair

    def _rejoin_problem(self, w: int, hello: dict[str, Any]) -> str | None:
        """Why worker ``w`` may not come back with ``hello`` (``None``: it may)."""
        if not hello.get("ok"):
            return f"{hello.get('type', 'Error')}: {hello.get('message', '')}"
        if self.newest is None and self._unstaged is None:  # (admit() looks again, under the core's lock)
            return NO_WHOLE_VERSION
        return place_taken(w, hello, self.hellos, self.sink.is_dead, self.sink.model_id)

    def admit(self, candidate: tuple[int, int, dict[str, Any], Any, dist.Store]) -> tuple[int, int] | None:
        """Make the rejoined worker's transport current and send it the newest version published (the bytes
        the others got, even if the trainer's model has moved on)."""
        w, gen, hello, pg, pair = candidate
        old = self.transports.get(w)
        if old is not None and not self.sink.is_dead(w):
            old.close(0.0)  # its process is gone: nothing to wait for
        elif old is not None and old.line is not None:
            old.line.close(0.0)
        transport = self.transports[w] = DistributedTransport(
            w, device=self.device, model_id=self.sink.model_id, sink=self.sink
        ).use_pair(pg, pair, self.sealer.scoped(f"pair/{w}/{gen}/"))
        self.sink.rejoining(w)  # from here on, a failure is this new process's
        self.hellos[w] = hello
        if self.pool is not None:
            self.pool.forget(w)
        if self.newest is None and self._unstaged is not None:
            self._stage_unstaged()
        if self.newest is None:
            self.sink.died(w, f"failed to rejoin: {NO_WHOLE_VERSION}")
            return None
        staging, version, payload_digest, nonce = self.newest
        try:
            said = announcement(version, nonce, self.mac)
            store_set(pair, "initial", transport.sealer.seal("initial", json.dumps(said)))
            transport.announce(version, nonce, self.mac, initial=True)
            staging.readers[w] = [transport.send_part(staging.tensor[start:end]) for *_, start, end in self.buckets]
            transport.set_digest(payload_digest, version)
            transport.expect_ack(version)
        except (RuntimeError, dist.DistError) as exc:
            self._gone(w, exc)
            return None
        return w, version

    def _stage_unstaged(self) -> None:
        """Stage the newest version, of which only changes were sent, for a worker that rejoins."""
        assert self._unstaged is not None
        published, version = self._unstaged
        if published is None or self.pool is None:
            return
        try:
            staging = self.pool.acquire(deadline_after(self.sink.timeout), model_id=self.sink.model_id, version=version)
        except SyncTimeoutError as exc:
            log.warning("model %r: no buffer to send version %d to a worker that rejoins: %s", self.sink.model_id,
                        version, exc)  # fmt: skip
            return
        copy_tensors([staging.tensor[: published.numel()]], [published])
        nonce = new_nonce()
        mac = self.sealer.payload_mac(self.layout_tag, staging.tensor, version, nonce, self.mac)
        self.newest, self._unstaged = (staging, version, mac.hexdigest(), nonce), None
