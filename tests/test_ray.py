"""RayWeightSyncScheme on a real local Ray cluster (started by this module, shut down at its end)."""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch

import weightsync as ws
from tests._bodies import optimizer_step, rounded, send_past_hung_worker_1, wire_nbytes, within_its_timeout
from tests._workers import _scramble, build, checksum
from tests.conftest import kill_actor
from weightsync.core.timing import deadline_after, wait_until

ray = pytest.importorskip("ray", reason="Ray is an optional engine; `pip install -e .[test]` installs it")


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    from tests.conftest import local_ray_cluster

    with local_ray_cluster(namespace="weightsync-tests"):
        yield


#: Each pair of a strategy, a way of handing the scheme to an actor, and ``delta`` (every pair, not every triple:
#: each case starts actors, which costs seconds).
PAIRS = [
    pytest.param("state_dict", "pickled", False, id="state_dict-pickled"),
    pytest.param("state_dict", "receiver_config", True, id="state_dict-receiver_config-delta"),
    pytest.param("tensordict", "pickled", True, id="tensordict-pickled-delta"),
    pytest.param("tensordict", "receiver_config", False, id="tensordict-receiver_config"),
]


def _collectors(n=2, kinds=None):
    from tests._ray_actors import Collector

    return [Collector.remote(kind) for kind in (kinds or ["tiny"] * n)]


def _joined(scheme, model, n=2, kinds=None):
    """Collectors that joined ``scheme`` (handed to them before init), registered with the sender."""
    actors = _collectors(n, kinds)
    ray.get([a.join.remote(scheme, i) for i, a in enumerate(actors)])
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    return actors


@pytest.mark.parametrize(("strategy", "handed_as", "delta"), PAIRS)
def test_every_send_reaches_every_targeted_actor(strategy, handed_as, delta):
    model = build("tiny")
    # (handed as plain data, the actors also track the pages written: the Hydra road, and the trainer too)
    track = delta and handed_as == "receiver_config"
    scheme = ws.RayWeightSyncScheme(strategy=strategy, timeout=30, delta=delta, track_writes=track)
    actors = _collectors()
    if handed_as == "pickled":  # the collector pattern: the scheme goes to the actor before init
        ray.get([a.join.remote(scheme, i) for i, a in enumerate(actors)])
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    if handed_as == "receiver_config":  # the Hydra pattern: plain data, instantiated in the actor
        ray.get([a.join.remote(scheme.receiver_config(i), i) for i, a in enumerate(actors)])
    scheme.connect()
    expected = {0: checksum(model, strategy)}
    assert ray.get([a.state.remote() for a in actors]) == [(0, expected[0])] * 2
    assert ray.get([a.receive.remote() for a in actors]) == [0, 0]

    held = {0: 0, 1: 0}
    for step, worker_ids in enumerate([None, None, [1], 0, None], start=1):
        optimizer_step(model, step)
        expected[step] = checksum(model, strategy)
        scheme.send(worker_ids=worker_ids)
        for w in [0, 1] if worker_ids is None else ([worker_ids] if isinstance(worker_ids, int) else worker_ids):
            held[w] = step
        assert scheme.acked_versions == held
        assert ray.get([a.state.remote() for a in actors]) == [(held[w], expected[held[w]]) for w in range(2)]
    # As changes: each send to an actor that acked the version before (worker 0 missed version 3, worker 1 version 4)
    assert scheme.stats()["changes_sent"] == (2 + 2 + 1 + 0 + 1 if delta else 0)
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


def test_async_sends_arrive_in_order_and_are_awaited():
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(sync=False, timeout=30)
    actors = _joined(scheme, model)
    scheme.connect()
    for step in range(1, 6):
        optimizer_step(model, step)
        scheme.send()  # sync=False: returns once submitted
    scheme.wait_async()
    assert scheme.acked_versions == {0: 5, 1: 5}
    assert ray.get([a.state.remote() for a in actors]) == [(5, checksum(model, "tensordict"))] * 2
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("latest_wins", [True, False])
def test_async_sends_to_a_busy_actor_coalesce_to_the_newest_unless_every_version_is_wanted(latest_wins):
    """An actor busy while the trainer sends asynchronously: with ``latest_wins`` (the default) the versions sent
    meanwhile wait in the trainer, each replacing the last, and the actor gets the first and then the newest,
    not every version in turn, nor an object in the store for each (before: 20 sends, 21 objects, 336 MiB, each
    applied); without it, every version in turn."""
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=30, sync=False, latest_wins=latest_wins)
    (actor,) = _joined(scheme, model, n=1)
    scheme.connect()
    ray.get(actor.record_updates.remote())
    actor.busy.remote(3.0)
    for step in range(1, 9):
        optimizer_step(model, step)
        scheme.send_async()
    # The newest goes as soon as the call before it ended, not at the trainer's next send or wait.
    wanted = (8, checksum(model, "tensordict"))
    assert wait_until(lambda: ray.get(actor.state.remote()) == wanted, deadline_after(20), 0.1)
    scheme.wait_async()
    assert scheme.acked_versions == {0: 8}
    assert ray.get(actor.state.remote()) == (8, checksum(model, "tensordict"))
    assert ray.get(actor.updates.remote()) == ([1, 8] if latest_wins else list(range(1, 9)))
    scheme.shutdown()


def test_a_version_held_back_behind_a_busy_actors_call_is_waited_for_when_ray_reports_that_calls_end_late(
    monkeypatch,
):
    """``latest_wins``: a version sent while the actor's call for the one before runs waits in the trainer until
    Ray reports that call's end, on a thread of its own, which then sends it. Where the trainer read the call as
    ended first, it found nothing on its way and slept until the send's deadline (10 s here: an actor that had
    applied the version would have been dropped under ``on_failure="drop"``); it now looks again until it goes."""
    from weightsync.transports.ray.transport import RayTransport

    ended = RayTransport._ended

    def reported_late(self, call):  # (Ray's thread, later than the trainer reads the call as ended)
        time.sleep(0.3)
        ended(self, call)

    monkeypatch.setattr(RayTransport, "_ended", reported_late)
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=10)
    (actor,) = _joined(scheme, model, n=1)
    try:
        scheme.connect()
        for step in (1, 3):
            actor.busy.remote(0.5)
            optimizer_step(model, step)
            scheme.send_async()  # runs after the busy call
            optimizer_step(model, step + 1)
            began = time.monotonic()
            scheme.send()  # held back behind it
            assert time.monotonic() - began < 5.0
        assert ray.get(actor.state.remote()) == (4, checksum(model, "tensordict"))
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_async_failure_is_reported_at_wait_async():
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(sync=False, timeout=30)
    actors = _joined(scheme, model)
    scheme.connect()
    ray.get(actors[1].break_model.remote())
    errors = []
    for step in (1, 2):
        optimizer_step(model, step)
        try:
            scheme.send()  # returns once submitted; an earlier send's failure may be reported here
        except ws.ReceiverError as exc:
            errors.append(exc)
    try:
        scheme.wait_async()
    except ws.ReceiverError as exc:
        errors.append(exc)
    assert errors, "the actor's failures were never reported"
    assert all(e.worker_idx == 1 and e.remote_type == "WeightMismatchError" for e in errors)
    assert ray.get(actors[0].state.remote()) == (2, checksum(model, "tensordict"))
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


def test_wire_dtype_halves_the_bytes_and_actors_hold_the_rounded_weights():
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=30, wire_dtype="bfloat16")
    actors = _collectors()
    ray.get([a.join.remote(scheme, i) for i, a in enumerate(actors)])
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    assert scheme.layout.weights_nbytes == wire_nbytes(scheme.strategy.flat(model), torch.bfloat16)
    scheme.connect()
    optimizer_step(model, 1)
    scheme.send()
    expected = checksum(rounded(model, torch.bfloat16), "tensordict")
    assert expected != checksum(model, "tensordict")
    assert ray.get([a.state.remote() for a in actors]) == [(1, expected)] * 2
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


def test_one_object_per_send_whatever_the_number_of_actors(monkeypatch):
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=30)
    actors = _joined(scheme, model, n=3)
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    scheme.connect()
    scheme.send()
    assert len(puts) == 2  # one for connect's version 0, one for the send
    layout = scheme.layout
    for ranges, arrays, digest in puts:  # one object holding every tensor's bytes once (plus alignment padding)
        assert sorted(i for first, last in ranges for i in range(first, last)) == list(range(len(layout.slots)))
        assert layout.weights_nbytes <= sum(a.nbytes for a in arrays) <= layout.nbytes
        assert digest is None  # checksum is off by default
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("kind", ["bound", "keep_storage", "shared_model", "wire_dtype"])
def test_actor_model_bound_once_then_updated_whole(kind):
    """A CPU actor binds its model to one private storage laid out like the payload at the first update; each
    later update is one copy per buffer into it (no tensor-by-tensor write), the memory staying put. A tensor
    the user moved is bound anew. keep_storage, a model in shared memory and a wire_dtype are written into
    tensor by tensor, the model never moved."""
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(
        timeout=30, keep_storage=kind == "keep_storage", wire_dtype="bfloat16" if kind == "wire_dtype" else None
    )
    (actor,) = _joined(scheme, model, n=1, kinds=["tiny_shared" if kind == "shared_model" else "tiny"])
    _, before, params = ray.get(actor.placement.remote())
    ray.get(actor.count_writes.remote())
    scheme.connect()
    layout = scheme.layout
    offsets = {s.key: s.offset for s in layout.slots}

    def send_and_check(step: int) -> dict:
        optimizer_step(model, step)
        scheme.send()
        expected = rounded(model, torch.bfloat16) if kind == "wire_dtype" else model
        assert ray.get(actor.state.remote()) == (step + 1, checksum(expected, "tensordict"))
        relative, addresses, now = ray.get(actor.placement.remote())
        assert now == params  # the same Parameter objects
        if kind == "bound":
            assert relative == offsets  # every tensor in its place in one storage
        else:
            assert addresses == before  # never moved
        return addresses

    first = send_and_check(0)
    assert all(send_and_check(step) == first for step in (1, 2, 3))  # the memory stays put
    bound = kind == "bound"
    assert ray.get(actor.written.remote()) == {"tensor_by_tensor": 0 if bound else 5, "bind": int(bound)}
    if bound:
        assert first != before
        ray.get(actor.move_tensor.remote())
        send_and_check(4)
        send_and_check(5)
        assert ray.get(actor.written.remote()) == {"tensor_by_tensor": 0, "bind": 2}  # bound anew, once
    scheme.shutdown()
    ray.kill(actor)


def test_flatten_sender_puts_the_trainer_buffer_as_it_is(monkeypatch):
    """flatten_sender moves the trainer's tensors into one buffer in the payload layout, values and Parameter
    objects kept; each send puts that buffer in the store as it is (nothing packed). A trainer tensor moved
    since is bound anew at the next send; weights passed explicitly are packed as usual."""
    from weightsync.tensors.layout import FlatLayout

    model = build("tiny")
    params = dict(model.named_parameters())
    before = checksum(model, "tensordict")
    scheme = ws.RayWeightSyncScheme(timeout=30, flatten_sender=True)
    actors = _joined(scheme, model, n=2)
    layout = scheme.layout
    flat = scheme.strategy.flat(model)
    base = flat[layout.slots[0].key].data_ptr()
    assert {s.key: flat[s.key].data_ptr() - base for s in layout.slots} == {s.key: s.offset for s in layout.slots}
    assert dict(model.named_parameters()) == params and checksum(model, "tensordict") == before
    packs, puts = [], []
    real_pieces, real_put = FlatLayout.pieces, ray.put
    monkeypatch.setattr(FlatLayout, "pieces", lambda *a, **kw: packs.append(1) or real_pieces(*a, **kw))
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value[0]) or real_put(value, **kw))
    scheme.connect()

    def send(step: int, weights=None) -> None:
        if weights is None:
            optimizer_step(model, step)
        scheme.send(weights)
        expected = checksum(model if weights is None else weights, "tensordict")
        assert ray.get([a.state.remote() for a in actors]) == [(step, expected)] * 2

    for step in (1, 2):
        send(step)
    model.body[0].weight.data = torch.ones_like(model.body[0].weight)  # the trainer moves a tensor off the buffer
    send(3)
    send(4)
    assert packs == [] and puts == [[(0, len(layout.slots))]] * 5  # every send: the one buffer, as it is
    send(5, {k: v + 1 for k, v in scheme.strategy.flat(model).items()})
    assert packs == [1]  # explicit weights: packed
    assert dict(model.named_parameters()) == params
    scheme.shutdown()
    for a in actors:
        ray.kill(a)
    with pytest.raises(ws.ConfigurationError, match="flatten_sender .* cannot be combined with wire_dtype='bfloat16'"):
        ws.RayWeightSyncScheme(flatten_sender=True, wire_dtype="bfloat16")


def test_killed_actor_is_named_and_the_others_are_updated():
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20)
    actors = _joined(scheme, model)
    scheme.connect()
    kill_actor(actors[1], no_restart=True)  # (its process ended: the next send cannot reach it)
    optimizer_step(model, 1)
    start = time.monotonic()
    with pytest.raises(ws.WorkerDiedError) as info:
        scheme.send()
    assert time.monotonic() - start < 20
    assert (info.value.worker_idx, info.value.model_id, info.value.version) == (1, "policy", 1)
    assert ray.get(actors[0].state.remote()) == (1, checksum(model, "tensordict"))
    with pytest.raises(ws.WorkerDiedError):
        scheme.send()  # named again; the live actor is still served
    assert ray.get(actors[0].state.remote())[0] == 2
    scheme.send(worker_ids=[0])
    assert not scheme.sender_transports[1].check_connection()
    with pytest.raises(ws.ConfigurationError, match="workers 0 and 1 were given the same actor"):
        scheme.rejoin(1, actors[0])  # (nothing sent: worker 0 still holds version 3 alone)
    assert scheme.acked_versions[0] == 3 and ray.get(actors[0].state.remote())[0] == 3
    scheme.shutdown()
    ray.kill(actors[0])


def test_an_actor_that_missed_the_connects_timeout_is_late_and_served_once_it_applied_version_0():
    # A slow actor (busy, or still starting) is not gone: the call of version 0 is on its way to it
    import os
    import signal

    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, connect_timeout=3)  # (latest_wins: late actors get one more)
    actors = _joined(scheme, model)
    pid = ray.get(actors[1].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(ws.SyncTimeoutError, match="no ack for version 0 within 3s") as info:
            scheme.connect()
        assert info.value.worker_idx == 1 and scheme.initialized_on_sender
        scheme.timeout = 2.0
        optimizer_step(model, 1)
        # Version 1 waits behind its call (held back), and the trainer once for it; then it is passed by
        with pytest.raises(ws.SyncTimeoutError, match="no ack for version 1 within 2s") as info:
            scheme.send()
        assert info.value.worker_idx == 1 and ray.get(actors[0].state.remote())[0] == 1
        optimizer_step(model, 2)
        with pytest.raises(ws.SyncTimeoutError, match="passed by: still no ack for version 1") as info:
            scheme.send()
        assert info.value.worker_idx == 1 and ray.get(actors[0].state.remote())[0] == 2
        os.kill(pid, signal.SIGCONT)
        assert ray.get(actors[1].state.remote(), timeout=30)[0] >= 0  # (after its version 0)
        scheme.wait_async()  # (the version held back goes once version 0's call ended)
        optimizer_step(model, 3)
        scheme.send()
        assert [ray.get(a.state.remote()) for a in actors] == [(3, checksum(model, "tensordict"))] * 2
        assert scheme.stats()["failed_workers"] == {}
    finally:
        os.kill(pid, signal.SIGCONT)
        scheme.shutdown()
        for a in actors:
            ray.kill(a)


def test_drop_policy_goes_on_without_a_killed_actor():
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, on_failure="drop")
    actors = _joined(scheme, model)
    scheme.connect()
    kill_actor(actors[1], no_restart=True)  # (its process ended: the next send cannot reach it)
    for step in (1, 2):
        optimizer_step(model, step)
        scheme.send()  # dropped at the first, skipped at the second
        assert ray.get(actors[0].state.remote()) == (step, checksum(model, "tensordict"))
    assert list(scheme.stats()["dropped_workers"]) == [1] and scheme.acked_versions[0] == 2
    scheme.shutdown()
    ray.kill(actors[0])


@pytest.mark.parametrize(
    "policy,latest_wins", [("raise", False), ("raise", True), ("drop", True)], ids=["raise", "raise-latest", "drop"]
)
def test_a_hung_actor_costs_a_timeout_or_two_then_is_passed_by_or_dropped(policy, latest_wins, caplog):
    import logging
    import os
    import signal

    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, on_failure=policy, latest_wins=latest_wins)
    actors = _joined(scheme, model)
    scheme.connect()
    scheme.timeout = 2.0
    pid = ray.get(actors[1].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync"):
            send_past_hung_worker_1(scheme, model, 2.0)
        if policy == "drop":  # (said once: it was said as gone too)
            assert [r.getMessage() for r in caplog.records if "worker 1 " in r.getMessage()] == [
                "model 'policy': dropped worker 1 at version 1: no ack for version 1 within 2s (last acked: 0)"
            ]
        assert ray.get(actors[0].state.remote()) == (1, checksum(model, "tensordict"))
        late_on = 1
        if policy == "raise" and latest_wins:
            # Version 2 waits behind the call on its way (an outage may end: the two-host cable pull): one more wait
            optimizer_step(model, 2)
            began = time.monotonic()
            with pytest.raises(ws.SyncTimeoutError, match="no ack for version 2 within 2s"):
                scheme.send()
            assert within_its_timeout(time.monotonic() - began, 2.0)
            late_on = 2
        if policy == "raise":  # then a late actor is passed by (named at once) until it acks: the other gets each
            for version in (late_on + 1, late_on + 2):
                optimizer_step(model, version)
                began = time.monotonic()
                with pytest.raises(ws.SyncTimeoutError, match=f"passed by: still no ack for version {late_on}") as info:
                    scheme.send()
                assert (info.value.worker_idx, info.value.version) == (1, version) and time.monotonic() - began < 2.0
                assert ray.get(actors[0].state.remote()) == (version, checksum(model, "tensordict"))
            # ... and a staleness bound does not wait for it either (it waited, raised, and published nothing)
            scheme.sync, scheme.max_staleness = False, 1
            optimizer_step(model, late_on + 3)
            began = time.monotonic()
            with pytest.raises(ws.SyncTimeoutError, match="passed by"):
                scheme.send()
            assert time.monotonic() - began < 2.0 and scheme.stats()["version"] == late_on + 3
            scheme.sync, scheme.max_staleness = True, None
    finally:
        os.kill(pid, signal.SIGCONT)
    if policy == "raise":  # once it ran again and acked, the next send reaches it
        scheme.wait_async()
        optimizer_step(model, 9)
        scheme.send()
        assert [ray.get(a.state.remote()) for a in actors] == [
            (scheme.stats()["version"], checksum(model, "tensordict"))
        ] * 2
    if policy == "drop":  # the next send does not wait for it again
        optimizer_step(model, 2)
        began = time.monotonic()
        scheme.send()
        assert time.monotonic() - began < 2.0
        assert ray.get(actors[0].state.remote()) == (2, checksum(model, "tensordict"))
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


@pytest.mark.parametrize("delta", [False, True], ids=["", "delta"])
def test_a_replaced_or_restarted_actor_rejoins_and_gets_the_current_version(delta):
    from tests._ray_actors import Collector

    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, on_failure="drop", delta=delta)
    actors = [Collector.remote(), Collector.options(max_restarts=1).remote()]
    ray.get([a.join.remote(scheme, i) for i, a in enumerate(actors)])
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    scheme.connect()
    # A new actor replaces one that died for good.
    ray.kill(actors[0], no_restart=True)
    optimizer_step(model, 1)
    scheme.send()  # worker 0 is dropped here; worker 1 holds version 1
    latest = checksum(model, "tensordict")
    optimizer_step(model, 2)  # the trainer moves on without sending: the newcomer must get version 1
    newcomer = _collectors(1)[0]
    ray.get(newcomer.join.remote(scheme.receiver_config(0), 0))
    with pytest.raises(ws.ConfigurationError, match=r"rejoin\(timeout\) must be None"):  # (before it is sent anything)
        scheme.rejoin(0, newcomer, timeout=7200)
    assert ray.get(newcomer.state.remote())[0] is None
    assert scheme.rejoin(0, newcomer) == 1
    assert ray.get(newcomer.state.remote()) == (1, latest)
    assert scheme.stats()["rejoins"] == {0: 1} and scheme.stats()["dropped_workers"] == {}
    # Ray restarts the other one itself: same handle, a fresh process that joins again.
    ray.kill(actors[1], no_restart=False)
    scheme.send()  # version 2: worker 1 is dropped (its process died), or reached once already back
    # Calls fail while the actor restarts; Ray retries this one until the restart is over.
    ray.get(actors[1].join.options(max_task_retries=-1).remote(scheme, 1), timeout=60)
    assert scheme.rejoin(1) == 2
    assert ray.get(actors[1].state.remote()) == (2, checksum(model, "tensordict"))
    optimizer_step(model, 3)
    scheme.send()
    assert [ray.get(a.state.remote()) for a in (newcomer, actors[1])] == [(3, checksum(model, "tensordict"))] * 2
    assert scheme.acked_versions == {0: 3, 1: 3}
    if delta:  # version 3 went to both as changes: each had acked the version sent when it rejoined
        assert scheme.last_send.changes.keys() == {0, 1}
        # A send that fails once the trainer's copy took its bytes: they are no version sent, and a rejoin until a
        # send succeeds is refused by name rather than sent them as version 3.
        optimizer_step(model, 4)
        engine = scheme._runtime.sending.engine
        with mock.patch.object(engine, "submit", side_effect=RuntimeError("the test's")), pytest.raises(RuntimeError):
            scheme.send()
        with pytest.raises(ws.LifecycleError, match="no whole version to send"):
            scheme.rejoin(0, newcomer)
        scheme.send()  # version 5: a send whose submit began spent its number (an actor may hold its bytes)
        assert scheme.rejoin(0, newcomer) == 5
        assert ray.get(newcomer.state.remote()) == (5, checksum(model, "tensordict"))
    with pytest.raises(ws.ConfigurationError, match="worker_idx 2 is not in 0..1"):
        scheme.rejoin(2, newcomer)
    scheme.shutdown()
    with pytest.raises(ws.LifecycleError):
        scheme.rejoin(0, newcomer)
    for a in (newcomer, actors[1]):
        ray.kill(a)


def test_an_actor_rejoins_after_sends_that_reached_no_one_and_the_shut_down_sender_keeps_no_buffer():
    """The only actor died and the trainer went on sending (to no one live), or sent to ``worker_ids=[]``: the
    versions were published all the same, and a new actor rejoins with the newest (a bare AssertionError before:
    nothing whole was put). A rejoining actor that dies is named with the version it was sent. Once shut down,
    the sender holds neither its staging buffer nor the newest version."""
    from tests._ray_actors import Collector

    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, on_failure="drop")
    actors = _joined(scheme, model, n=1)
    scheme.connect()
    ray.kill(actors[0], no_restart=True)
    for step in (1, 2):
        optimizer_step(model, step)
        scheme.send()  # worker 0 dropped at the first
    optimizer_step(model, 3)
    scheme.send(worker_ids=[])
    newcomer = _collectors(1)[0]
    ray.get(newcomer.join.remote(scheme.receiver_config(0), 0))
    assert scheme.rejoin(0, newcomer) == 3
    assert ray.get(newcomer.state.remote()) == (3, checksum(model, "tensordict"))
    doomed = Collector.remote()
    ray.get(doomed.join.remote(scheme.receiver_config(0), 0))
    doomed.__ray_terminate__.remote()  # (it ends before the rejoin's call, queued after this one, runs)
    with pytest.raises(ws.WorkerDiedError, match=r"worker 0, version 3\]"):
        scheme.rejoin(0, doomed)
    engine = scheme._runtime.sending.engine
    scheme.shutdown()
    assert (engine._staging, engine.newest, engine._unstaged) == (None, None, None)


def test_a_rejoin_that_times_out_names_its_own_timeout():
    # (it waited its own, and named the scheme's: "within 20s")
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, on_failure="drop")
    actors = _joined(scheme, model, n=1)
    newcomer = None
    try:
        scheme.connect()
        ray.kill(actors[0], no_restart=True)
        optimizer_step(model, 1)
        scheme.send()  # worker 0 dropped
        newcomer = _collectors(1)[0]
        ray.get(newcomer.join.remote(scheme.receiver_config(0), 0))
        newcomer.busy.remote(5)  # (the rejoin's call waits behind it)
        with pytest.raises(ws.SyncTimeoutError, match=r"no ack for version 1 within 1s"):
            scheme.rejoin(0, newcomer, timeout=1)
    finally:
        scheme.shutdown()
        if newcomer is not None:
            ray.kill(newcomer)


def test_actor_that_cannot_apply_reports_to_the_sender():
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20)
    actors = _joined(scheme, model, kinds=["tiny", "tiny_wrong"])
    with pytest.raises(ws.ReceiverError) as info:
        scheme.connect()
    err = info.value
    assert err.worker_idx == 1 and err.remote_type == "WeightMismatchError" and "body.3.weight" in str(err)
    wrong = build("tiny_wrong")
    _scramble(wrong)
    assert ray.get(actors[1].state.remote()) == (None, checksum(wrong, "tensordict"))
    assert ray.get(actors[0].state.remote()) == (0, checksum(model, "tensordict"))
    optimizer_step(model, 2)
    with pytest.raises(ws.ReceiverError):
        scheme.send()
    assert ray.get(actors[0].state.remote()) == (1, checksum(model, "tensordict"))
    scheme.shutdown()
    for a in actors:
        ray.kill(a)


def test_a_cluster_on_several_machines_needs_the_pickle_opt_in(monkeypatch):
    model = build("tiny")
    actors = _collectors(1)
    nodes = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [*nodes, {"Alive": True, "NodeManagerAddress": "10.255.255.1"}])
    scheme = ws.RayWeightSyncScheme(timeout=20)
    with pytest.raises(ws.ConfigurationError, match=r"nodes on other machines \(10.255.255.1\).*allow_pickle=True"):
        scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    ray.get(actors[0].join.remote(ws.RayWeightSyncScheme(allow_pickle=True), 0))
    trusting = ws.RayWeightSyncScheme(timeout=20, allow_pickle=True)
    trusting.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    trusting.connect()
    assert ray.get(actors[0].state.remote()) == (0, checksum(model, "tensordict"))
    trusting.shutdown()
    ray.kill(actors[0])


def test_actor_without_a_receiver_and_bad_arguments():
    model = build("tiny")
    with pytest.raises(ws.ConfigurationError, match="remote_collectors"):
        ws.RayWeightSyncScheme().init_on_sender(model_id="policy", model=model)
    scheme = ws.RayWeightSyncScheme(timeout=20)
    actors = _collectors(1)  # never joins
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    with pytest.raises(ws.ReceiverError, match="has no receiver for model 'policy'"):
        scheme.connect()
    scheme.shutdown()
    # One actor for two workers: its one receiver would take the updates of both (refused before any is sent)
    with pytest.raises(ws.ConfigurationError, match="workers 0 and 1 were given the same actor"):
        ws.RayWeightSyncScheme().init_on_sender(model_id="policy", model=model, actors=[actors[0], actors[0]])
    ray.kill(actors[0])


@pytest.mark.parametrize(("strategy", "handed_as", "delta"), PAIRS)
def test_module_hosted_in_one_actor_follows_the_trainer(strategy, handed_as, delta):
    import torch

    from tests._ray_actors import make_value

    model = build("value")
    scheme = ws.RayModuleTransformScheme(strategy=strategy, timeout=30, delta=delta)
    Host = ray.remote(num_cpus=0)(ws.ModuleActor)
    if handed_as == "pickled":
        host = Host.remote(make_value, scheme, "transform")
        scheme.init_on_sender(model_id="transform", model=model, actor=host)
    else:
        host = Host.remote(make_value)
        scheme.init_on_sender(model_id="transform", model=model, actor=host)
        ray.get(host.join.remote(scheme.receiver_config(0)))
    assert isinstance(scheme.get_sender(), ws.RayModuleTransformSender)
    assert isinstance(scheme.sender_transports[0], ws.RayActorTransport)
    scheme.connect()
    batch = torch.randn(5, 3)
    for step in range(1, 4):
        optimizer_step(model, step)
        scheme.send()
        assert ray.get(host.weights_version.remote()) == step
        state = ray.get(host.get_weights.remote())
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert scheme.acked_versions == {0: 3} and scheme.stats()["changes_sent"] == (3 if delta else 0)
    with torch.no_grad():
        expected = model(batch)
    assert torch.allclose(ray.get(host.forward.remote(batch)), expected)
    scheme.shutdown()
    ray.kill(host)


def test_module_actor_failures_are_named():
    from tests._ray_actors import make_value

    model = build("value")
    scheme = ws.RayModuleTransformScheme(timeout=20)
    host = ray.remote(num_cpus=0)(ws.ModuleActor).remote(make_value, scheme, "transform")
    with pytest.raises(ws.ConfigurationError, match="ONE actor"):
        ws.RayModuleTransformScheme().init_on_sender(model=model, remote_collectors=[host, host])
    # What is not a list of actor handles is named (it failed deep in connect(), or as "not iterable").
    for bad, said in ((host, "got ActorHandle"), ([ws.ModuleActor], r"a list holding \['type'\]")):
        with pytest.raises(ws.ConfigurationError, match=rf"takes a list of Ray actor handles .*{said}"):
            ws.RayWeightSyncScheme().init_on_sender(model=model, remote_collectors=bad)
    scheme.init_on_sender(model_id="transform", model=model, actor=host)
    scheme.connect()
    kill_actor(host, no_restart=True)  # (its process ended: the next send cannot reach it)
    optimizer_step(model, 1)
    with pytest.raises(ws.WorkerDiedError) as info:
        scheme.send()
    assert (info.value.worker_idx, info.value.model_id) == (0, "transform")
    scheme.shutdown()


def test_a_module_actors_own_update_method_must_exist_and_return_the_version_it_holds():
    """(A missing method raised a bare AttributeError at the first send; one returning ``None`` cost a whole
    timeout, and one returning a string a bare TypeError.)"""
    from tests._ray_actors import ReturnsNothing, make_value

    model = build("value")
    scheme = ws.RayModuleTransformScheme(timeout=20)
    with pytest.raises(ws.ConfigurationError, match="actor 0 has no method update_weights_tensordict"):
        scheme.init_on_sender(model_id="transform", model=model, actor=_collectors(1)[0])
    scheme.shutdown()
    scheme = ws.RayModuleTransformScheme(timeout=20)
    host = ray.remote(num_cpus=0)(ReturnsNothing).remote(make_value, None)
    scheme.init_on_sender(model_id="transform", model=model, actor=host)
    ray.get(host.join.remote(scheme.receiver_config(0), "transform"))
    started = time.monotonic()
    with pytest.raises(ws.ReceiverError, match="returned None, not the version it holds") as info:
        scheme.connect()
    assert time.monotonic() - started < 10 and info.value.worker_idx == 0
    scheme.shutdown()


@pytest.mark.parametrize("delta", [False, True], ids=["", "delta"])
def test_an_actor_ray_restarts_that_joins_again_is_sent_the_version_whole_in_the_same_send(delta):
    """Its new process, behind the same handle, holds no layout and no version, and the sender is not told: the
    first update it gets (without the layout, or changes against a version it never held) is sent again whole,
    with the layout, in the same send. (Every later send was refused before, the actor never served again.)"""
    import psutil

    from tests._ray_actors import JoinsAtStart

    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, delta=delta)
    actor = JoinsAtStart.remote(scheme, 0)
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=[actor])
    scheme.connect()
    optimizer_step(model, 1)
    scheme.send()
    process = psutil.Process(ray.get(actor.pid.remote()))
    process.kill()
    process.wait(30)
    assert ray.get(actor.state.options(max_task_retries=-1).remote(), timeout=60)[0] is None  # restarted, joined
    for step in (2, 3):
        optimizer_step(model, step)
        scheme.send()
        assert ray.get(actor.state.remote()) == (step, checksum(model, "tensordict"))
    assert scheme.acked_versions == {0: 3}
    # Counted as a rejoin, and version 2 not as changes sent (it went whole): neither was, before.
    assert scheme.stats()["rejoins"] == {0: 1} and scheme.stats()["changes_sent"] == (2 if delta else 0)
    # Again, with two asynchronous sends on their way to the new process: the first says it wants the layout.
    process = psutil.Process(ray.get(actor.pid.remote()))
    process.kill()
    process.wait(30)
    assert ray.get(actor.state.options(max_task_retries=-1).remote(), timeout=60)[0] is None
    for step in (4, 5):
        optimizer_step(model, step)
        scheme.send_async()
    scheme.wait_async()
    assert ray.get(actor.state.remote()) == (5, checksum(model, "tensordict"))
    assert scheme.acked_versions == {0: 5} and scheme.stats()["rejoins"] == {0: 2}
    scheme.shutdown()


def test_a_new_trainer_takes_over_actors_whose_receivers_stayed_and_starts_its_versions_over():
    """A trainer restarted (or a second one) reaches actors whose receivers held a later version of the first: its
    version 0 is applied, not taken for an older version (its ack was counted as the first trainer's 3)."""
    first, second = build("tiny"), build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20)
    (actor,) = _joined(scheme, first, n=1)
    scheme.connect()
    for step in (1, 2, 3):
        optimizer_step(first, step)
        scheme.send()
    scheme.shutdown()
    optimizer_step(second, 42)
    scheme = ws.RayWeightSyncScheme(timeout=20)
    scheme.init_on_sender(model_id="policy", model=second, remote_collectors=[actor])
    scheme.connect()
    assert scheme.acked_versions == {0: 0} and ray.get(actor.state.remote()) == (0, checksum(second, "tensordict"))
    optimizer_step(second, 43)
    scheme.send()
    assert scheme.acked_versions == {0: 1} and ray.get(actor.state.remote()) == (1, checksum(second, "tensordict"))
    scheme.shutdown()


def test_an_actor_that_runs_calls_side_by_side_never_applies_an_older_version_after_a_newer_one():
    """A threaded actor (``max_concurrency`` > 1) may run two updates at once, or a later one first: each
    receiver applies one at a time, and an update older than the version it holds is not applied (it answers the
    version it holds). Played in the actor's process, the order forced."""
    from weightsync.transports.ray.receiver import RayReceiver

    receiver = RayReceiver(placement="load", where={"model_id": "ordered", "worker_idx": 0})
    applied: list[int] = []
    receiver.attach(lambda taken: applied.append(taken[-1].version) or taken[-1].version)
    receiver.layout = None
    try:
        assert receiver.push(2, [], [], {"entries": []}, None) == 2
        assert receiver.push(1, [], [], None, None) == 2  # the older version, late: not applied
        assert receiver.push(3, [], [], None, None) == 3
        assert applied == [2, 3]
    finally:
        receiver.close()


def _sent_once(**options):
    """A tiny model, its Ray scheme (``options``) and two collectors that joined it, version 1 sent."""
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=30, **options)
    actors = _joined(scheme, model)
    scheme.connect()
    optimizer_step(model, 1)
    scheme.send()
    return model, scheme, actors


def test_corrupted_payload_is_refused_and_the_actors_keep_their_weights():
    model, scheme, actors = _sent_once(checksum=True)
    held = checksum(model, "tensordict")
    optimizer_step(model, 2)
    with mock.patch("weightsync.core.engine.SenderEngine.digest", return_value="0" * 16):
        with pytest.raises(ws.SendFailedError) as info:
            scheme.send()
    assert sorted(info.value.failures) == [0, 1]
    assert all(e.remote_type == "IntegrityError" for e in info.value.failures.values())
    assert ray.get([a.state.remote() for a in actors]) == [(1, held)] * 2
    scheme.send()
    assert ray.get([a.state.remote() for a in actors]) == [(3, checksum(model, "tensordict"))] * 2
    scheme.shutdown()


def test_a_vllm_engine_in_an_actor_is_loaded_and_named_each_version_in_one_call():
    """A vLLM engine in a Ray actor: each update is one call into the actor, in which the engine begins the update,
    loads the version, names it and resets its prefix cache, with no other call of the actor's in between. (Were
    the engine's calls made apart, after the one that loads, a ``generate`` queued between them computed with the
    new weights under the old version's name.) A load that fails ends the update unnamed: the engine keeps serving
    the version it holds, under its name, and the next version reaches it. (Version 0 goes whole, the others as
    changes.) An actor that runs calls side by side is refused by name."""
    import threading

    from tests._ray_actors import EngineInActor, weights_sum
    from weightsync.integrations.vllm import VLLMEngines
    from weightsync.tensors.strategy import flatten_weights

    model = build("tiny")
    spec = {k: (tuple(v.shape), v.dtype) for k, v in flatten_weights(model, "tensordict").items()}
    actor = EngineInActor.remote(spec, refuse_load=4)  # (version 3's load)
    # Up first (vLLM imported): on 2 cores kept busy, its process took 46 s to start, vLLM's import as long again.
    ray.get(actor.log.remote(), timeout=180)
    sums = {0: weights_sum(flatten_weights(model, "tensordict"))}
    seen: list[tuple] = []
    stop = threading.Event()

    def generate() -> None:
        while not stop.is_set():
            seen.append(ray.get(actor.generate.remote(), timeout=30))

    scheme = ws.RayWeightSyncScheme(timeout=20, connect_timeout=30, delta="auto")
    generating = threading.Thread(target=generate, daemon=True)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([actor], pause_mode="none"))
        generating.start()
        scheme.connect()
        for version in range(1, 6):
            optimizer_step(model, version)
            sums[version] = weights_sum(flatten_weights(model, "tensordict"))
            if version == 3:
                with pytest.raises(ws.WeightSyncError, match="bad weights"):
                    scheme.send()
                assert ray.get(actor.generate.remote(), timeout=30) == (sums[2], "2")
                continue
            scheme.send()
            assert ray.get(actor.generate.remote(), timeout=30) == (sums[version], str(version))
    finally:
        stop.set()
        generating.join(30)
        scheme.shutdown()
    assert len(seen) > 10 and all(name == "checkpoint" or held == sums[int(name)] for held, name in seen)
    engines = VLLMEngines([actor], pause_mode="none")
    with pytest.raises(ws.ConfigurationError, match="RayWeightSyncScheme"):  # (its updates: the actor's methods)
        ws.RayModuleTransformScheme(timeout=20).init_on_sender(model=model, context=engines)
    assert engines._gate is None  # (the engines are free for another scheme)
    calls = ray.get(actor.log.remote(), timeout=30)
    update = ["start", "load", "update {}", "finish {}", "reset"]
    for version in (0, 1, 2, 4, 5):
        assert [c.format(version) for c in update] in [calls[i : i + 5] for i in range(len(calls))], calls
    assert ["start", "load", "finish None"] in [calls[i : i + 3] for i in range(len(calls))], calls
    ray.kill(actor)
    threaded = EngineInActor.options(max_concurrency=2).remote(spec)  # (a generate would run while it loads)
    ray.get(threaded.log.remote(), timeout=180)
    scheme = ws.RayWeightSyncScheme(timeout=20, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([threaded], pause_mode="none"))
        with pytest.raises(ws.WeightSyncError, match="max_concurrency=2"):
            scheme.connect()
    finally:
        scheme.shutdown()
        ray.kill(threaded)


def test_a_send_interrupted_as_it_asked_to_hear_of_a_calls_end_leaves_the_actor_served(monkeypatch):
    """``latest_wins`` holds a whole version back while a call to the actor is on its way, and sends it when Ray
    says that call ended. A Ctrl-C as the send asked Ray to say so (found by a review's sweep of interrupts) left
    the call counted with nobody to report its end: every later version to that actor was held back for good, and
    each send timed out naming it. A call's end is now also looked for by the trainer, once."""
    import concurrent.futures

    model, scheme, actors = _sent_once()
    scheme.timeout = 5.0
    assert scheme.sender_transports[1].coalesce
    # Version 1's calls read as ended first: until then version 2 is held back, and Ray's thread, reporting the end,
    # sends it itself and meets the Ctrl-C on its own thread (ci164).
    for transport in scheme.sender_transports.values():
        for call in list(transport._unended):
            call.result(30)
        assert not transport.holds_back()
    register = concurrent.futures.Future.add_done_callback
    interrupted: list[bool] = []

    def once(self, fn):
        if not interrupted and getattr(fn, "__self__", None) is scheme.sender_transports[1]:
            interrupted.append(True)
            raise KeyboardInterrupt("as the send asked to hear of the call's end")
        return register(self, fn)

    monkeypatch.setattr(concurrent.futures.Future, "add_done_callback", once)
    try:
        optimizer_step(model, 2)
        with pytest.raises(KeyboardInterrupt):
            scheme.send()
        for step in (3, 4):
            optimizer_step(model, step)
            scheme.send()
            assert ray.get([a.state.remote() for a in actors]) == [(scheme.version, checksum(model))] * 2
    finally:
        scheme.shutdown()


def test_a_ctrl_c_as_the_trainer_sends_a_held_back_version_leaves_it_to_go(monkeypatch):
    """Under ``latest_wins`` the trainer's wait may send a version held back itself, where Ray's thread has not
    reported the call before it ended yet. A Ctrl-C as it made that call lost the version for good: the actor was
    never sent it, and the next wait timed out (found by a review of the fix that lets the trainer send it)."""
    import threading

    from weightsync.transports.ray.transport import RayTransport

    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=5, sync=False)
    (actor,) = _joined(scheme, model, n=1)
    scheme.connect()
    transport = scheme.sender_transports[0]
    for call in list(transport._unended):  # (version 0's call reported first: until then, version 1 is held back too,
        call.result(30)  # and Ray's thread, reporting it, sends the newest itself)
    assert not transport.holds_back()
    ended, remote = RayTransport._ended, RayTransport._remote
    hits: list[int] = []
    interrupted = threading.Event()

    def reported_late(self, call):  # (Ray's thread reports the call's end once the trainer's wait was interrupted)
        if threading.current_thread() is not threading.main_thread():
            interrupted.wait(30)
        ended(self, call)

    def interrupted_once(self, version, *args):
        if threading.current_thread() is threading.main_thread() and version == 2 and not hits:
            hits.append(version)
            raise KeyboardInterrupt("as the held-back version goes")
        return remote(self, version, *args)

    monkeypatch.setattr(RayTransport, "_ended", reported_late)
    try:
        actor.busy.remote(1.5)
        optimizer_step(model, 2)
        scheme.send_async()  # (version 1: behind the busy call)
        optimizer_step(model, 3)
        scheme.send_async()  # (version 2: held back while version 1's call runs)
        assert transport.pending is not None and transport.pending[0] == 2 and 1 in transport.refs()
        monkeypatch.setattr(RayTransport, "_remote", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            scheme.wait_async(10)
        interrupted.set()
        assert hits == [2]
        monkeypatch.setattr(RayTransport, "_remote", remote)
        scheme.wait_async(10)
        assert ray.get(actor.state.remote()) == (2, checksum(model))
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("where", ["between calls", "after the calls"])
def test_an_interrupted_send_never_leaves_its_version_number_to_other_weights(where):
    """A send interrupted after one actor's call went out (``KeyboardInterrupt`` while submitting to the next, or
    once every call went out, before the send had counted the number spent: found by a review's sweep of
    interrupts): an actor may hold the version's bytes, so the next send names its weights with a new number.
    (Reusing it, the actor skipped the next send as a version it held, acked it, and took every later change
    against bytes the trainer never had, silently, for good.)"""
    from tests._bodies import sparse_step
    from weightsync.core.changes import Changes
    from weightsync.transports.ray.transport import RayTransport

    model, scheme, actors = _sent_once(delta=True)
    optimizer_step(model, 2)
    submit = RayTransport.submit

    def interrupted(self, *args, **kwargs):
        if self.worker_idx == 1:
            raise KeyboardInterrupt("after worker 0's call went out")
        return submit(self, *args, **kwargs)

    def interrupted_after(self, *args, **kwargs):  # (the first thing the send does once every call went out)
        raise KeyboardInterrupt("after every call went out")

    patched = (
        mock.patch.object(RayTransport, "submit", interrupted)
        if where == "between calls"
        else mock.patch.object(Changes, "submitted", interrupted_after)
    )
    with patched, pytest.raises(KeyboardInterrupt):
        scheme.send()
    assert wait_until(lambda: ray.get(actors[0].state.remote())[0] == 2, deadline_after(10), 0.05)
    try:
        optimizer_step(model, 3)
        scheme.send()
        for step in (4, 5, 6):  # changes, against what each actor holds
            sparse_step(ws.WeightStrategy().flat(model).values(), step, 0.01)
            scheme.send()
            assert ray.get([a.state.remote() for a in actors]) == [(scheme.version, checksum(model))] * 2
    finally:
        scheme.shutdown()


def _shut_down_and_join_twice(collector) -> str:
    """In the actor: a second receiver of the model beside the open one is refused; then the open one shuts down."""
    try:
        ws.RayWeightSyncScheme().init_on_receiver(model_id="policy", model=build("tiny"), worker_idx=1)
    except ws.ConfigurationError as exc:
        said = str(exc)
    else:
        said = "accepted"
    collector.scheme.shutdown()
    return said


def test_an_actor_whose_receiver_shut_down_is_named_gone_and_dropped_and_a_second_receiver_is_refused():
    """An actor alive whose receiver shut down was taken for one that refused each update ("no receiver for
    model ... call init_on_receiver"): raised at every send, never dropped under ``drop``. A second receiver of the
    model in the same actor silently replaced the first, whose model was never written again while the sends'
    acks said it was."""
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(timeout=20, on_failure="drop")
    actors = _joined(scheme, model)
    try:
        scheme.connect()
        said = ray.get(actors[1].__ray_call__.remote(_shut_down_and_join_twice), timeout=60)
        assert "already has a receiver of model 'policy'" in said, said
        optimizer_step(model, 1)
        scheme.send()
        assert list(scheme.stats()["dropped_workers"]) == [1]
        assert "its receiver shut down" in str(scheme.stats()["dropped_workers"][1])
        assert ray.get(actors[0].state.remote(), timeout=30) == (1, checksum(model))
        optimizer_step(model, 2)
        scheme.send()  # the other goes on, and the dropped one is not waited for
        assert scheme.acked_versions[0] == 2
    finally:
        scheme.shutdown()
    for actor in actors:
        kill_actor(actor)


def test_a_module_actors_forward_waits_for_the_update_under_way_and_it_for_the_forward():
    """A ``ModuleActor`` that runs calls side by side (``max_concurrency`` above 1) computed forwards with two
    versions at once (9 of 144 beside updates in a user's audit): its forward holds the receiver's weights lock."""
    import threading

    class Scheme:
        weights_lock = threading.RLock()

    host = ws.ModuleActor(torch.nn.Linear(2, 2))
    host.scheme = Scheme()  # type: ignore[assignment]
    done = threading.Event()
    with Scheme.weights_lock:  # (as an update holds it while it writes)
        forward = threading.Thread(target=lambda: (host.forward(torch.ones(2)), done.set()), daemon=True)
        forward.start()
        assert not done.wait(0.5)  # (it waits for the update)
    assert done.wait(30)
    forward.join(30)
