"""Another user on the trainer's host attacks a ``distributed`` run (SPEC section 11; issue 31, findings 2, 3, 5).

The attacker (tests/_attack_distributed.py) runs as uid 65534 with no key and no config: it finds the store's
port in /proc/net/tcp and the run's prefix with ``list_keys()``, and talks only to this test's trainer. Each
attack must be refused with a weightsync error: nothing applied (the worker's weights unchanged, no ack as
applied), and the trainer's ``connect()`` within its ``connect_timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
import threading
import time

import pytest
import torch
from torch import nn

import weightsync as ws
from tests._as_stranger import ROOT, needs_stranger, run_stranger, start_stranger
from weightsync.core.timing import remaining
from weightsync.transports.distributed import sender as sender_module
from weightsync.transports.distributed.auth import MACS, Sealer
from weightsync.transports.distributed.transport import DistributedTransport

CONNECT_TIMEOUT = 6.0
#: What a bound may be overrun by: the scheduling of a 2-core machine running the attacker's interpreter too.
SLACK_S = 3.0
ATTACK = ["-m", "tests._attack_distributed"]
FOUND = "found the run's prefix"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # 0.weight and 1.weight: same shape, same dtype


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(blob: bytes, worker_idx: int, conn) -> None:
    """A real worker (it holds the run key): connect, report, then receive on command until told to stop."""
    scheme = pickle.loads(blob)
    model = _model(100 + worker_idx)
    before = _state(model)
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    conn.send(("ready",))
    try:
        scheme.connect()
    except ws.WeightSyncError as exc:
        unchanged = all(torch.equal(before[k], v) for k, v in _state(model).items())
        conn.send(("refused", type(exc).__name__, str(exc), unchanged))
        return  # the process ends: a rank 0 that is not the sender sees its link close, and no ack
    conn.send(("connected", scheme.version, _state(model)))
    while conn.poll(60):
        if conn.recv() != "receive":
            break
        before = _state(model)
        try:
            scheme.receive(timeout=20)
        except ws.WeightSyncError as exc:
            unchanged = all(torch.equal(before[k], v) for k, v in _state(model).items())
            conn.send(("refused", type(exc).__name__, str(exc), unchanged))
            continue
        conn.send(("received", scheme.version, _state(model)))
    scheme.shutdown()


class _Worker:
    def __init__(self, scheme: ws.DistributedWeightSyncScheme, worker_idx: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(pickle.dumps(scheme), worker_idx, theirs), daemon=True)
        self.proc.start()
        # Each test's trainer connects once the worker is about to: a spawn that a loaded host slowed past the
        # trainer's connect_timeout ends the rendez-vous before the attack a test makes (seen in CI).
        assert self.report() == ("ready",)

    def report(self, timeout: float = 60) -> tuple:
        assert self.conn.poll(timeout), "the worker said nothing in time"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _sender(num_workers: int = 1) -> tuple[nn.Module, ws.DistributedWeightSyncScheme, int]:
    model = _model(0)
    scheme = ws.DistributedWeightSyncScheme(timeout=3, connect_timeout=CONNECT_TIMEOUT)
    scheme.init_on_sender(model=model, num_workers=num_workers)
    return model, scheme, scheme._sending.engine.address[1]


def _end(attacker) -> None:
    """Kill the attacker if it is still running, and reap it (bounded)."""
    if attacker.poll() is None:
        attacker.kill()
        attacker.wait(timeout=10)


def _reading(attacker, *marks: str) -> tuple[list[str], dict[str, threading.Event], threading.Thread]:
    """The stranger's output, line by line as it comes (on a thread), and for each of ``marks`` an event set once a
    line starts with it."""
    lines: list[str] = []
    seen = {mark: threading.Event() for mark in marks}

    def read() -> None:
        for line in attacker.stdout:
            lines.append(line)
            for mark, event in seen.items():
                if line.startswith(mark):
                    event.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, seen, reader


def _found_the_run(attacker, *marks: str) -> tuple[list[str], dict[str, threading.Event], threading.Thread]:
    """:func:`_reading` (``marks``, and the line that says the stranger found the run), once the stranger found the
    run in the store: it is then as ready as a stranger who lies in wait. The tests start the worker after that, so
    that the bound of the worker's connect() never includes the stranger's interpreter starting (as long as that
    bound, 6 s, on a loaded host)."""
    lines, seen, reader = _reading(attacker, FOUND, *marks)
    assert seen[FOUND].wait(60), "".join(lines)
    return lines, seen, reader


def _output(attacker, lines: list[str], reader: threading.Thread) -> str:
    """All the stranger said, once it ended (bounded)."""
    attacker.wait(timeout=60)
    reader.join(10)
    return "".join(lines)


def _timed_connect(scheme: ws.DistributedWeightSyncScheme) -> tuple[BaseException | None, float]:
    began = time.monotonic()
    try:
        scheme.connect()
    except ws.WeightSyncError as exc:
        return exc, time.monotonic() - began
    return None, time.monotonic() - began


@needs_stranger
def test_a_planted_verdict_and_initial_are_refused_and_the_trainer_keeps_its_bound():
    """Finding 2 as it was run: the stranger writes ``verdict`` and ``initial`` and claims rank 0."""
    _, scheme, port = _sender()
    attacker = start_stranger([*ATTACK, "plant", str(port)])
    worker = None
    try:
        lines, _, reader = _found_the_run(attacker)
        worker = _Worker(scheme)
        got = worker.report()
        assert got[0] == "refused" and got[1] == "AuthenticationError" and "'verdict'" in got[2], got
        assert got[3], "the worker's weights changed"
        error, took = _timed_connect(scheme)
        assert isinstance(error, ws.WeightSyncError), error
        assert took <= CONNECT_TIMEOUT + SLACK_S, f"connect() took {took:.1f}s with connect_timeout={CONNECT_TIMEOUT}"
        out = _output(attacker, lines, reader)
        assert "planted verdict and initial" in out, out
        assert "\nack " not in out, f"the worker acked the stranger's bytes:\n{out}"
    finally:
        if worker is not None:
            worker.stop()
        scheme.shutdown()
        _end(attacker)


@needs_stranger
def test_a_stranger_holding_rank_0_makes_the_worker_apply_nothing(monkeypatch):
    """The stranger forms the group as rank 0 with worker 0 (the trainer is held back until it did), names the
    initial version and sends 666.0. Either way the race ends, nothing of the stranger's is applied:

    - the worker refuses the unsealed ``initial`` before it reads a byte and acks nothing, and the trainer's
      connect() fails within its bound (the usual ending);
    - or the worker is paired with the trainer after all, and holds the trainer's version 0. gloo's side that
      connects first declares its pair formed without an answer: the stranger does, then the trainer's rank 0
      address replaces the stranger's in the store before a slow worker reads it, and a worker whose address
      sorts above the trainer's connects to the trainer (the stranger's socket waits unread in its listener).

    (Bytes from a rank 0 under sealed words: the test after this one.)"""
    model, scheme, port = _sender()
    real = sender_module.new_group_within

    def late(deadline, *args, **kwargs):
        claimed.wait(max(remaining(deadline), 0.0))  # the stranger formed the group with worker 0 first
        return real(deadline, *args, **kwargs)

    monkeypatch.setattr(sender_module, "new_group_within", late)
    attacker = start_stranger([*ATTACK, "squat", str(port)])
    worker = None
    try:
        lines, seen, reader = _found_the_run(attacker, "claimed rank 0")
        claimed = seen["claimed rank 0"]
        worker = _Worker(scheme)
        error, took = _timed_connect(scheme)
        assert took <= CONNECT_TIMEOUT + SLACK_S, f"connect() took {took:.1f}s with connect_timeout={CONNECT_TIMEOUT}"
        got = worker.report()
        if error is None:  # paired with the trainer after all: it holds the trainer's version 0, to the bit
            assert got[0] == "connected" and got[1] == 0, got
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in got[2].items()), "not the trainer's weights"
        else:
            assert isinstance(error, ws.WeightSyncError), error
            assert got[0] == "refused" and got[1] == "AuthenticationError", got
            assert got[3], "the worker's weights changed"
        out = _output(attacker, lines, reader)
        assert "claimed rank 0" in out, out  # the stranger did form the group with the worker, as it saw it
        assert "\nack " not in out, f"the worker acked the stranger's bytes:\n{out}"
    finally:
        if worker is not None:
            worker.stop()
        scheme.shutdown()
        _end(attacker)
    # The trainer stopped waiting at its deadline; gloo's own thread, connected to a worker that was taken, ends
    # once that worker's process is gone.
    for thread in [t for t in threading.enumerate() if t.name == "weightsync-group-formation"]:
        thread.join(30)
        assert not thread.is_alive(), "gloo's formation thread outlived the worker it waited on"


@needs_stranger
def test_a_stranger_on_the_line_port_gets_no_line_and_the_worker_gets_its_own():
    """The stranger reads the line port's address in the store, floods it with more silent connections than the
    trainer holds unproven, and answers a challenge as worker 0 without the key: that connection is closed without
    a word, the flood is closed, and the worker still gets its line within the trainer's bound."""
    model, scheme, port = _sender()
    attacker = start_stranger([*ATTACK, "line", str(port)])
    lines, seen, reader = _reading(attacker, "connected")
    worker = None
    try:
        assert seen["connected"].wait(60), "".join(lines)
        worker = _Worker(scheme)
        error, took = _timed_connect(scheme)
        assert error is None, error
        assert took <= CONNECT_TIMEOUT + SLACK_S, f"connect() took {took:.1f}s with connect_timeout={CONNECT_TIMEOUT}"
        assert worker.report()[:2] == ("connected", 0)
        assert scheme._sending.engine.transports[0].line is not None  # the worker's own line, taken
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        worker.conn.send("receive")
        scheme.send()
        got = worker.report()
        assert got[:2] == ("received", 1), got
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in got[2].items())
        attacker.wait(timeout=60)
        reader.join(10)
        out = "".join(lines)
        assert "listening: True" in out and "liar: closed without a word" in out, out
        assert "silent: 72 of 72 closed" in out, out
    finally:
        if worker is not None:
            worker.stop()
        scheme.shutdown()
        _end(attacker)


def test_bytes_that_are_not_the_senders_are_refused_before_the_model_sees_them(monkeypatch):
    """Whoever sends on rank 0, bytes that do not hash with the run key to the sender's sealed digest are never
    applied: here the sender's own wire carries other bytes than it staged (as a stranger's rank 0 would)."""
    from weightsync.transports.distributed import sender

    monkeypatch.setattr(sender, "INLINE_DIGEST_BYTES", -1)  # the bytes go over the group (not the worker's line)
    model, scheme, _ = _sender()
    worker = _Worker(scheme)
    try:
        scheme.connect()
        got = worker.report()
        assert got[0] == "connected" and got[1] == 0, got
        held = got[2]
        real = DistributedTransport.send_part

        def forged(self, part):
            return real(self, torch.full_like(part, 7))  # kept alive by the send until it completed

        monkeypatch.setattr(DistributedTransport, "send_part", forged)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        worker.conn.send("receive")
        with pytest.raises(ws.WeightSyncError, match="keyed digest"):
            scheme.send()
        got = worker.report()
        assert got[0] == "refused" and got[1] == "AuthenticationError" and got[3], got
        monkeypatch.setattr(DistributedTransport, "send_part", real)
        worker.conn.send("receive")
        scheme.send()
        got = worker.report()
        assert (
            got[0] == "received"
            and got[1] == 2
            and all(torch.equal(v, model.state_dict()[k]) for k, v in got[2].items())
        )
        assert any(not torch.equal(v, held[k]) for k, v in got[2].items())
    finally:
        worker.stop()
        scheme.shutdown()


@needs_stranger
@pytest.mark.parametrize("how", ["reordered", "deep"])
def test_a_replaced_layout_is_refused(how):
    """Finding 3 (entries reordered, the sender's MAC kept) and finding 5 (JSON 200,000 deep in ``layout``)."""
    _, scheme, port = _sender()
    done = run_stranger([*ATTACK, "layout", str(port), how], timeout=60)
    assert f"layout replaced ({how})" in done.stdout, done.stdout
    worker = _Worker(scheme)
    try:
        got = worker.report()
        assert got[0] == "refused" and got[1] == "AuthenticationError" and "'layout'" in got[2], got
        assert got[3], "the worker's weights changed"
    finally:
        worker.stop()
        scheme.shutdown()


def test_a_hello_deleted_once_seen_or_too_large_is_refused_at_once_not_waited_for_or_parsed():
    """A stranger who replaced worker 0's hello with 8 MB and deleted worker 1's once the trainer had seen it held
    the trainer's connect 21 s at ``connect_timeout=8`` (a review): the read of the deleted key waited the store's
    own timeout, and the 8 MB were parsed and their proof computed (3.3 s) before they were refused."""
    from datetime import timedelta

    import torch.distributed as dist

    from weightsync.transports.distributed.rejoins import read_hello

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    key = b"k" * 32
    assert read_hello(store, "hello/1", key, 1, 1) == (
        {},
        "store key 'hello/1' holds nothing (deleted once seen); refusing it",
    )
    store.set("hello/0", b'{"a":[' + b"1," * 40_000 + b"1]}")
    hello, problem = read_hello(store, "hello/0", key, 0, 1)
    assert hello == {} and problem is not None and "80009 bytes, over 65536" in problem, problem


class _DeletesWhatIsSeen:
    """A store a stranger shares, who deletes each key the moment a look (``check``) found it: the timing a review
    hit in 3 to 14 tries, watching the rejoin thread's polls."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        for key in keys:
            self._store.delete_key(key)
        return found


def test_a_count_deleted_once_seen_is_read_in_one_step_not_waited_for():
    """The review deleted ``gen/0`` between the rejoin thread's look and its read: the read waited its client's own
    timeout (35 s), and each send to a rejoined worker (announced on that client) waited behind it: 34 s at
    ``timeout=5``. Counts, like hellos, are read in one step that does not wait."""
    from datetime import timedelta

    import torch.distributed as dist

    from weightsync.transports.distributed.rejoins import RejoinRequests

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    for key, value in {"rejoins": "1", "gen/0": "2", "rejoin/0/2": "{}"}.items():
        store.set(key, value)
    requests = RejoinRequests("", ("127.0.0.1", store.port), 2, "policy")
    requests.store = _DeletesWhatIsSeen(store)
    assert requests.next() == (0, 2)  # (its hello, deleted too, is then refused as holding nothing: above)


def test_a_word_of_a_drop_the_sender_did_not_seal_is_not_obeyed_and_holds_no_worker(workers):
    """A value at ``dropped/1`` from anyone who reaches the store (no key: not sealed) made worker 1 refuse every
    version too large to carry its digest in its announcement (over 4 MiB) with an AuthenticationError, and the
    trainer time it out, for good: one write held a worker (and ended a vLLM engine's stager thread)."""
    from tests._bodies import optimizer_step, start
    from tests._workers import build, checksum

    model = build("flat2_8mb")
    scheme = ws.DistributedWeightSyncScheme(timeout=5, connect_timeout=60)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "flat2_8mb"}, n=2)
    try:
        assert all(errors == {} for _, _, errors in ready)
        scheme._sending.engine.store.set("dropped/1", b"not sealed")
        for version in (1, 2):
            optimizer_step(model, version)
            scheme.send()
        assert scheme.acked_versions == {0: 2, 1: 2}
        assert group.ask(1, "state")["policy"] == (2, checksum(model))
    finally:
        group.stop()
        scheme.shutdown()


@needs_stranger
def test_a_deep_hello_refuses_that_worker_by_name_within_the_bound():
    """Finding 5: worker 0's hello replaced by JSON 200,000 deep; the trainer names it, the worker is told."""
    _, scheme, port = _sender()
    attacker = start_stranger([*ATTACK, "hello", str(port)])
    worker = None
    try:
        lines, _, reader = _found_the_run(attacker)
        worker = _Worker(scheme)
        out = _output(attacker, lines, reader)
        assert "hello replaced" in out, out
        error, took = _timed_connect(scheme)
        assert isinstance(error, ws.WeightSyncError) and "hello/0" in str(error), error
        assert took <= CONNECT_TIMEOUT + SLACK_S, f"connect() took {took:.1f}s with connect_timeout={CONNECT_TIMEOUT}"
        got = worker.report()
        assert got[0] == "refused" and "hello/0" in got[2] and got[3], got
    finally:
        if worker is not None:
            worker.stop()
        scheme.shutdown()
        _end(attacker)


@needs_stranger
@pytest.mark.parametrize(
    ("attack", "seen"),
    [
        # Finding 5: a request to rejoin 200,000 deep is answered (refused: for its 400,000 bytes, before its depth).
        ("rejoin", ["answered: True", "holds 400000 bytes, over 65536"]),
        # The store's count of rejoins overwritten with words (its server drops any client that adds to one): the
        # trainer reads counts as data and puts the count back.
        ("counters", ["restored by the trainer: True"]),
    ],
)
def test_what_a_stranger_writes_for_rejoins_leaves_the_admitter_serving(attack, seen):
    """Whatever the stranger wrote, the trainer's rejoin thread lives on, and a real restarted worker rejoins."""
    model, scheme, port = _sender()
    first = _Worker(scheme)
    second = None
    try:
        scheme.connect()
        assert first.report()[0] == "connected"
        done = run_stranger([*ATTACK, attack, str(port)], timeout=60)
        assert all(line in done.stdout for line in seen), done.stdout
        admitter = scheme._sending._admitter
        assert admitter is not None and admitter._thread.is_alive()  # this scheme's own rejoin thread
        first.proc.kill()
        first.proc.join(10)
        second = _Worker(scheme)
        got = second.report()
        assert got[0] == "connected" and got[1] == 0, got
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in got[2].items())
    finally:
        first.stop()
        if second is not None:
            second.stop()
        scheme.shutdown()


@needs_stranger
@pytest.mark.parametrize(
    ("back_to", "put_back"), [(0, False), (1, False), (1, True)], ids=["first-start", "rejoin", "rejoin-put-back"]
)
def test_a_restarted_worker_whose_count_a_stranger_set_back_refuses_the_answer_an_earlier_process_got(
    back_to, put_back, monkeypatch
):
    """A restarted worker counts itself (``gen/<w>``, in the store) to know whether it starts the run or rejoins
    it, then reads the sender's sealed answer to that count. A stranger set the count back: the answer the worker
    found was one an earlier process of it got, still in the store and still sealed, and the worker went on to
    apply what it was sent next (with a rank 0 of the stranger's, an old version it knew the bytes of). Each
    answer now names the process it lets in, by its hello's nonce: the worker refuses the earlier one's. The
    trainer also puts a count set back where it finds it (each second): the next process then rejoins."""
    from weightsync.transports.distributed import rejoins

    if not put_back:  # (the worker counts itself before the trainer's next look)
        monkeypatch.setattr(rejoins, "REJOIN_SCAN_S", 3600.0)
    _, scheme, port = _sender()
    workers = [_Worker(scheme)]
    try:
        scheme.connect()
        assert workers[0].report()[0] == "connected"
        for _ in range(back_to):  # a rejoin first, as generation 2: its answer is the one found again
            workers[-1].proc.kill()
            workers[-1].proc.join(10)
            workers.append(_Worker(scheme))
            assert workers[-1].report()[:2] == ("connected", 0)
        workers[-1].proc.kill()
        workers[-1].proc.join(10)
        waits = [str(back_to + 1)] if put_back else []
        done = run_stranger([*ATTACK, "rollback", str(port), str(back_to), *waits], timeout=60)
        assert f"gen/0 set back to {back_to}" in done.stdout, done.stdout + done.stderr
        workers.append(_Worker(scheme))
        got = workers[-1].report()
        if put_back:
            assert "put back by the trainer: True" in done.stdout and got[:2] == ("connected", 0), (done.stdout, got)
            return
        assert got[0] == "refused" and got[1] == "AuthenticationError" and "replayed" in got[2], got
        assert got[3], "the worker's weights changed"
    finally:
        for worker in workers:
            worker.stop()
        scheme.shutdown()


def test_the_rejoin_thread_finds_requests_whatever_a_stranger_makes_of_the_count_of_rejoins(monkeypatch):
    """The count of rejoins only says that a request may wait. A stranger set it high and then back: each request
    counted up to that height went unread, for good (a review: both restarts of a killed worker timed out). Nor
    does a count held still hide one (looked for each second), and a worker's count set back is put back."""
    from datetime import timedelta

    import torch.distributed as dist

    from weightsync.core.timing import deadline_after, wait_until
    from weightsync.transports.distributed import rejoins

    monkeypatch.setattr(rejoins, "REJOIN_SCAN_S", 0.2)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    requests = rejoins.RejoinRequests("", ("127.0.0.1", store.port), 2, "policy")
    requests.store = store
    store.set("gen/0", "1")  # (as the rendez-vous left it; each worker joined as its first process)
    store.set("gen/1", "0")  # (set back: the next process of worker 1 would take itself for the first)
    store.set("rejoins", "99999999999999999")  # (the stranger's height)
    assert requests.next() is None and store.get("gen/1") == b"1"  # (put back)
    store.set("rejoins", "0")  # ... and back: a worker's request counts it 1, far below what was seen
    for key, value in {"gen/1": "2", "rejoin/1/2": "{}"}.items():
        store.set(key, value)
    store.add("rejoins", 1)
    assert requests.next() == (1, 2)
    assert requests.next() is None  # (looked again at once, for more: none)
    for key, value in {"gen/0": "2", "rejoin/0/2": "{}"}.items():  # a request whose count the stranger took back
        store.set(key, value)
    assert wait_until(lambda: requests.next() == (0, 2), deadline_after(10), 0.01)  # (the count never moved)
    store.set("gen/1", "0")  # set back below the generation read: put back, and a request counts on from it
    assert wait_until(lambda: requests.next() is None and store.get("gen/1") == b"2", deadline_after(10), 0.01)
    assert store.add("gen/1", 1) == 3


def test_a_worker_that_rejoins_twice_refuses_its_own_earlier_rejoins_answer_found_again():
    # (its hello's nonce was made once per process: a live worker dropped twice, whose count was set back after its
    # first rejoin, read that rejoin's answer again, which named its own nonce, and went on to the pair's old keys)
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from weightsync.core.timing import deadline_after, wait_until
    from weightsync.transports.distributed.auth import new_nonce
    from weightsync.transports.distributed.rejoins import RejoinRequests, ask_to_rejoin, read_hello

    base = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store, key, where = dist.PrefixStore("run", base), b"k" * 32, {"model_id": "policy", "worker_idx": 0}
    sealer = Sealer(key, "run")
    requests = RejoinRequests("run", ("127.0.0.1", base.port), 1, "policy")
    requests.store = store  # (the sender's rejoin thread, answering the request it reads)
    hello = {"ok": True, "process": None, "nonce": new_nonce()}  # (the process's, kept for its rejoins)
    store.set("gen/0", "1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ask_to_rejoin, store, key, sealer, 2, hello, time.monotonic() + 20, where)
        assert wait_until(lambda: store.check(["rejoin/0/2"]), deadline_after(10), 0.01)
        read, problem = read_hello(store, "rejoin/0/2", key, 0, 2)
        assert problem is None, problem
        requests.answer(0, 2, read, None, sealer)
        assert first.result(20) == (2, None)
    store.set("gen/0", "1")  # set back: the second rejoin counts itself 2 again, and finds the first one's answer
    with pytest.raises(ws.AuthenticationError, match="replayed"):
        ask_to_rejoin(store, key, sealer, int(store.add("gen/0", 1)), hello, time.monotonic() + 2, where)


@pytest.mark.parametrize("alg", MACS)
def test_an_update_mac_binds_the_bytes_the_version_the_nonce_and_the_layout(alg):
    """Each MAC a worker may be told to use (AES-GMAC, Poly1305, or HMAC-SHA256 where cryptography is missing)
    changes with any byte, the version, the nonce, the layout's order or the run key, and is the same however its
    bytes are fed."""
    key, buffer = b"k" * 32, torch.arange(4096, dtype=torch.uint8)
    sealer = Sealer(key, "weightsync/policy/0123456789abcdef")

    def mac(buf=buffer, version=3, nonce="aa", tag=b"layout", sealer=sealer) -> str:
        digest = sealer.payload_mac(tag, buf, version, nonce, alg)
        digest.ready(1000)  # fed in two steps, as buckets arrive
        return digest.hexdigest()

    flipped = buffer.clone()
    flipped[4000] ^= 1
    other_key = Sealer(b"K" * 32, sealer.prefix)
    same = mac()
    assert same == mac()
    assert len({same, mac(flipped), mac(version=4), mac(nonce="ab"), mac(tag=b"tuoyal"), mac(sealer=other_key)}) == 6
    assert sealer.payload_mac(b"layout", buffer, 3, "aa", alg).hexdigest() == same  # in one step


def test_a_sealed_value_is_refused_under_another_key_scope_or_version():
    sealer = Sealer(b"k" * 32, "weightsync/policy/0123456789abcdef")
    sealed = sealer.seal("digest/0/1", "abc", 1)
    assert sealer.open(sealed, "digest/0/1", 1) == b"abc"
    for opened in (
        lambda: sealer.open(sealed, "digest/1/1", 1),
        lambda: sealer.open(sealed, "digest/0/1", 2),
        lambda: sealer.scoped("pair/0/2/").open(sealed, "digest/0/1", 1),
        lambda: Sealer(b"K" * 32, sealer.prefix).open(sealed, "digest/0/1", 1),
        lambda: sealer.open(b"abc", "digest/0/1", 1),
    ):
        with pytest.raises(ws.AuthenticationError, match="is not sealed"):
            opened()


def test_an_ack_without_the_run_keys_tag_is_not_counted(monkeypatch):
    """Acks travel over the group, where a process that took a worker's rank could send them: each carries a tag
    made with the run key. Here the sender expects the tag of another key, as it would from such a process: the
    worker is named, never counted as holding the version."""
    real = Sealer.ack_tag

    def other_key(self, *words):
        return real(Sealer(b"\x01" * 32, self.prefix, self.scope), *words)

    _, scheme, _ = _sender()
    worker = _Worker(scheme)
    try:
        monkeypatch.setattr(Sealer, "ack_tag", other_key)
        with pytest.raises(ws.WeightSyncError, match="without the run key's tag") as caught:
            scheme.connect()
        assert caught.value.worker_idx == 0
        assert scheme.acked_versions.get(0) is None  # never counted as holding version 0
    finally:
        worker.stop()
        scheme.shutdown()


#: What the stranger runs: it takes a port of 127.0.0.1 and says which, then listens there (at once, or once told).
_TAKE_A_PORT = {
    "listening": "s = socket.create_server(('127.0.0.1', 0))",
    "mapped": "s = socket.socket(socket.AF_INET6); s.bind(('::ffff:127.0.0.1', 0)); s.listen()",
    "late": "s = socket.socket(); s.bind(('127.0.0.1', 0))",
}


@needs_stranger
@pytest.mark.parametrize(
    ("scheme", "how"),
    [("distributed", "listening"), ("rpc", "listening"), ("distributed", "mapped"), ("distributed", "late")],
)
def test_a_master_port_another_user_listens_on_is_refused_not_joined(scheme, how, monkeypatch):
    """A stranger who listens on the ``master_port`` a run is given first (before a store of the job's own is up)
    served the run's store: the trainer joined it as the job's, and the stranger saw every key and could hold
    the trainer's store calls (found by a review: ``connect()`` held 200 s past its bound). A port of this host
    served by another user is now refused by name, however it listens: on an IPv6 socket bound to the IPv4
    address (``mapped``), or only after the trainer found the port taken (``late``; both found by a review of
    the first form of this check, which read the table of listeners). A job's own store runs as the job's
    user, and is joined."""
    import subprocess

    from weightsync.transports import network

    listen = "" if how != "late" else "sys.stdin.readline(); s.listen(); "  # (once the trainer was refused)
    program = f"import socket, sys; {_TAKE_A_PORT[how]}; print(s.getsockname()[1], flush=True); {listen}"
    attacker = start_stranger(["-c", f"{program}sys.stdin.readline()"], stdin=subprocess.PIPE)  # (until killed)
    dial, refused = network.socket.create_connection, []

    def dialling(*args, **kwargs):  # (the trainer's first dial of the taken port, refused, tells the stranger)
        try:
            return dial(*args, **kwargs)
        except OSError:
            if not refused:
                refused.append(True)
                attacker.stdin.write("listen now\n")
                attacker.stdin.flush()
            raise

    monkeypatch.setattr(network.socket, "create_connection", dialling)
    try:
        line = attacker.stdout.readline()
        assert line.strip().isdigit(), line
        port = int(line)
        if scheme == "distributed":
            made = ws.DistributedWeightSyncScheme(master_port=port, timeout=3, connect_timeout=CONNECT_TIMEOUT)
        else:
            made = ws.RPCWeightSyncScheme(
                master_port=port, timeout=3, connect_timeout=CONNECT_TIMEOUT, allow_store_peers_to_run_code=True
            )
        with pytest.raises(ws.ConfigurationError, match=f"127.0.0.1:{port} is taken by a listener of another user"):
            made.init_on_sender(model=_model(0), num_workers=1)
        made.shutdown()
        assert refused == ([True] if how == "late" else [])
    finally:
        _end(attacker)


@needs_stranger
def test_a_master_addr_that_names_ipv6_loopback_first_is_served_and_dialled_at_one_address(tmp_path):
    """``master_addr="localhost"`` where ``localhost`` gives ``::1`` first, then ``127.0.0.1`` (many hosts' files),
    and a stranger listens on the run's port of ``::1`` alone. The trainer bound 127.0.0.1 (a socket's bind takes
    a name's IPv4 address), found nothing taken, and torch's own client of its store, and every worker, dialled the
    name: the stranger's socket first (a review: the stranger served the whole run's store and saw every key; a
    silent one held ``init_on_sender`` for minutes). The store is now served and dialled at the one address the
    trainer bound, and a receiver config names that address; a worker whose config names the host dials its IPv4
    address. The run goes on, and the stranger is never dialled."""
    import subprocess
    import sys

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here ({exc})")
    hosts = tmp_path / "hosts"
    hosts.write_text("::1 localhost\n127.0.0.1 localhost\n")
    hosts.chmod(0o644)
    listen = (  # (it says so if anything dials it, and nothing else)
        "import socket\n"
        "s = socket.socket(socket.AF_INET6)\n"
        "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n"
        "s.bind(('::1', 0))\n"
        "s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "s.settimeout(120)\n"
        "try:\n"
        "    s.accept()\n"
        "    print('dialled', flush=True)\n"
        "except OSError:\n"
        "    pass\n"
    )
    attacker = start_stranger(["-c", listen])  # (until killed)
    try:
        line = attacker.stdout.readline()
        assert line.strip().isdigit(), line
        port = int(line)
        mounted = f'mount --make-rprivate / && mount --bind {hosts} /etc/hosts && exec "$@"'
        run = subprocess.run(
            ["unshare", "-m", "sh", "-c", mounted, "sh", sys.executable, "-m", "tests._localhost_v6", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0 and run.stdout.splitlines() == ["served at 127.0.0.1", "ok"], run.stdout + run.stderr
    finally:
        _end(attacker)
    assert attacker.stdout.read() == ""  # (never dialled: it says so once something does)


@needs_stranger
def test_a_job_store_is_joined_though_a_stranger_listens_on_its_port_at_another_address():
    """The job's store serves 127.0.0.1 alone; a stranger listens on the same port of ``::`` only (``IPV6_V6ONLY``,
    which shares no address with it). The trainer reaches the job's store there, and joins it: a table of
    listeners by port had counted the stranger's and refused the run (found by a review)."""
    import subprocess
    import sys

    serve = (
        "from weightsync.transports.store import open_store\n"
        "store, (_, port), _ = open_store('127.0.0.1', 0, 60)\n"
        "store.set('job-key', 'x')\n"
        "print(port, flush=True)\n"
        "import sys; sys.stdin.readline()\n"
    )
    job = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    attacker = None
    try:
        port = int(job.stdout.readline())  # type: ignore[union-attr]
        v6only = (
            "import socket, sys; s = socket.socket(socket.AF_INET6); "
            "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); "
            f"s.bind(('::', {port})); s.listen(); print('listening', flush=True); sys.stdin.readline()"
        )
        attacker = start_stranger(["-c", v6only], stdin=subprocess.PIPE)  # (listening until killed)
        assert attacker.stdout.readline().strip() == "listening"
        made = ws.DistributedWeightSyncScheme(master_port=port, timeout=3, connect_timeout=CONNECT_TIMEOUT)
        try:
            made.init_on_sender(model=_model(0), num_workers=1)
            assert made._sending.engine._base_store.check(["job-key"])  # (the job's store, joined)
        finally:
            made.shutdown()
    finally:
        if attacker is not None:
            _end(attacker)
        job.kill()
        job.wait(10)
