"""Fault injection on real worker processes: kill, hang, close, restart and rejoin, under both failure policies.

Every scheme that supports the fault runs it: the local ones (multiprocess, shared memory, per-worker shared
memory) and torch.distributed (gloo) for kills, hangs, restarts and rejoins; closed channels on the local ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch

import weightsync as ws
from tests import _bodies as bodies
from tests._bodies import optimizer_step, start
from tests._workers import build, checksum, serve
from tests.conftest import SCHEMES
from weightsync.errors import by_worker

LOCAL = ["multiprocess", "shared_mem", "shared_mem-per_worker"]
#: distributed sending only what changed (``delta=True``: changes even where every value changed, as each
#: optimizer_step here changes them): every fault below holds for changes as for whole versions.
DELTA = "distributed-delta"
REJOINING = [*LOCAL, "distributed-gloo", DELTA]
TIMEOUT = 2.0  # the schemes' ack timeout in these tests: a hung worker costs this much


def _scheme(name: str, **kw) -> ws.WeightSyncScheme:
    if name == DELTA:
        return SCHEMES["distributed-gloo"](delta=True, **kw)
    return SCHEMES[name](**kw)


def _connected(name, workers, n=2, timeout=None, kind="tiny", **kw):
    model = build(kind)
    scheme = _scheme(name, **kw)
    if timeout is not None:  # before the workers get the scheme: theirs too
        scheme.timeout = timeout
    scheme.init_on_sender(model_id="policy", model=model, num_workers=n)
    group, ready = start(workers, {"policy": scheme}, {"policy": kind}, n=n)
    assert all(errors == {} for _, _, errors in ready)
    return model, scheme, group


def _kill(group, i):
    os.kill(group.procs[i].pid, signal.SIGKILL)
    group.procs[i].join(10)


def _rejoin(workers, scheme, w, kind="tiny"):
    """A new process for worker ``w``, from the same pickled scheme; returns its group and ready message."""
    group = workers(serve, 1, lambda i, conn: ({"policy": scheme}, w, {"policy": kind}, conn))
    return group, group.recv(0)


@pytest.mark.parametrize("name", REJOINING)
@pytest.mark.parametrize("when", ["before", "during"])
def test_drop_policy_goes_on_without_a_killed_worker_and_names_it(workers, caplog, name, when):
    with caplog.at_level(logging.WARNING, logger="weightsync.schemes"):
        bodies.dropped_worker_is_named_and_the_others_go_on(
            _scheme(name, on_failure="drop"), workers, when, then_all=True
        )
    said = [r.getMessage() for r in caplog.records]
    assert any("dropped worker 1 at version 1" in m and "'policy'" in m for m in said)
    # The last worker's drop is said once more: every send from then on reaches no one.
    assert [m for m in said if "every worker is dropped" in m] == [
        "model 'policy': every worker is dropped: sends reach none until one rejoins"
    ]


@pytest.mark.parametrize("name", REJOINING)
def test_worker_killed_after_a_send_is_found_by_the_next_one(workers, name):
    model, scheme, group = _connected(name, workers)
    optimizer_step(model, 1)
    scheme.send()
    _kill(group, 0)
    optimizer_step(model, 2)
    with pytest.raises(ws.WorkerDiedError) as info:
        scheme.send()
    assert (info.value.worker_idx, info.value.version) == (0, 2)
    assert group.ask(1, "state")["policy"] == (2, checksum(model))
    # Every later send names it too, by that send's version, each with an error of its own: the one error raised
    # again named version 2 at every send, and its traceback grew by each send's frames (and kept them).
    named = []
    for version in (3, 4):
        optimizer_step(model, version)
        with pytest.raises(ws.WorkerDiedError) as later:
            scheme.send()
        named.append(later.value)
        assert (later.value.worker_idx, later.value.version) == (0, version)
        assert f"version {version}] since version 2: " in str(later.value), str(later.value)
    assert named[0] is not named[1] and not {id(e) for e in named} & {id(info.value)}
    assert len(traceback.extract_tb(named[1].__traceback__)) == len(traceback.extract_tb(named[0].__traceback__))
    with pytest.raises(ws.WorkerDiedError, match=r"version 4\] since version 2: ") as waited:
        scheme.wait_async()
    assert waited.value is not named[1]
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("checksum_on", [False, True])
def test_a_gloo_peer_found_gone_as_its_ack_is_posted_is_named_dead(workers, monkeypatch, checksum_on):
    """gloo may notice a dead peer between the last part sent and the ack's receive posted (under load it
    did, and the raw RuntimeError escaped send()): that worker is named dead like any other, the others served."""
    # The worker named dead may be left sending its ack, which the trainer never receives, until its timeout
    # (then it rejoins): TIMEOUT, not the tests' 20 s, before it reads the test's next command.
    model, scheme, group = _connected("distributed-gloo", workers, timeout=TIMEOUT, checksum=checksum_on)
    transport = scheme._sending.engine.transports[0]

    def gone(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:55191.")

    monkeypatch.setattr(transport, "set_digest" if checksum_on else "expect_ack", gone)
    if checksum_on:  # the digest set after the bytes, as for a version larger than this test's
        from weightsync.transports.distributed import sender

        monkeypatch.setattr(sender, "INLINE_DIGEST_BYTES", -1)
    optimizer_step(model, 1)
    with pytest.raises(ws.WorkerDiedError, match="its rank 1 went away") as info:
        scheme.send()
    assert (info.value.worker_idx, info.value.version) == (0, 1)
    assert group.ask(1, "state")["policy"] == (1, checksum(model))
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", REJOINING)
@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_hung_worker_costs_one_timeout_then_is_raised_or_dropped(workers, name, policy):
    bodies.hung_worker_costs_one_timeout(_scheme(name, on_failure=policy), workers, TIMEOUT)


@pytest.mark.parametrize("name", REJOINING)
def test_a_late_worker_is_passed_by_until_it_acks_and_starves_no_other(workers, name):
    bodies.a_late_worker_is_passed_by_until_it_acks(_scheme(name), workers, TIMEOUT)


@pytest.mark.parametrize("name", REJOINING)
def test_two_workers_stopped_at_different_versions_hold_up_no_send(workers, name):
    """Worker 1 stops before version 1, worker 2 after it acked version 1: each is late on another version, and the
    versions on their way to them held both of ``distributed``'s two staging buffers. Each send that passes them by
    sets aside what they hold: worker 0 gets every version at once, and once both run again, the next send reaches
    all three (before, each send from the third on waited its whole timeout for a buffer; found by a review)."""
    model, scheme, group = _connected(name, workers, n=3, timeout=TIMEOUT, kind="flat2_8mb")
    try:
        os.kill(group.procs[1].pid, signal.SIGSTOP)
        for version in range(1, 6):
            if version == 2:
                os.kill(group.procs[2].pid, signal.SIGSTOP)
            optimizer_step(model, version)
            began = time.monotonic()
            with pytest.raises(ws.WeightSyncError) as info:
                scheme.send()
            named = sorted(by_worker(info.value))
            assert named == ([1] if version == 1 else [1, 2]), info.value
            assert version < 3 or time.monotonic() - began < TIMEOUT, (version, time.monotonic() - began)
            assert group.ask(0, "state")["policy"] == (version, checksum(model))
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
        os.kill(group.procs[2].pid, signal.SIGCONT)
    scheme.wait_async(timeout=30)
    optimizer_step(model, 6)
    scheme.send()
    assert [group.ask(w, "state")["policy"] for w in range(3)] == [(6, checksum(model))] * 3
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("policy", ["raise", "drop"])
@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed-gloo"])
def test_sends_that_do_not_wait_go_on_past_a_stopped_worker_that_holds_up_their_staging(workers, name, policy):
    bodies.sends_that_do_not_wait_go_on_past_a_stopped_worker(_scheme(name, on_failure=policy), workers)


@pytest.mark.parametrize("name", LOCAL)
def test_a_worker_dropped_alive_hears_it_was_dropped(workers, name):
    bodies.a_worker_dropped_alive_hears_it_was_dropped(_scheme(name, on_failure="drop"), workers)


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_closed_channel_is_named_or_dropped(workers, name, policy):
    model, scheme, group = _connected(name, workers, on_failure=policy)
    assert group.ask(1, "close_channel", "policy") == "closed"
    optimizer_step(model, 1)
    if policy == "raise":
        with pytest.raises(ws.WorkerDiedError) as info:
            scheme.send()
        assert info.value.worker_idx == 1
    else:
        scheme.send()
        assert list(scheme.stats()["dropped_workers"]) == [1]
    assert group.ask(0, "state")["policy"] == (1, checksum(model))
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize(
    "name", [*REJOINING, "multiprocess+checksum", "distributed-gloo+checksum", f"{DELTA}+checksum"]
)
def test_restarted_worker_rejoins_and_gets_the_current_version(workers, name):
    name, _, checked = name.partition("+")
    model, scheme, group = _connected(name, workers, on_failure="drop", **({"checksum": True} if checked else {}))
    for step in (1, 2):
        optimizer_step(model, step)
        scheme.send()
    expected = checksum(model)
    _kill(group, 1)
    optimizer_step(model, 3)
    scheme.send()  # worker 1 is dropped here; worker 0 holds version 3
    latest = checksum(model)
    optimizer_step(model, 4)  # trainer moves on without sending: the rejoiner must get version 3, not this
    again, (_, log, errors) = _rejoin(workers, scheme, 1)
    assert errors == {} and log == [("policy", 3, latest)] and latest != expected
    assert scheme.stats()["rejoins"] == {1: 1} and scheme.stats()["dropped_workers"] == {}
    scheme.send()  # version 4 reaches both
    assert group.ask(0, "state")["policy"] == (4, checksum(model))
    assert again.ask(0, "state")["policy"] == (4, checksum(model))
    assert scheme.acked_versions == {0: 4, 1: 4}
    again.stop()
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", REJOINING)
def test_a_version_sent_to_no_worker_is_the_one_a_rejoining_worker_gets(workers, name):
    """``worker_ids=[]`` publishes the version for workers that rejoin (docs/guide.md): the local schemes staged
    nothing then, and a restarted worker was handed the version before it, bytes and number (a user's audit)."""
    model, scheme, group = _connected(name, workers, on_failure="drop")
    optimizer_step(model, 1)
    scheme.send(worker_ids=[])
    latest = checksum(model)
    _kill(group, 1)
    optimizer_step(model, 2)  # not sent: the rejoiner gets version 1
    again, (_, log, errors) = _rejoin(workers, scheme, 1)
    assert errors == {} and log == [("policy", 1, latest)], (errors, log)
    again.stop()
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", LOCAL)
def test_a_version_a_ctrl_c_cut_off_before_any_worker_was_told_is_never_handed_to_a_rejoin(workers, name):
    """A Ctrl-C once a version was written into its slot, before it was submitted: its number is not spent, and a
    worker that rejoined was handed those bytes under it; the next send then gave other weights that number
    (found by a review's sweep of interrupts). Now the rejoin gets the version before, where a slot still holds
    it, or is told to join again after the next send; every version a worker holds is the trainer's."""
    from weightsync.transports.local.slots import SlotPool

    model, scheme, group = _connected(name, workers, on_failure="drop")
    sent = {0: checksum(model)}
    optimizer_step(model, 1)
    scheme.send()
    sent[1] = checksum(model)
    optimizer_step(model, 2)
    with bodies.sigint_at_first_call(SlotPool, "publish", after=True) as hits, pytest.raises(KeyboardInterrupt):
        scheme.send()
    assert hits == ["publish"]
    _kill(group, 1)
    again, (_, log, errors) = _rejoin(workers, scheme, 1)
    if errors:  # (the send's copy took the slot that held version 1: nothing to hand over until the next send)
        assert "join again after its next send" in errors["policy"], errors
        again.stop()
    else:
        assert log == [("policy", 1, sent[1])], log
    optimizer_step(model, 3)
    scheme.send()
    sent[scheme.version] = checksum(model)
    if errors:
        again, (_, log, errors) = _rejoin(workers, scheme, 1)
        assert errors == {} and log == [("policy", scheme.version, sent[scheme.version])], (log, errors)
    for worker in (group.ask(0, "log"), again.ask(0, "log")):
        assert all(sent[version] == digest for _, version, digest in worker), (worker, sent)
    again.stop()
    group.stop()
    scheme.shutdown()


def test_a_dropped_distributed_worker_that_lives_rejoins_by_itself(workers):
    """gloo: a worker dropped for an ack it never sent (here it hung; across hosts, its link went down) reads
    that it was dropped once it runs again, asks to rejoin, and holds the newest version; the next send reaches
    it as before."""
    model, scheme, group = _connected("distributed-gloo", workers, on_failure="drop")
    scheme.timeout = TIMEOUT
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        optimizer_step(model, 1)
        scheme.send()  # worker 1 is dropped after TIMEOUT
        assert list(scheme.stats()["dropped_workers"]) == [1]
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while scheme.stats()["rejoins"] != {1: 1}:
        assert time.monotonic() < deadline, scheme.stats()
        time.sleep(0.05)
    assert group.ask(1, "state")["policy"] == (1, checksum(model))
    assert scheme.stats()["dropped_workers"] == {}
    optimizer_step(model, 2)
    scheme.send()
    assert scheme.acked_versions == {0: 2, 1: 2}
    assert [group.ask(i, "state")["policy"] for i in (0, 1)] == [(2, checksum(model))] * 2
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed-gloo"])
def test_a_live_worker_index_cannot_be_taken_and_a_stranger_is_refused(workers, name):
    model, scheme, group = _connected(name, workers)
    intruder, (_, log, errors) = _rejoin(workers, scheme, 1)
    assert log == [] and "worker 1 is already connected" in errors["policy"]
    intruder.stop()
    if name != "distributed-gloo":  # a TCP store has no key to forge: its address is what gives access
        forged = ws.MultiProcessWeightSyncScheme(timeout=5, connect_timeout=5)
        forged.init_on_receiver(
            model_id="policy",
            model=build("tiny"),
            worker_idx=1,
            address=scheme.receiver_config(1)["connection"]["address"],
            authkey=b"\0" * 32,
        )
        with pytest.raises(ws.AuthenticationError):
            forged.connect()
        forged.shutdown()
    optimizer_step(model, 1)
    scheme.send()  # both real workers are still served
    assert [group.ask(w, "state")["policy"][0] for w in (0, 1)] == [1, 1]
    assert scheme.stats()["rejoins"] == {}
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed-gloo", DELTA])
def test_200_sends_with_random_restarts_lose_and_repeat_no_version(workers, name):
    rng = random.Random(6)
    model, scheme, group = _connected(name, workers, n=3, on_failure="drop")
    groups = {w: (group, w) for w in range(3)}  # worker -> (its group, its index in that group)
    expected = {0: checksum(model)}
    lives = []  # (worker, the versions that process applied) for every process that ran
    restarts = 0

    def retire(w):
        g, i = groups[w]
        lives.append((w, [(v, d) for _, v, d in g.ask(i, "log")]))

    for w in range(3):
        g, i = groups[w]
        lives.append((w, [(0, expected[0])]))
    for step in range(1, 201):
        if step % 10 == 0:
            w = rng.randrange(3)
            retire(w)
            _kill(*groups[w])
            if rng.random() < 0.5:  # sometimes a send happens while it is gone
                optimizer_step(model, step * 1000)
                scheme.send()
                expected[scheme.version] = checksum(model)
            again, (_, log, errors) = _rejoin(workers, scheme, w)
            assert errors == {}, errors
            groups[w] = (again, 0)
            lives.append((w, [(v, d) for _, v, d in log]))
            restarts += 1
        optimizer_step(model, step)
        scheme.send()
        expected[scheme.version] = checksum(model)
    for w in range(3):
        retire(w)
    if name == DELTA:  # changes, but to a worker that had not acked the base (gone, or just back): whole
        assert scheme.stats()["changes_sent"] > 450
    final = scheme.version
    by_worker = {}
    for w, applied in lives:
        versions = [v for v, _ in applied]
        assert versions == sorted(set(versions)), f"worker {w} repeated or reordered a version: {versions}"
        assert all(expected[v] == d for v, d in applied), f"worker {w} applied wrong bytes"
        by_worker.setdefault(w, []).append(versions)
    for w, runs in by_worker.items():
        # Each process applied every version from the one it joined at to the last it saw: none lost.
        for versions in runs:
            assert versions == list(range(versions[0], versions[0] + len(versions))), f"worker {w} lost a version"
        assert runs[-1][-1] == final
    assert restarts == 20 and scheme.stats()["rejoins"] and sum(scheme.stats()["rejoins"].values()) == 20
    for g, _ in {id(g): (g, i) for g, i in groups.values()}.values():
        g.stop()
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed-gloo"])
def test_staleness_bound_is_enforced_and_reported(workers, name):
    model, scheme, group = _connected(name, workers, sync=False, max_staleness=1)
    scheme.timeout = TIMEOUT
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    resumed = threading.Timer(0.8, os.kill, (group.procs[1].pid, signal.SIGCONT))
    try:
        optimizer_step(model, 1)
        scheme.send_async()  # worker 1 now lags by one version: allowed
        resumed.start()
        optimizer_step(model, 2)
        began = time.monotonic()
        scheme.send_async()  # it would lag by two: the send waits until it caught up
        assert time.monotonic() - began >= 0.5
        assert scheme.acked_versions[1] >= 1
        stats = scheme.stats()
        assert stats["staleness_waits"] == 1 and stats["max_lag_seen"] == 1
        assert scheme.last_send.staleness_wait >= 0.5
        scheme.wait_async()
        os.kill(group.procs[1].pid, signal.SIGSTOP)
        for step in (3, 4):
            optimizer_step(model, step)
            if step == 3:
                scheme.send_async()
            else:
                with pytest.raises(ws.SyncTimeoutError, match="lags more than max_staleness=1") as info:
                    scheme.send_async()
                assert (info.value.worker_idx, info.value.version) == (1, 4)
    finally:
        resumed.cancel()
        os.kill(group.procs[1].pid, signal.SIGCONT)
    group.stop()
    scheme.shutdown()


def test_a_staleness_bound_counts_a_workers_failure_as_its_answer_only_with_nothing_more_on_its_way():
    """In the bound's wait, a worker's failure of the last version sent to it is its answer: not late, the failure
    kept for the send (which publishes, then reports it). A failure of an older version, with a later one on its
    way, is not: that one could still bring the worker within the bound (counted as an answer, the bound published
    a version 3 past ``max_staleness=2``, found by a review)."""
    from weightsync.core.ledger import Ledger, Peer

    ledger = Ledger("policy", peers={0: Peer(sent=2, acked=1), 1: Peer(sent=2, acked=0)})
    failed = {
        w: ws.ReceiverError("RuntimeError", "no", model_id="policy", worker_idx=w, version=v)
        for w, v in [(0, 2), (1, 1)]
    }
    ledger.answered(failed)
    assert list(ledger.keep_answers(failed)) == [1]  # (still a failure: the bound raises it, as before)
    assert list(ledger.errors) == [0] and ledger.peers[0].sent == 1  # (reported by the send; nothing on its way)


def test_a_worker_is_late_while_the_version_it_timed_out_on_may_still_be_acked():
    """A worker is passed by (late) from the wait that timed out on a version until it acks that version, or a
    later one; or until no ack of it can come: the worker answered it with a failure, or the engine's own call for
    it timed out (an RPC's; passed by for good, such a worker was never sent a version again). A failure of an
    older version does not end it, and a new process under its index is not late."""
    from weightsync.core.ledger import Ledger, Peer

    ledger = Ledger("policy", peers={w: Peer(sent=1, acked=0) for w in range(4)})
    assert ledger.late([0, 1, 2, 3]) == {}
    ledger.timeouts([0, 1, 2, 3], {w: 1 for w in range(4)}, "2s")
    late = ledger.late([0, 1, 2, 3], version=5)
    assert sorted(late) == [0, 1, 2, 3] and all(isinstance(e, ws.SyncTimeoutError) for e in late.values())
    assert (late[2].worker_idx, late[2].version, late[2].model_id) == (2, 5, "policy")
    assert "passed by: still no ack for version 1, which timed out (last acked: 0)" in str(late[2])
    ledger.ack(0, 1)
    ledger.failed(1, ws.ReceiverError("RuntimeError", "no", model_id="policy", worker_idx=1, version=1))
    ledger.failed(2, ws.SyncTimeoutError("its call timed out", model_id="policy", worker_idx=2, version=1))
    ledger.failed(3, ws.ReceiverError("RuntimeError", "an older one", model_id="policy", worker_idx=3, version=0))
    assert list(ledger.late([0, 1, 2, 3])) == [3]
    ledger.renew(3, sent=4)
    assert ledger.late([3]) == {}


def test_a_time_out_found_outside_a_wait_is_news_until_the_worker_acks_its_version():
    """An engine's own time-out of a version (a vLLM engine's calls that did not return), found outside any wait,
    is reported by the next call that targets the worker, unless the worker acked that version since: a
    ``send_async`` raised it after the ack had come."""
    from weightsync.core.ledger import Ledger, Peer

    ledger = Ledger("policy", peers={w: Peer(sent=1, acked=0) for w in range(3)})
    for w in range(3):
        ledger.failed(w, ws.SyncTimeoutError("its calls did not return", model_id="policy", worker_idx=w, version=1))
    ledger.ack(1, 1)
    ledger.ack(2, 0)
    assert sorted(ledger.take_errors([0, 1, 2])) == [0, 2]


@pytest.mark.parametrize("on_failure", ["raise", "drop"])
def test_a_staleness_bound_waits_for_no_ack_that_is_not_coming(workers, on_failure):
    """A worker that refused the last version sent to it, or that the sends between skipped, has nothing on its
    way to it: the bound does not wait for an ack of a version it will never hold (it waited until its timeout,
    then raised, or dropped a healthy worker)."""
    model, scheme, group = _connected("multiprocess", workers, sync=False, max_staleness=1, on_failure=on_failure)
    scheme.timeout = 3.0
    try:
        optimizer_step(model, 1)
        scheme.send_async()
        scheme.wait_async()
        optimizer_step(model, 2)
        scheme.send_async(worker_ids=0)  # worker 1 is skipped: it holds 1, and nothing is on its way to it
        scheme.wait_async()
        optimizer_step(model, 3)
        began = time.monotonic()
        scheme.send_async()  # worker 1 lags by two, but no ack of version 2 is coming from it
        assert time.monotonic() - began < 2.0 and scheme.last_send.staleness_wait < 2.0
        scheme.wait_async()
        assert scheme.acked_versions == {0: 3, 1: 3}

        assert group.ask(1, "break_model", "policy") == "broken"
        optimizer_step(model, 4)
        scheme.send_async()
        with pytest.raises(ws.ReceiverError, match="worker 1") as info:
            scheme.wait_async()
        assert info.value.version == 4
        optimizer_step(model, 5)
        began = time.monotonic()
        scheme.send_async()  # worker 1 refused 4: it holds 3, lags by two, and no ack of 4 is coming
        assert time.monotonic() - began < 2.0 and scheme.last_send.staleness_wait < 2.0
        # The bound itself finds worker 1's refusal of 5 (no wait_async between): the send publishes 6 to every
        # worker, then raises it, as a send without a bound does (it published nothing: worker 0 went without 6).
        optimizer_step(model, 6)
        with pytest.raises(ws.ReceiverError, match="worker 1") as info:
            scheme.send_async()
        assert info.value.version == 5 and scheme.version == 6
        with pytest.raises(ws.ReceiverError, match="worker 1") as info:
            scheme.wait_async()
        assert info.value.version == 6
        assert scheme.acked_versions == {0: 6, 1: 3} and scheme.stats()["dropped_workers"] == {}
        assert group.ask(0, "state")["policy"] == (6, checksum(model))
        optimizer_step(model, 7)
        began = time.monotonic()
        scheme.send_async()  # the next bound waits for no ack of 6
        assert time.monotonic() - began < 2.0 and scheme.last_send.staleness_wait < 2.0
    finally:
        group.stop()
        scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "distributed-gloo", DELTA])
def test_send_metrics_name_the_version_bytes_and_every_ack(workers, name):
    model, scheme, group = _connected(name, workers)
    for step in (1, 2, 3):
        optimizer_step(model, step)
        scheme.send()
    record = scheme.last_send
    assert record.version == 3 and record.workers == [0, 1] and record.nbytes == scheme.layout.nbytes
    assert set(record.acks) == {0, 1} and all(0 < s <= record.seconds for s in record.acks.values())
    stats = scheme.stats()
    if name == DELTA:  # each version as what changed (every value, each the same size): the bytes counted
        assert stats["changes_sent"] == 6 and set(record.changes) == {0, 1}
        assert stats["bytes_sent"] == 3 * 2 * record.changes[0]
    else:
        assert stats["bytes_sent"] == 3 * 2 * scheme.layout.nbytes
    assert stats["sends"] == 3 and stats["send_seconds"]["median"] > 0 and stats["acked_versions"] == {0: 3, 1: 3}
    assert stats["lag"] == {0: 0, 1: 0} and stats["worker_failures"] == 0
    group.stop()
    scheme.shutdown()


def test_policy_and_staleness_settings_are_checked():
    with pytest.raises(ws.ConfigurationError, match="on_failure must be 'raise' or 'drop'"):
        ws.MultiProcessWeightSyncScheme(on_failure="ignore")
    for bad in (-1, 0):  # (0 waited for an ack of the version not yet published, until the timeout)
        with pytest.raises(ws.ConfigurationError, match="max_staleness must be a positive int"):
            ws.DistributedWeightSyncScheme(max_staleness=bad)


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")


@pytest.mark.parametrize(
    ("name", "device"),
    [
        *((name, "") for name in ("multiprocess", "shared_mem", "distributed", "rpc")),
        *(pytest.param(name, "cuda:0", marks=_GPU) for name in ("multiprocess", "shared_mem")),
    ],
)
def test_workers_exit_cleanly_when_the_trainer_is_killed(ctx, tmp_path, name, device):
    import json

    import psutil

    from tests._workers import doomed_trainer

    reports = [str(tmp_path / f"worker{w}.json") for w in range(2)]
    parent, child = ctx.Pipe()
    # not a daemon: it has children
    trainer = ctx.Process(target=doomed_trainer, args=(name, 2, reports, child, device))
    trainer.start()
    try:
        assert parent.poll(60), "the trainer did not start its workers"
        said = parent.recv()
        assert said[0] != "crashed", f"the trainer failed:\n{said[1]}"
        pids, key_file = said  # the local schemes' auth key file; distributed has none
        assert key_file is None or os.path.exists(key_file)
        workers = [psutil.Process(pid) for pid in pids]
        killed = time.time()
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers still running after the trainer died: {[p.pid for p in alive]}"
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join(5)
        for pid in locals().get("pids", []):
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    for report in reports:
        with open(report) as f:
            seen = json.load(f)
        assert seen["versions"] == [0, 1, 2]
        assert seen["noticed"] - killed < 5.0  # the scheme's timeout
        assert seen["leftovers"] == {"threads": [], "memfds": 0, "maps": 0}
    assert key_file is None or not os.path.exists(key_file), "the auth key file outlived the sender and its workers"


@pytest.mark.parametrize(("name", "line"), [("distributed", True), ("distributed", False), ("rpc", True)])
def test_a_worker_of_a_stopped_trainer_is_never_held_past_its_receive_and_goes_on_when_it_resumes(
    ctx, tmp_path, name, line
):
    """A trainer stopped (a debugger, ``SIGSTOP``) keeps its connections, and the kernel acknowledges what its
    workers send it: a worker that asks it anything waits for an answer that does not come. Each of the worker's
    ``receive(timeout=0.05)`` still returns in time, and the worker takes the next version once the trainer
    resumes. (A ``distributed`` worker without a line, as a rejoined one, looks for its announcements in the
    store.)"""
    import json

    import psutil

    from tests._workers import doomed_trainer

    report = str(tmp_path / "worker0.json")
    parent, child = ctx.Pipe()
    trainer = ctx.Process(target=doomed_trainer, args=(name, 1, [report], child, "", line))
    trainer.start()
    try:
        assert parent.poll(60), "the trainer did not start its worker"
        said = parent.recv()
        assert said[0] != "crashed", f"the trainer failed:\n{said[1]}"
        worker = psutil.Process(said[0][0])
        os.kill(trainer.pid, signal.SIGSTOP)
        time.sleep(3.0)  # six of the rpc worker's probes of its sender
        os.kill(trainer.pid, signal.SIGCONT)
        parent.send("send")
        trainer.join(60)
        assert trainer.exitcode == 0
        psutil.wait_procs([worker], timeout=20)
    finally:
        if trainer.is_alive():
            os.kill(trainer.pid, signal.SIGCONT)
            trainer.kill()
            trainer.join(5)
        for pid in locals().get("said", [[]])[0]:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    with open(report) as f:
        seen = json.load(f)
    assert seen["versions"] == [0, 1, 2, 3]
    assert seen["longest"] < 1.0, f"a receive(timeout=0.05) took {seen['longest']:.1f}s"
    assert seen["leftovers"] == {"threads": [], "memfds": 0, "maps": 0}


@pytest.mark.parametrize("name", LOCAL)
def test_a_killed_worker_whose_child_holds_its_channel_is_named_dead_at_once(ctx, name):
    """A worker's child forked after it connected (an environment started with ``fork``) holds its end of the
    channel: its death closes nothing, and the trainer sees it exit by its process (a pidfd), not at a timeout."""
    from tests._workers import forks_then_serves

    scheme = _scheme(name)
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=forks_then_serves, args=(scheme.receiver_config(0), child), daemon=True)
    worker.start()
    forked = None
    try:
        scheme.connect()
        assert parent.poll(30)
        forked = parent.recv()
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        optimizer_step(model, 1)
        began = time.monotonic()
        with pytest.raises(ws.WorkerDiedError, match=f"its process {worker.pid} exited"):
            scheme.send()
        assert time.monotonic() - began < TIMEOUT / 2
    finally:
        if forked is not None:
            os.kill(forked, signal.SIGKILL)
        worker.kill()
        scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_worker_sees_its_trainer_killed_while_a_child_of_the_trainer_holds_the_channel(ctx, name):
    """The trainer's child forked after connect (a helper started with ``fork``) holds the trainer's end of each
    channel: its workers see the trainer's process exit (a pidfd), within the scheme's timeout."""
    from tests._workers import trainer_that_forks
    from weightsync.config import from_config

    parent, child = ctx.Pipe()
    trainer = ctx.Process(target=trainer_that_forks, args=(name, child))
    trainer.start()
    helper = None
    try:
        assert parent.poll(60)
        scheme = from_config(parent.recv())
        scheme.init_on_receiver(model=build("tiny"))
        scheme.connect()
        assert parent.poll(30)
        helper = parent.recv()
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(10)
        killed = time.monotonic()
        with pytest.raises(ws.ConnectionClosedError, match="exited"):
            while time.monotonic() - killed < 3 * TIMEOUT + 1:
                scheme.receive(timeout=0.1)
        assert time.monotonic() - killed < TIMEOUT + 1
        scheme.shutdown()
    finally:
        if helper is not None:
            os.kill(helper, signal.SIGKILL)
        if trainer.is_alive():
            trainer.kill()
            trainer.join(5)


def test_truncated_shared_segment_is_refused_not_mapped(workers):
    # Mapping past the end of a segment would kill the worker (SIGBUS): it must refuse the slot instead.
    from unittest import mock

    from weightsync.transports.local.mp import MPTransport

    model, scheme, group = _connected("shared_mem", workers)
    real_notify = MPTransport.notify

    def announce_more_than_there_is(self, slot, version, *rest):
        if slot.id in self.slots_sent:
            return real_notify(self, slot, version, *rest)
        slot.nbytes *= 2
        try:
            return real_notify(self, slot, version, *rest)
        finally:
            slot.nbytes //= 2

    held = checksum(model)
    optimizer_step(model, 1)
    with mock.patch.object(MPTransport, "notify", announce_more_than_there_is):
        with pytest.raises(ws.SendFailedError) as info:
            scheme.send()
    for error in info.value.failures.values():
        assert error.remote_type == "IntegrityError" and "truncated" in error.remote_message
    assert [group.ask(w, "state")["policy"] for w in (0, 1)] == [(0, held)] * 2
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_slot_the_worker_could_not_map_refuses_its_version_by_name_and_is_mapped_when_named_again(monkeypatch, name):
    """A worker out of memory (or of mappings) when a slot is shared refuses the version in it, naming why, and
    nothing escapes its receive but that refusal; it keeps the slot's descriptor and maps it when the next update
    names the slot. (Before, an ``OSError`` escaped receive(), and every later update in the slot was refused.)"""
    import errno

    from tests._workers import in_process_receiver
    from weightsync.transports.local import mp

    model = build("tiny")
    scheme = SCHEMES[name](sync=False)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, build("tiny"))
    out_of_memory = [True]

    def failing(real):
        def map_or_fail(fd: int, nbytes: int) -> torch.Tensor:
            if out_of_memory[0]:
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return real(fd, nbytes)

        return map_or_fail

    monkeypatch.setattr(mp, "map_fd_read_only", failing(mp.map_fd_read_only))
    monkeypatch.setattr(mp, "map_fd", failing(mp.map_fd))
    try:
        for step in (1, 2):  # the second in a slot shared now (the first slot is busy), which the worker cannot map
            optimizer_step(model, step)
            scheme.send()
        with pytest.raises(ws.TransportError, match=r"slot \d+ \(\d+ bytes\) could not be mapped here: .*memory"):
            receiver.receive(timeout=10)
        with pytest.raises(ws.ReceiverError, match="could not be mapped here") as info:
            scheme.wait_async(timeout=10)
        assert info.value.remote_type == "TransportError"
        assert receiver.version == 0
        out_of_memory[0] = False
        for step in range(3, 9, 2):  # two at once again: the second in the slot that failed
            for version in (step, step + 1):
                optimizer_step(model, version)
                scheme.send()
            assert receiver.receive(timeout=10) is not None
            scheme.wait_async(timeout=10)
            assert (receiver.version, checksum(receiver.model)) == (step + 1, checksum(model))
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "distributed-gloo"])
def test_non_finite_weights_are_refused_in_the_caller_when_checked(workers, name):
    import torch

    model, scheme, group = _connected(name, workers, check_finite=True)
    held = checksum(model)
    for bad in (float("nan"), float("inf")):
        with torch.no_grad():
            model.body[0].weight[0, 0] = bad
        with pytest.raises(ws.InvalidWeightsError, match=r"NaN or Inf in \['body.0.weight'\].*nothing was sent"):
            scheme.send()
        assert scheme.version == 0 and scheme.stats()["sends"] == 0
    assert [group.ask(w, "state")["policy"] for w in (0, 1)] == [(0, held)] * 2
    with torch.no_grad():
        model.body[0].weight[0, 0] = 0.5
    scheme.send()
    assert [group.ask(w, "state")["policy"][0] for w in (0, 1)] == [1, 1]
    group.stop()
    scheme.shutdown()


def test_a_killed_senders_key_file_is_swept_but_not_another_namespaces():
    from weightsync.transports.keyfiles import key_dir, remove_key_file, write_key_file
    from weightsync.transports.processes import pid_namespace

    directory = key_dir()
    dead = os.path.join(directory, f"weightsync-999999999-{'ab' * 8}.{pid_namespace()}.key")
    foreign = os.path.join(directory, f"weightsync-999999999-{'cd' * 8}.1.key")  # a PID from another namespace
    for path in (dead, foreign):
        with open(path, "w") as f:
            f.write("00")
    mine = write_key_file(f"@weightsync-{os.getpid()}-{'ef' * 8}", b"\1" * 32)
    try:
        assert not os.path.exists(dead) and os.path.exists(foreign) and os.path.exists(mine)
    finally:
        for path in (foreign, mine):
            remove_key_file(path)


def test_a_worker_removes_its_killed_senders_key_file_and_waits_no_grace_for_a_file_it_cannot_judge():
    """A worker whose sender went away removes the sender's key file once that process exited; a file of another
    PID namespace (a copy from the sender's host, or a container's) is left at once, without the grace a local
    sender's exit may need (it was a second of every such worker's shutdown: the two-host tests)."""
    from weightsync.transports.keyfiles import key_dir, remove_key_file, remove_key_file_if_orphaned
    from weightsync.transports.processes import pid_namespace

    directory = key_dir()
    mine = secrets.token_hex(8)  # (names of this test's own: the sweep's test, beside it, writes such files too)
    dead = os.path.join(directory, f"weightsync-999999999-{mine}.{pid_namespace()}.key")
    foreign = os.path.join(directory, f"weightsync-999999999-{mine}.1.key")
    for path in (dead, foreign):
        with open(path, "w") as f:
            f.write("00")
    try:
        remove_key_file_if_orphaned(dead, grace=60.0)
        assert not os.path.exists(dead)
        started = time.monotonic()
        remove_key_file_if_orphaned(foreign, grace=60.0)
        assert os.path.exists(foreign) and time.monotonic() - started < 30.0  # (the grace was not waited for)
    finally:
        for path in (dead, foreign):
            remove_key_file(path)


def _key_file_writer(address: str, then: str) -> subprocess.Popen:
    """A process that writes the key file of a sender listening at ``address``, says so, then ``then``: ``"die"``
    (SIGKILL: no shutdown removes the file) or ``"wait"`` (until its stdin closes)."""
    code = (
        "import os, signal, sys\n"
        "from weightsync.transports.keyfiles import write_key_file\n"
        f"print(write_key_file({address!r}, b'\\1' * 32), flush=True)\n"
        f"os.kill(os.getpid(), signal.SIGKILL) if {then!r} == 'die' else sys.stdin.read()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_fixed_address_is_taken_again_after_its_sender_was_killed_and_refused_while_one_holds_it():
    """A key file is named after its address alone when the address is fixed: the file a SIGKILLed sender left is
    replaced by the next sender at that address (it failed with FileExistsError), and the file of a live one (the
    same address in another network namespace) is named, and kept."""
    from weightsync.transports.keyfiles import read_key_file, remove_key_file, write_key_file

    address = f"@weightsync-test-fixed-{os.getpid()}"
    killed = _key_file_writer(address, "die")
    left = killed.stdout.readline().strip()
    assert killed.wait(30) == -signal.SIGKILL and os.path.exists(left)
    mine = write_key_file(address, b"\2" * 32)
    try:
        assert mine == left and read_key_file(mine) == "02" * 32
    finally:
        remove_key_file(mine)
    live, held = _key_file_writer(address, "wait"), ""
    try:
        held = live.stdout.readline().strip()
        with pytest.raises(ws.ConfigurationError, match=rf"{re.escape(held)} is held by a running process"):
            write_key_file(address, b"\2" * 32)
        assert read_key_file(held) == "01" * 32
    finally:
        live.communicate(timeout=30)
        remove_key_file(held)


@pytest.mark.parametrize("when", ["dial", "after"])
@pytest.mark.parametrize("name", ["distributed", "rpc"])
def test_a_worker_joining_a_stopped_trainer_gives_up_within_its_connect_timeout(ctx, name, when):
    """A trainer stopped (a debugger, ``SIGSTOP``) while a worker joins: its store's connections are taken by the
    kernel and never answered. The worker's ``connect()`` fails with ``SyncTimeoutError`` within its
    ``connect_timeout`` (3 s) and a little more, whether the trainer stopped before the worker dialled its store
    (torch's client waits for the store's first answer with no bound) or just after."""
    from tests._workers import idle_trainer, joins_a_stopped_trainer

    parent, child = ctx.Pipe()
    trainer = ctx.Process(target=idle_trainer, args=(name, child))
    trainer.start()
    heard, told = ctx.Pipe(duplex=False)
    worker = None
    try:
        assert parent.poll(60), "the trainer did not hand over a config"
        cfg = parent.recv()
        worker = ctx.Process(target=joins_a_stopped_trainer, args=(name, cfg, trainer.pid, when, told))
        worker.start()
        assert heard.poll(30), "the worker's connect() was still waiting after 30 s"
        error, took = heard.recv()
        assert error == "SyncTimeoutError" and took < 6.0, (error, took)
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
        trainer.kill()
        trainer.join(5)
        if worker is not None:
            worker.kill()
            worker.join(5)


@pytest.mark.parametrize("line", ["its last word on it", "cut off"])
def test_a_dropped_worker_whose_trainer_then_stops_waits_it_out_and_rejoins_with_the_newest_version(ctx, line):
    """The trainer drops a worker that does not read: it closes the worker's line, with its last word on it (one
    version unread), or without (versions piled up on the line until its writes gave up). Then the trainer stops
    (a debugger, ``SIGSTOP``) for longer than its ``timeout``. The worker, reading again, finds its line ended
    (the sender's word that it dropped it; or the end, between two messages or in the middle of one's bytes, as
    the timing falls: the latter alone has its own test, in ``test_distributed_line.py``) and the store silent
    (asked to rejoin, or whether it was dropped): each ``receive`` returns within its bound with nothing worse
    than a ``SyncTimeoutError`` (a sender stopped: its loop retries), never a sender gone
    (``ConnectionClosedError``, which ends a worker's loop). Once the trainer resumes, the worker learns it was
    dropped, rejoins, holds the newest version, and takes the next one."""
    from tests._workers import ask, commanded_trainer, worker_of

    timeout, said = 1.0, line.startswith("its")
    kind = "tiny" if said else "flat4"  # (flat4: 1 MB, sent on the line; several fill it)
    cmd, child = ctx.Pipe()
    trainer = ctx.Process(target=commanded_trainer, args=(child, kind), kwargs={"timeout": timeout, "sync": said})
    trainer.start()
    worker = None

    try:
        replica = build(kind)
        worker = worker_of(cmd, replica)
        newest, dropped, *_ = ask(cmd, "drop")  # not read: the worker is dropped, its line closed
        assert dropped == [0]
        os.kill(trainer.pid, signal.SIGSTOP)
        # Stopped 2.5 x timeout, and as long as the receive still out then takes (a rejoin: up to 4 x timeout).
        errors, longest, ended = [], 0.0, time.monotonic() + 2.5 * timeout
        try:
            while time.monotonic() < ended:
                began = time.monotonic()
                try:
                    worker.receive(timeout=0.05)
                except ws.WeightSyncError as exc:
                    errors.append(exc)
                longest = max(longest, time.monotonic() - began)
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
        # (versions read whole before the line's end are applied first: the stop may show only as receives that
        # return nothing)
        assert all(isinstance(e, ws.SyncTimeoutError) for e in errors), errors
        # (a store call in an update: ``timeout``; a rejoin, its own bound of 4 x ``timeout``; each + 0.25 s)
        assert longest < 4 * timeout + 2.0, f"a receive(timeout=0.05) took {longest:.1f}s"
        deadline = time.monotonic() + 30
        while ask(cmd, "look")[1::3] != ([], {0: 1}):  # it learns it was dropped, and is taken back
            assert time.monotonic() < deadline, f"the worker was not taken back (it holds version {worker.version})"
            with contextlib.suppress(ws.SyncTimeoutError):
                worker.receive(timeout=0.5)

        def take_the_next() -> None:  # (the newest version as its initial weights, if it did not take it yet)
            ends = time.monotonic() + 30
            while worker.version != newest + 1 and time.monotonic() < ends:
                worker.receive(timeout=1.0)

        receiving = threading.Thread(target=take_the_next, daemon=True)
        receiving.start()
        version, dropped, acked, digest, _ = ask(cmd, "send")  # the next version reaches it as before
        receiving.join(30)
        assert (version, dropped, acked) == (newest + 1, [], {0: newest + 1})
        assert worker.version == newest + 1 and checksum(replica) == digest
    finally:
        if trainer.is_alive():
            os.kill(trainer.pid, signal.SIGCONT)
            with contextlib.suppress(OSError):
                cmd.send("stop")
            trainer.join(30)
            if trainer.is_alive():
                trainer.kill()
                trainer.join(5)
        if worker is not None:
            worker.shutdown()


def test_a_wait_that_times_out_names_its_own_timeout_not_the_schemes():
    """``wait_async(timeout=...)`` says it waited that long, and ``connect()`` its ``connect_timeout`` (both said
    the scheme's ``timeout``)."""
    import pickle

    from tests._workers import in_process_receiver
    from weightsync.tensors.strategy import flatten_weights

    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=0.5, connect_timeout=2)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = pickle.loads(pickle.dumps(scheme))
    spec = {k: (tuple(v.shape), v.dtype) for k, v in flatten_weights(model, scheme.strategy_str).items()}
    loading = threading.Event()  # (it joins, and its load of version 0 does not return in time)
    receiver.init_on_receiver(model_id="policy", model=ws.ExternalModel(spec, lambda _: loading.wait(20)), worker_idx=0)

    def join() -> None:
        with contextlib.suppress(ws.WeightSyncError):  # (the trainer gave up on it)
            receiver.connect()

    joining = threading.Thread(target=join)
    try:
        joining.start()
        with pytest.raises(ws.SyncTimeoutError, match=r"version 0 within 2s"):
            scheme.connect()
    finally:
        loading.set()
        scheme.shutdown()
        joining.join(20)
        receiver.shutdown()

    scheme = ws.MultiProcessWeightSyncScheme(sync=False, timeout=30)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, build("tiny"))  # (connected, then never takes the next version)
    try:
        optimizer_step(model, 1)
        scheme.send()
        with pytest.raises(ws.SyncTimeoutError, match=r"no ack for version 1 within 0\.04s"):
            scheme.wait_async(timeout=0.04)  # (shown as "0.0s" once)
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_an_engines_own_time_out_of_a_version_a_wait_reported_is_not_reported_again():
    # An RPC's own time-out equals the send's: it could land just after send() raised SyncTimeoutError for that
    # version, and the next send_async() raised it again (having published its version all the same).
    from weightsync.core.ledger import Ledger, Peer

    ledger = Ledger("policy", peers={0: Peer(sent=1, acked=0)})
    assert list(ledger.timeouts([0], {0: 1}, "3s")) == [0]  # the wait's report

    def found(error: ws.WeightSyncError) -> dict:
        ledger.errors[0] = error
        return ledger.take_errors([0])

    assert found(ws.SyncTimeoutError("no ack for version 1 within 3s", worker_idx=0, version=1)) == {}
    assert found(ws.SyncTimeoutError("no ack for version 0", worker_idx=0, version=0)) == {}
    for later in (
        ws.SyncTimeoutError("no ack for version 2 within 3s", worker_idx=0, version=2),
        ws.ReceiverError("ValueError", "bad", worker_idx=0, version=1),  # (not a time-out: reported)
    ):
        assert found(later) == {0: later}
    ledger.renew(0, 3)  # a new process of the worker: its time-outs are its own
    again = ws.SyncTimeoutError("no ack for version 1 within 3s", worker_idx=0, version=1)
    assert found(again) == {0: again}


def test_shared_mem_slots_all_held_with_no_ack_to_come_are_said_at_once_by_name(workers):
    # Each shared_mem worker's model is the memory of the slot of the version it holds: sends to worker 0 alone left
    # worker 1 on the other slot of two, and every later send waited its whole timeout for an ack that was not
    # coming, then blamed workers [0, 1] alike. A worker that is late with its ack is named at once, passed by, and
    # the slot only it holds leaves the pool: the other worker is sent the version.
    model, scheme, group = _connected("shared_mem", workers, max_slots=2, timeout=TIMEOUT)
    optimizer_step(model, 1)
    scheme.send(worker_ids=[0])
    optimizer_step(model, 2)
    began = time.monotonic()
    with pytest.raises(ws.ConfigurationError, match=r"no free weight slot: workers \[0, 1\] hold .*max_slots=2"):
        scheme.send(worker_ids=[0])
    assert time.monotonic() - began < TIMEOUT / 2
    group.stop()
    scheme.shutdown()
    model, scheme, group = _connected("shared_mem", workers, max_slots=2, timeout=TIMEOUT)
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        optimizer_step(model, 1)
        with pytest.raises(ws.SyncTimeoutError):
            scheme.send()  # worker 1 holds version 0's slot, and acks nothing
        optimizer_step(model, 2)  # (worker 1 is late now: passed by, the slot only it holds leaves the pool)
        with pytest.raises(ws.SyncTimeoutError, match=r"worker 1, version 2\] passed by: still no ack for version 1"):
            scheme.send()
        assert group.ask(0, "state")["policy"] == (2, checksum(model))
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_worker_restarted_during_the_rendezvous_takes_its_place(name):
    # Worker 1 said hello, then died while the trainer still waited for worker 0; its restart (from its receiver
    # config) was refused as "already connected", and connect() ended naming worker 1. (Where worker 0 comes before
    # the restart, the rendez-vous ends without it: connect() names worker 1, whose restart then rejoins.)
    from concurrent.futures import ThreadPoolExecutor

    from tests._workers import serve
    from tests.conftest import _CTX
    from weightsync.core.timing import deadline_after, wait_until

    model = build("tiny")
    scheme = _scheme(name)
    scheme.timeout = TIMEOUT
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    started = []

    def worker(i: int):
        ours, theirs = _CTX.Pipe()
        schemes = {"policy": ws.from_config(scheme.receiver_config(i))}
        proc = _CTX.Process(target=serve, args=(schemes, i, {"policy": "tiny"}, theirs), daemon=True)
        proc.start()
        started.append((proc, ours))
        return proc, ours

    with ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(scheme.connect)
        try:
            first, _ = worker(1)
            engine = scheme._runtime.sending.engine
            assert wait_until(lambda: 1 in engine.transports, deadline_after(60), 0.01), "worker 1 never said hello"
            first.kill()
            first.join(30)
            restarted, again = worker(1)
            said_hello = lambda: getattr(engine.transports[1].process, "pid", None) == restarted.pid  # noqa: E731
            assert wait_until(said_hello, deadline_after(60), 0.01), "the restarted worker 1 was not taken"
            _, other = worker(0)  # (worker 0 last: the rendez-vous ends with it, the restart in place)
            connecting.result(90)
            for cmd in (again, other):
                assert cmd.poll(60)
                said, log, errors = cmd.recv()
                assert said == "ready" and errors == {} and log[0][1] == 0, (said, log, errors)
            optimizer_step(model, 1)
            scheme.send()
            assert scheme.acked_versions == {0: 1, 1: 1}
        finally:
            for proc, cmd in started:
                if proc.is_alive():
                    with contextlib.suppress(OSError):
                        cmd.send(("stop",))
                    proc.join(30)
                if proc.is_alive():
                    proc.kill()
            scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_worker_whose_connect_timed_out_in_the_rendezvous_takes_its_place_when_it_tries_again(name):
    # Worker 0's connect() gave up while the trainer still waited for worker 1; its channel, closed, was counted as
    # connected until its process exited, and the retry was refused as "already connected".
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.core.timing import deadline_after, wait_until

    model = build("tiny")
    scheme = _scheme(name)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    receivers = [ws.from_config(scheme.receiver_config(i)) for i in (0, 1)]
    for i, receiver in enumerate(receivers):
        receiver.init_on_receiver(model_id="policy", model=build("tiny"), worker_idx=i)
    engine = scheme._runtime.sending.engine
    with ThreadPoolExecutor(3) as pool:
        connecting = pool.submit(scheme.connect)
        try:
            receivers[0].connect_timeout = 4.0
            with pytest.raises(ws.SyncTimeoutError, match="no initial weights"):
                receivers[0].connect(worker_idx=0)  # (worker 1 is not there: no version 0 yet)
            first = engine.transports[0]
            receivers[0].connect_timeout = 60.0
            again = pool.submit(receivers[0].connect, worker_idx=0)
            assert wait_until(lambda: engine.transports.get(0) is not first, deadline_after(60), 0.01), again
            receivers[1].connect(worker_idx=1)
            again.result(60)
            connecting.result(60)
            optimizer_step(model, 1)
            scheme.send_async()
            assert all(receiver.receive(timeout=60) is not None for receiver in receivers)
            scheme.wait_async()
            assert scheme.acked_versions == {0: 1, 1: 1}
            assert [checksum(receiver.model) for receiver in receivers] == [checksum(model)] * 2
        finally:
            for receiver in receivers:
                receiver.shutdown()
            scheme.shutdown()
