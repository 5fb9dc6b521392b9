"""Test bodies every scheme runs: the local and torch.distributed ones in the test process, RPC in a trainer
process of its own (torch.distributed.rpc starts once per process)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import weightsync as ws
from tests._workers import build, checksum, serve
from weightsync.tensors.bound import BoundModel


def on(kind: str, device: str = "") -> str:
    """The model ``kind`` on ``device`` (``""``: the CPU), as :func:`tests._workers.build` names it."""
    return f"{kind}@{device}" if device else kind


def optimizer_step(model: torch.nn.Module, seed: int) -> None:
    """An in-place change like an optimizer step, buffers included."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in ws.WeightStrategy().flat(model).values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=gen).to(tensor.device) * 0.1)
            else:
                tensor.add_(1)


def sparse_step(tensors, seed: int, fraction: float = 0.01, scale: float = 1.0) -> None:
    """A step that moves about ``fraction`` of the values of each floating tensor of ``tensors`` (as small steps in
    bfloat16 do), wherever they live: the same values for the same seed on every device."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point():
                mask = torch.rand(tensor.shape, generator=gen) < fraction
                moved = torch.randn(int(mask.sum()), generator=gen) * scale
                tensor[mask.to(tensor.device)] += moved.to(tensor.device, tensor.dtype)


def start_readers(workers, scheme, background: bool = False, device: str = "", kind: str = "flat4"):
    """A "flat4" model (or ``kind``) on the sender and 2 workers reading theirs continuously (``torn_reader``),
    connected."""
    from tests._workers import torn_reader

    model = build(on(kind, device))
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group = workers(torn_reader, 2, lambda i, conn: (scheme, i, on(kind, device), conn, background))
    scheme.connect()
    for w in range(2):
        assert group.recv(w) == "ready"
    return model, group


def no_torn_reads_under_alternating_sends(
    scheme, workers, sends: int, background: bool = False, device: str = "", kind: str = "flat4"
):
    """``sends`` async sends of weights all 0 or all 1 in turn (the sender laps slow readers): neither reader ever
    sees a mix, and both end at the last version."""
    model, group = start_readers(workers, scheme, background, device, kind)
    for step in range(1, sends + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step % 2))
        scheme.send()  # sync=False: does not wait
    scheme.wait_async()
    assert scheme.acked_versions == {0: sends, 1: sends}
    for w in range(2):
        group.cmds[w].send(("stop",))
        stats = group.recv(w)
        assert stats["torn"] == 0, f"worker {w} saw {stats['torn']} torn reads in {stats['reads']}"
        assert stats["reads"] > 0 and stats["applied"] > 0 and stats["version"] == sends
    scheme.shutdown()


@contextlib.contextmanager
def sigint_at_first_call(owner, name: str, *, after: bool = False):
    """A Ctrl-C at ``owner.<name>``'s first call in the main thread: a real ``SIGINT`` raised in this process just
    before the call (or, ``after``, just after it returned), which Python turns into ``KeyboardInterrupt`` at its
    next step unless the code holds interrupts there. Yields the list of calls it hit (one at most); ``owner`` is
    restored at the block's end."""
    import signal
    import threading

    real, hits = getattr(owner, name), []

    def hit() -> None:
        if not hits and threading.current_thread() is threading.main_thread():
            hits.append(name)
            signal.raise_signal(signal.SIGINT)

    def call(*args, **kwargs):
        if not after:
            hit()
        made = real(*args, **kwargs)
        if after:
            hit()
        return made

    # Python's own handler, whatever this process inherited (a job started in the background ignores SIGINT)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    setattr(owner, name, call)
    try:
        yield hits
    finally:
        setattr(owner, name, real)
        signal.signal(signal.SIGINT, before)


def a_send_cut_by_a_ctrl_c(scheme, workers, owner, name: str, after: bool = False, then=lambda scheme: None):
    """Two workers; a Ctrl-C at ``owner.<name>``'s first call in a send (:func:`sigint_at_first_call`), which
    raises ``KeyboardInterrupt``; ``then(scheme)``; then the next wait and send reach both workers whole."""
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    try:
        optimizer_step(model, 1)
        with sigint_at_first_call(owner, name, after=after) as hits, pytest.raises(KeyboardInterrupt):
            scheme.send()
        assert hits == [name]
        then(scheme)
        scheme.wait_async()
        optimizer_step(model, 2)
        scheme.send()
        assert [group.ask(i, "state")["policy"] for i in range(2)] == [(2, checksum(model))] * 2
    finally:
        group.stop()
        scheme.shutdown()


def a_ctrl_c_as_the_trainer_takes_an_ack_loses_no_ack(scheme, workers):
    """A Ctrl-C as the trainer hands an ack it read on to the ledger: the send raises ``KeyboardInterrupt``, the
    ack counts, and the next wait and send reach every worker in time. (The ack was read and dropped: the next
    wait timed out naming a live worker, which ``on_failure="drop"`` dropped for good.)"""
    from weightsync.core.sender import Sender

    a_send_cut_by_a_ctrl_c(scheme, workers, Sender, "acked")


def a_ctrl_c_as_an_rpc_goes_out_leaves_it_waited_for(scheme, workers):
    """``rpc``: a Ctrl-C right after the call bringing a version to a worker went out, before it was recorded: the
    call was neither waited for (the next wait timed out naming a live worker) nor counted as reading its staging
    buffer, which the next send could refill while the call still sent it."""
    from torch.distributed import rpc

    def read_by_its_call(scheme) -> None:  # (the call to worker 0 counts as reading its buffer)
        staged = scheme._runtime.sending.engine.pool.buffers
        assert any(0 in staging.readers for staging in staged), [staging.readers for staging in staged]

    a_send_cut_by_a_ctrl_c(scheme, workers, rpc, "rpc_async", after=True, then=read_by_its_call)


def start(workers, schemes: dict, kinds: dict, n: int = 2, **kw):
    group = workers(serve, n, lambda i, conn: (schemes, i, kinds, conn, *kw.values()))
    for scheme in schemes.values():
        scheme.connect()
    ready = [group.recv(i) for i in range(n)]
    return group, ready


def every_send_reaches_every_targeted_worker(scheme, workers, strategy):
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"})
    expected = {0: checksum(model, strategy)}
    for _, log, errors in ready:
        assert errors == {}
        assert log == [("policy", 0, expected[0])]

    held = {0: 0, 1: 0}
    plan = [None] * 6 + [[1], 0, [0, 1], None]
    for step, worker_ids in enumerate(plan, start=1):
        optimizer_step(model, step)
        expected[step] = checksum(model, strategy)
        scheme.send(worker_ids=worker_ids)
        targets = [0, 1] if worker_ids is None else ([worker_ids] if isinstance(worker_ids, int) else worker_ids)
        for w in targets:
            held[w] = step
        assert scheme.version == step
        for w in range(2):
            assert scheme.acked_versions[w] == held[w]
            version, digest = group.ask(w, "state")["policy"]
            assert (version, digest) == (held[w], expected[held[w]]), f"worker {w} after send {step}"

    for w in range(2):
        for model_id, version, digest in group.ask(w, "log"):
            assert model_id == "policy" and digest == expected[version], f"worker {w} applied a wrong version {version}"
    for w in range(2):
        _, _, leftovers = group.ask(w, "stop")
        assert leftovers == {"threads": [], "memfds": 0, "maps": 0}, f"worker {w} kept {leftovers}"
    scheme.shutdown()
    scheme.shutdown()  # idempotent


def worker_storage_switches_unless_kept(scheme, workers, kind="tiny"):
    """A CPU worker takes each update's buffer as its model's storage, or copies into the storage it has
    (``keep_storage``, or a model in shared memory); either way it holds exactly the weights sent."""
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": kind})
    storages = {w: [group.ask(w, "storage", "policy")] for w in range(2)}
    for step in range(1, 5):
        optimizer_step(model, step)
        scheme.send()
        for w in range(2):
            assert group.ask(w, "state")["policy"] == (step, checksum(model, scheme.strategy.extract_as))
            storages[w].append(group.ask(w, "storage", "policy"))
    for w, seen in storages.items():
        memory, objects = [m for m, _ in seen], [o for _, o in seen]
        if scheme.keep_storage or kind == "tiny_shared":
            assert len(set(seen)) == 1, f"worker {w} moved its model: {seen}"
        else:  # the buffer of each update is new while the model still holds the one before
            assert all(a != b for a, b in zip(memory, memory[1:])), f"worker {w} did not switch: {seen}"
            # ... and reaches the model as new memory behind the storage its tensors were bound to at the first
            # update (O(1)), not by re-pointing every tensor at a new storage (a torch older than 2.12 must)
            if BoundModel.can_swap:
                assert len(set(objects)) == 1, f"worker {w} re-pointed its model: {seen}"
    group.stop()
    scheme.shutdown()


_ENGINE = {"multiprocess": "local", "shared_mem": "local", "distributed": "distributed", "rpc": "rpc"}


def flatten_sender_copies_one_buffer(scheme, workers):
    """flatten_sender: the trainer's weights move into one buffer at init (values and Parameter objects kept);
    each send then copies that buffer whole, with no tensor-by-tensor write. A trainer tensor moved since is
    bound anew at the next send; weights passed explicitly are copied tensor by tensor."""
    import importlib

    # The sender's engine stages each version, through the core's Outgoing.write or a bucket loop of its own:
    # its tensor-by-tensor writes are counted there.
    engine = importlib.import_module(f"weightsync.transports.{_ENGINE[type(scheme).backend_name]}.sender")
    modules = [m for m in (engine, importlib.import_module("weightsync.core.engine")) if hasattr(m, "write_into")]
    writes, adopted = [], []  # the sender's tensor-by-tensor writes; bindings of the trainer's weights
    real_write_into, real_adopt = modules[0].write_into, BoundModel.adopt
    for module in modules:
        module.write_into = lambda dst, src, **kw: writes.append(len(dst)) or real_write_into(dst, src, **kw)
    BoundModel.adopt = lambda self, *a, **kw: adopted.append(1) or real_adopt(self, *a, **kw)
    try:
        extract = scheme.strategy.extract_as
        model = build("tiny")
        params, before = dict(model.named_parameters()), checksum(model, extract)
        scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
        layout, flat = scheme.layout, scheme.strategy.flat(model)
        base = flat[layout.slots[0].key].data_ptr()
        assert {s.key: flat[s.key].data_ptr() - base for s in layout.slots} == {s.key: s.offset for s in layout.slots}
        assert adopted == [1] and dict(model.named_parameters()) == params and checksum(model, extract) == before
        group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})

        def send(step: int, weights=None) -> None:
            if weights is None:
                optimizer_step(model, step)
            scheme.send(weights)
            expected = checksum(model if weights is None else weights, extract)
            for w in range(2):
                assert group.ask(w, "state")["policy"] == (step, expected), f"worker {w} after send {step}"

        send(1)
        send(2)
        assert writes == [] and adopted == [1]  # each send: one copy of the one buffer
        model.body[0].weight.data = torch.ones_like(model.body[0].weight)  # the trainer moves a tensor off it
        send(3)
        send(4)
        assert writes == [] and adopted == [1, 1]  # bound anew, once
        send(5, {k: v + 1 for k, v in scheme.strategy.flat(model).items()})
        assert len(writes) >= 1 and adopted == [1, 1]  # explicit weights: tensor by tensor
        assert dict(model.named_parameters()) == params
        group.stop()
        scheme.shutdown()
    finally:
        for module in modules:
            module.write_into = real_write_into
        BoundModel.adopt = real_adopt


def shared_memory_worker_is_written_into(scheme, workers):
    worker_storage_switches_unless_kept(scheme, workers, kind="tiny_shared")


def trainer_changes_are_invisible_until_send(scheme, workers, device=""):
    model = build(on("tiny", device))
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": on("tiny", device)})
    published = checksum(model, scheme.strategy.extract_as)
    for step in range(3):
        optimizer_step(model, 50 + step)  # no send
    assert checksum(model, scheme.strategy.extract_as) != published
    for w in range(2):
        assert group.ask(w, "state")["policy"] == (0, published)
    scheme.send()
    for w in range(2):
        assert group.ask(w, "state")["policy"] == (1, checksum(model, scheme.strategy.extract_as))
    group.stop()
    scheme.shutdown()


def bad_weights_fail_in_the_caller_and_send_nothing(scheme, workers):
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ws.InvalidWeightsError, match="function"):
        scheme.send(weights={**ws.WeightStrategy("state_dict").flat(model), "scale": lambda x: x})
    wrong = ws.WeightStrategy().flat(model)
    wrong["body.0.weight"] = torch.zeros(3, 3)
    with pytest.raises(ws.WeightMismatchError, match="body.0.weight"):
        scheme.send(weights=wrong)
    missing = ws.WeightStrategy().flat(model)
    del missing["scale"]
    with pytest.raises(ws.WeightMismatchError, match="missing keys \\['scale'\\]"):
        scheme.send(weights=missing)
    with pytest.raises(ws.ConfigurationError, match="worker_ids \\[2\\]"):
        scheme.send(worker_ids=[0, 2])
    assert scheme.version == 0
    for w in range(2):
        assert group.ask(w, "state")["policy"][0] == 0
    assert all(torch.equal(good[k], v) for k, v in model.state_dict().items())
    group.stop()
    scheme.shutdown()


def killed_worker_is_named_and_the_others_are_served(scheme, workers, device=""):
    """SIGKILL a worker; the next send names it (well within the timeout) and still updates the other."""
    import os
    import signal
    import time

    model = build(on("tiny", device))
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": on("tiny", device)})
    os.kill(group.procs[1].pid, signal.SIGKILL)
    group.procs[1].join(10)
    optimizer_step(model, 1)
    began = time.monotonic()
    with pytest.raises(ws.WorkerDiedError) as info:
        scheme.send()
    assert time.monotonic() - began < scheme.timeout
    assert (info.value.worker_idx, info.value.model_id, info.value.version) == (1, "policy", 1)
    assert group.ask(0, "state")["policy"] == (1, checksum(model, scheme.strategy.extract_as))
    optimizer_step(model, 2)
    scheme.send(worker_ids=[0])
    assert scheme.acked_versions == {0: 2, 1: 0}
    assert 1 in scheme.failed_workers and not scheme.sender_transports[1].check_connection()
    group.stop()
    scheme.shutdown()


def sent_without_a_time_out(scheme) -> bool:
    """Send once: whether no worker timed out or was passed by (for ``wait_until``, until a late worker is back)."""
    try:
        scheme.send()
    except ws.SyncTimeoutError:
        return False
    return True


def within_its_timeout(took: float, timeout: float) -> bool:
    """The bound every documented wait keeps (docs/reliability.md): between 0.9 and 1.1 times its timeout,
    plus one second."""
    return 0.9 * timeout <= took <= 1.1 * timeout + 1.0


def send_past_hung_worker_1(scheme, model, timeout: float) -> None:
    """Send version 1 while worker 1 is hung: it costs one ``timeout`` (:func:`within_its_timeout`), then
    raises ``SyncTimeoutError`` naming the worker, or drops it, by the scheme's ``on_failure``."""
    import time

    optimizer_step(model, 1)
    began = time.monotonic()
    if scheme.on_failure == "raise":
        with pytest.raises(ws.SyncTimeoutError) as info:
            scheme.send()
        assert (info.value.worker_idx, info.value.version, info.value.model_id) == (1, 1, "policy")
    else:
        scheme.send()
        assert "SyncTimeoutError" in scheme.stats()["dropped_workers"][1]
    took = time.monotonic() - began
    assert within_its_timeout(took, timeout), took


def send_passing_worker_1_by(scheme, model, version: int, timeout: float, group) -> None:
    """Send ``version`` while worker 1 is late on version 1: the send names it at once ("passed by", by this send's
    version), not waiting ``timeout`` for it, and worker 0 holds the version."""
    optimizer_step(model, version)
    began = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="passed by: still no ack for version 1, which timed out"):
        try:
            scheme.send()
        except ws.SyncTimeoutError as exc:
            assert (exc.worker_idx, exc.version, exc.model_id) == (1, version, "policy"), exc
            raise
    assert time.monotonic() - began < timeout  # (not waited for)
    assert group.ask(0, "state")["policy"] == (version, checksum(model))


def hung_worker_costs_one_timeout(scheme, workers, timeout=2.0, device=""):
    """A worker hung by SIGSTOP costs one ``timeout``: the send raises ``SyncTimeoutError`` naming it, or
    drops it (``on_failure``), within its timeout (:func:`within_its_timeout`); the other worker
    holds the new version, and a dropped worker is not waited for again."""
    import os
    import signal
    import time

    model = build(on("tiny", device))
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": on("tiny", device)})
    assert all(errors == {} for _, _, errors in ready)
    scheme.timeout = timeout
    extract = scheme.strategy.extract_as
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        send_past_hung_worker_1(scheme, model, timeout)
        assert group.ask(0, "state")["policy"] == (1, checksum(model, extract))
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    if scheme.on_failure == "drop":  # the next send does not wait for it again
        optimizer_step(model, 2)
        began = time.monotonic()
        scheme.send()
        assert time.monotonic() - began < timeout
        assert group.ask(0, "state")["policy"] == (2, checksum(model, extract))
    group.stop()
    scheme.shutdown()


def a_late_worker_is_passed_by_until_it_acks(scheme, workers, timeout=2.0, kind="flat2_8mb"):
    """``on_failure="raise"``: once a worker stopped (a debugger, ``SIGSTOP``) timed out, each later send names it
    at once ("passed by", by that send's version) and sends it nothing, and the other worker holds every version.
    Sent each version, the stopped worker held the buffers and slots of all of them, which engines keep while it
    may still read them: after two to four sends, every send failed for every worker (versions over 4 MiB staged by
    ``distributed``; the local schemes' slots). Once it runs again and acks, the next send reaches it."""
    import os
    import signal

    model = build(kind)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": kind})
    assert all(errors == {} for _, _, errors in ready)
    scheme.timeout = timeout
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        send_past_hung_worker_1(scheme, model, timeout)
        for version in range(2, 8):
            send_passing_worker_1_by(scheme, model, version, timeout, group)
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    scheme.wait_async()  # worker 1 takes version 1, the last sent to it, and acks it
    assert scheme.acked_versions == {0: 7, 1: 1}
    optimizer_step(model, 8)
    scheme.send()
    assert [group.ask(w, "state")["policy"] for w in (0, 1)] == [(8, checksum(model))] * 2
    group.stop()
    scheme.shutdown()


def a_stopped_worker_in_a_world_the_caller_runs_is_passed_by_until_it_answers(
    scheme, workers, timeout=1.0, kind="flat4_64mb"
):
    """Your own RPC world (``worker_names=``), where a version's call is bounded by ``timeout`` (your graceful
    ``rpc.shutdown()`` waits for every call still out): once a stopped worker's call ended unanswered, each later
    send passes it by at once, naming it, and makes no call to it; the other worker holds every version. Each send
    made a call of its own, which cost that ``timeout`` and whose bytes TensorPipe kept until the worker read again:
    the trainer grew by the model's size (64 MiB) a send. Once the worker runs again and has answered that version,
    the trainer hears of it (a small call asks) and the next send reaches it."""
    import os
    import signal

    from tests._workers import live_rss
    from weightsync.core.timing import deadline_after, wait_until

    with world_the_caller_runs(scheme, workers, kind) as (model, group):
        scheme.timeout = timeout
        os.kill(group.procs[1].pid, signal.SIGSTOP)
        try:
            send_past_hung_worker_1(scheme, model, timeout)
            for version in range(2, 7):
                if version == 3:
                    before = live_rss()
                send_passing_worker_1_by(scheme, model, version, timeout, group)
            grown = live_rss() - before
            assert grown < 64 << 20, f"the trainer grew by {grown >> 20} MiB in 4 sends that passed worker 1 by"
        finally:
            os.kill(group.procs[1].pid, signal.SIGCONT)
        # Worker 1 takes version 1, whose call ended: its answer reaches no one, and the trainer asks for it (asks that
        # timed out while it was stopped wait longer before the next: up to 5 s).
        assert wait_until(lambda: group.ask(1, "state")["policy"][0] == 1, deadline_after(30), 0.05)
        scheme.wait_async(timeout=15)
        assert scheme.acked_versions == {0: 6, 1: 1}
        optimizer_step(model, 7)
        scheme.send()
        assert [group.ask(w, "state")["policy"] for w in (0, 1)] == [(7, checksum(model))] * 2


def a_worker_whose_receiver_shut_down_in_a_world_the_caller_runs_is_named_gone(scheme, workers, timeout=2.0):
    """Your own RPC world: worker 1's program shuts its scheme down, and its agent stays in the world. The next
    send names worker 1 gone at once (``WorkerDiedError``: its mailbox answers that its receiver shut down), and
    each send after it; worker 0 holds every version. Before, the call landed in a mailbox made anew that nobody
    read and gave up at ``timeout``; every ask for its answer found "nothing yet": worker 1 was asked four times a
    second and named late, passed by, for as long as sends ran."""
    with world_the_caller_runs(scheme, workers, "tiny") as (model, group):
        scheme.timeout = timeout
        assert group.ask(1, "shutdown", "policy") == "shut down"
        for version in (1, 2):
            optimizer_step(model, version)
            began = time.monotonic()
            with pytest.raises(ws.WorkerDiedError, match="its receiver shut down") as info:
                scheme.send()
            assert info.value.worker_idx == 1 and time.monotonic() - began < timeout / 2
            assert group.ask(0, "state")["policy"] == (version, checksum(model))


def a_scheme_built_anew_after_the_workers_old_receiver_shut_down_takes_only_its_senders_calls(scheme, workers):
    a_scheme_built_anew_for_a_model_takes_only_its_own_senders_calls(scheme, workers, "receiver_first")


def a_scheme_built_anew_whose_sender_reaches_the_worker_first_takes_only_its_senders_calls(scheme, workers):
    a_scheme_built_anew_for_a_model_takes_only_its_own_senders_calls(scheme, workers, "sender_first")


def a_scheme_built_anew_for_a_model_takes_only_its_own_senders_calls(scheme, workers, order, timeout=1.0):
    """Your own RPC world: the trainer shuts its scheme down and builds one anew for the same model, and so does
    worker 1's program; the new receiver connects and holds each version the new sender sends. ``order``:
    ``receiver_first``: worker 1 shuts its scheme down first, and the old sender still sends it a version (named
    gone) and says goodbye after; ``sender_first``: the new sender's first call reaches worker 1 while its old
    receiver is still open. Before, the new receiver took what the old sender sent and said (its connect failed
    at once on the old goodbye, "the sender shut down", or took the old version, sent without its layout), or the
    old receiver took the new sender's first version and the new one waited for it in vain."""
    import threading

    from weightsync.core.timing import deadline_after, wait_until

    with world_the_caller_runs(scheme, workers, "tiny") as (model, group):
        scheme.timeout = timeout
        if order == "receiver_first":
            assert group.ask(1, "shutdown", "policy") == "shut down"
            optimizer_step(model, 1)
            with pytest.raises(ws.WorkerDiedError, match="its receiver shut down"):
                scheme.send()
        scheme.shutdown()  # (its goodbye reaches worker 1's process)
        fresh = ws.RPCWeightSyncScheme(timeout=10.0, connect_timeout=20.0)
        fresh.init_on_sender(model_id="policy", model=model, worker_names=["user-worker-1"])
        connect = threading.Thread(target=fresh.connect)
        try:
            connect.start()
            if order == "sender_first":  # (the new sender's first call waits beside the old receiver, still open)
                assert wait_until(lambda: group.ask(1, "waiting", "policy") == 1, deadline_after(15), 0.05)
            assert group.ask(1, "serve_anew", "policy", fresh, 0) == "connected"
            connect.join(30)
            assert not connect.is_alive() and fresh.acked_versions == {0: 0}
            for version in (1, 2):
                optimizer_step(model, 10 + version)
                fresh.send()
                assert group.ask(1, "state")["policy"] == (version, checksum(model))
        finally:
            connect.join(30)
            fresh.shutdown()


@contextlib.contextmanager
def world_the_caller_runs(scheme, workers, kind: str):
    """Your own RPC world on loopback: this process's agent (``user-trainer``) and two workers' that joined it
    (``user-worker-<i>``), serving ``scheme`` as the trainer pickled it after ``init_on_sender(worker_names=)``,
    connected. Yields the trainer's model and the workers; then shuts the scheme down and leaves the world with the
    workers (its graceful shutdown)."""
    import socket

    import torch.distributed.rpc as rpc

    from tests._workers import serves_in_a_world_it_joined

    with socket.socket() as probe:  # (a port for the world's store, on loopback)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = workers(serves_in_a_world_it_joined, 2, lambda i, conn: (port, 3, {"policy": kind}, i, conn))
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60, _transports=["uv"])
    rpc.init_rpc("user-trainer", rank=0, world_size=3, rpc_backend_options=options)
    try:
        model = build(kind)
        scheme.init_on_sender(model_id="policy", model=model, worker_names=["user-worker-0", "user-worker-1"])
        for cmd in group.cmds:
            cmd.send({"policy": scheme})
        scheme.connect()
        assert all(errors == {} for _, _, errors in (group.recv(0), group.recv(1)))
        yield model, group
    finally:
        scheme.shutdown()
        for cmd in group.cmds:
            cmd.send(("stop",))
        rpc.shutdown(graceful=True, timeout=60)
        group.stop()


def sends_that_do_not_wait_go_on_past_a_stopped_worker(scheme, workers, timeout=1.0, kind="flat2_8mb"):
    """``send_async`` with no wait: no wait finds a stopped worker late, and the versions on their way to it hold
    every staging buffer (``distributed``, ``rpc``: versions over 4 MiB) or slot (local) after two to four sends.
    The send whose staging it holds up for its whole wait finds it late: under ``drop`` it is dropped, under
    ``raise`` its engine sets aside what it holds (kept alive for it: a local slot leaves the pool, never written
    again) and the send goes on past it, naming it; the other worker holds every version. Once it runs again it
    reads what was on its way, and a local worker lets the slots that left the pool go once it acked past them.
    (Before, every send failed for every worker under both policies, named no worker, and ``drop`` never dropped
    it; then the local schemes' sends failed under ``raise`` until it resumed.)"""
    import os
    import signal

    from weightsync.core.timing import deadline_after, wait_until

    model = build(kind)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": kind})
    assert all(errors == {} for _, _, errors in ready)
    scheme.timeout = timeout
    local = isinstance(scheme, (ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme))
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        for version in range(1, 7):
            optimizer_step(model, version)
            try:
                scheme.send_async()
            except ws.SyncTimeoutError as exc:
                assert (exc.worker_idx, exc.model_id) == (1, "policy"), exc
            holds = (version, checksum(model))
            assert wait_until(lambda h=holds: group.ask(0, "state")["policy"] == h, deadline_after(10), 0.02), version
        if scheme.on_failure == "drop":
            assert list(scheme.stats()["dropped_workers"]) == [1]
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    if scheme.on_failure == "raise":  # once it runs again, it takes what is on its way, and the next send reaches it
        scheme.wait_async(timeout=30)
        optimizer_step(model, 7)
        scheme.send()
        assert [group.ask(w, "state")["policy"] for w in (0, 1)] == [(scheme.version, checksum(model))] * 2
        if local:  # (every slot that left the pool is let go: the worker maps the pool's slots, at most)
            pool = scheme._runtime.sending.engine.shared
            assert pool.left == [] and pool.aside == set()
            optimizer_step(model, 8)
            scheme.send()
            live = {slot.id for slot in pool.slots}
            assert set(group.ask(1, "slots", "policy")) <= live, (group.ask(1, "slots", "policy"), live)
    group.stop()
    scheme.shutdown()


def a_worker_dropped_alive_hears_it_was_dropped(scheme, workers):
    """``on_failure="drop"``: a worker hung past the timeout is dropped; once it runs again, it hears so
    (``ConnectionClosedError`` naming the drop), where an RPC worker waited for versions for good (RPC tells a
    process nothing of a peer no call of its waits on, and the store outlives the sender's agent) and a local one
    heard that its sender had shut down (it may rejoin). The other worker is served on."""
    import os
    import signal

    from weightsync.core.timing import deadline_after, wait_until

    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"})
    assert all(errors == {} for _, _, errors in ready)
    scheme.timeout = 2.0
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        optimizer_step(model, 1)
        scheme.send()  # worker 1 dropped
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    assert scheme.stats()["dropped_workers"].keys() == {1}
    heard: dict = {}
    assert wait_until(lambda: heard.update(group.ask(1, "closed")) or heard, deadline_after(20), 0.2), heard
    assert "the sender dropped this worker (" in heard["policy"], heard
    optimizer_step(model, 2)
    scheme.send()
    assert group.ask(0, "state")["policy"] == (2, checksum(model, scheme.strategy.extract_as))
    assert group.ask(0, "closed") == {}
    group.stop()
    scheme.shutdown()


def rpc_shutdown_waits_a_bounded_time_for_workers_that_stay(scheme, workers):
    """RPC: a clean shutdown is a barrier of the whole RPC world (so TensorPipe logs no closed connection). Workers
    that heard the trainer's goodbye but do not shut down (``serve`` goes on looping) hold the trainer's
    ``shutdown()`` up at most the barrier's two bounds, ``GRACEFUL_S`` each, then it stops on its own."""
    from weightsync.transports.rpc.session import GRACEFUL_S

    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"})
    assert all(errors == {} for _, _, errors in ready)
    began = time.monotonic()
    scheme.shutdown()
    took = time.monotonic() - began
    assert took <= 1.1 * 2 * GRACEFUL_S + 1.0, f"shutdown() took {took:.1f}s"
    assert scheme.state == "shut down"
    group.stop()


def rpc_shutdown_is_bounded_with_a_versions_call_still_out(scheme, workers):
    """RPC: a version's call has no bound of its own (the send's wait has one), and the world's barrier, TensorPipe's
    graceful shutdown, waits for every call still out with no bound either. A worker that heard the goodbye but
    still holds a call (its loop busy in its own code) leaves the trainer's ``shutdown()`` to stop on its own,
    within its bounds; the worker leaves too once its loop runs again."""
    from weightsync.transports.rpc.session import GRACEFUL_S

    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"})
    assert all(errors == {} for _, _, errors in ready)
    assert group.ask(1, "busy", 4 * GRACEFUL_S) == "busy"
    optimizer_step(model, 1)
    scheme.send_async()  # (worker 1's call stays out: its loop does not receive)
    began = time.monotonic()
    scheme.shutdown()
    took = time.monotonic() - began
    assert took <= 1.1 * 2 * GRACEFUL_S + 1.0, f"shutdown() took {took:.1f}s"
    assert group.ask(0, "state")["policy"][0] == 1
    group.stop(timeout=6 * GRACEFUL_S)


def mismatching_worker_is_refused_by_name(scheme, workers, device=""):
    """A worker whose model does not fit fails the rendez-vous by name; the other is connected and served."""
    model = build(on("tiny", device))
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    kinds = [on("tiny", device), on("tiny_wrong", device)]
    group = workers(serve, 2, lambda i, conn: ({"policy": scheme}, i, {"policy": kinds[i]}, conn))
    with pytest.raises(ws.ReceiverError) as info:
        scheme.connect()
    assert info.value.worker_idx == 1 and info.value.remote_type == "WeightMismatchError"
    assert "body.3.weight" in str(info.value)
    _, log, errors = group.recv(1)
    assert "WeightMismatchError" in errors["policy"]
    assert group.recv(0)[1] == [("policy", 0, checksum(model, scheme.strategy.extract_as))]
    optimizer_step(model, 1)
    scheme.send(worker_ids=[0])
    assert group.ask(0, "state")["policy"] == (1, checksum(model, scheme.strategy.extract_as))
    group.stop()
    scheme.shutdown()


def rounded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` whose floating weights went through ``dtype`` and back."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in ws.WeightStrategy().flat(out).values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype).to(tensor.dtype))
    return out


def wire_nbytes(flat: dict, wire: torch.dtype) -> int:
    """Bytes of ``flat`` with its floating tensors as ``wire`` (the integer ones as they are)."""
    return sum(t.numel() * (t.element_size() if not t.is_floating_point() else wire.itemsize) for t in flat.values())


def wire_dtype_halves_the_bytes_and_workers_hold_the_rounded_weights(scheme, workers):
    assert scheme.wire_dtype == "bfloat16", "run this body with a scheme built with wire_dtype='bfloat16'"
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    assert scheme.layout.weights_nbytes == wire_nbytes(scheme.strategy.flat(model), torch.bfloat16)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    for step in (1, 2):
        optimizer_step(model, step)
        scheme.send()
        expected = checksum(rounded(model, torch.bfloat16), scheme.strategy.extract_as)
        assert expected != checksum(model, scheme.strategy.extract_as)  # bf16 did round something
        for w in range(2):
            assert group.ask(w, "state")["policy"] == (step, expected), f"worker {w} after send {step}"
    group.stop()
    scheme.shutdown()


def corrupted_payload_is_refused_and_the_model_kept(scheme, workers):
    """With ``checksum=True``: a payload whose bytes do not match the sender's checksum is refused by every
    worker, named to the sender (an IntegrityError; for ``distributed``, whose bytes always carry a MAC under the
    run key, an AuthenticationError), and the workers keep the version they held."""
    from unittest import mock

    from weightsync.core.engine import SenderEngine
    from weightsync.transports.distributed.auth import PayloadMac

    assert scheme.checksum
    if type(scheme).backend_name == "distributed":
        damaged = mock.patch.object(PayloadMac, "hexdigest", return_value="0" * 32)  # the sender's side only
        refusal, said = "AuthenticationError", "keyed digest"
    else:
        damaged = mock.patch.object(SenderEngine, "digest", return_value="0" * 16)  # the sender's side only
        refusal, said = "IntegrityError", "failed its checksum"
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    try:
        group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
        expected = {}
        for step in (1, 2):
            optimizer_step(model, step)
            expected[step] = checksum(model, scheme.strategy.extract_as)
            if step == 1:
                scheme.send()
                continue
            # The sender announces a checksum its bytes do not have: as if they were damaged on the way.
            with damaged, pytest.raises(ws.WeightSyncError) as info:
                scheme.send()
        failures = getattr(info.value, "failures", None) or {info.value.worker_idx: info.value}
        assert sorted(failures) == [0, 1]
        for error in failures.values():
            assert isinstance(error, ws.ReceiverError) and error.remote_type == refusal, error
            assert said in error.remote_message and error.version == 2
        for w in (0, 1):
            assert group.ask(w, "state")["policy"] == (1, expected[1])
        scheme.send()  # the next send, checked and whole, goes through
        for w in (0, 1):
            assert group.ask(w, "state")["policy"] == (3, expected[2])
        group.stop()
    finally:
        scheme.shutdown()


def agents_listen_on_loopback_only(scheme, workers):
    """A sender on 127.0.0.1: its RPC agent and its workers' listen on loopback only, even where the host's
    name resolves to a network address (TensorPipe's own guess)."""
    import os
    import socket

    import psutil

    assert socket.gethostbyname(socket.gethostname()) != "127.0.0.1", "the case under test needs a host name "
    "that resolves to a network address"
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"})
    assert all(errors == {} for _, _, errors in ready)
    listening = {
        (pid, conn.laddr.ip)
        for pid in (os.getpid(), *(proc.pid for proc in group.procs))
        for conn in psutil.Process(pid).net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN
    }
    assert listening and {ip for _, ip in listening} == {"127.0.0.1"}, listening
    group.stop()
    scheme.shutdown()


def agent_environment_holds_until_the_agent_stopped(scheme, workers):
    """The interface variables TensorPipe and gloo read as the RPC agent starts are set before it starts and put
    back only once it stopped. Put back while its threads ran, they raced with a peer's call that starts a
    process: exec read the environment as another thread shifted it (``os.system`` failed with status 127)."""
    import os

    names = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    before = {name: os.environ.get(name) for name in names}
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"}, n=1)
    assert all(errors == {} for _, _, errors in ready)
    scheme.send()
    assert os.environ.get("TP_SOCKET_IFNAME") == (before["TP_SOCKET_IFNAME"] or "lo")
    group.stop()
    scheme.shutdown()
    assert {name: os.environ.get(name) for name in names} == before


def agents_sit_idle_between_sends(scheme, workers):
    """Between sends the RPC agents of the trainer and of its workers use no core: TensorPipe's shared-memory
    transport, which weightsync does not start, polls on a thread that never sleeps (a core per process)."""
    import os
    import time

    import psutil

    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=2)
    group, ready = start(workers, {"policy": scheme}, {"policy": "tiny"})
    assert all(errors == {} for _, _, errors in ready)
    scheme.send()
    procs = [psutil.Process(pid) for pid in (os.getpid(), *(proc.pid for proc in group.procs))]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(2.0)  # the idle time measured (nothing to wait for: the test is that nothing happens)
    used = [round(sum(p.cpu_times()[:2]) - b, 2) for p, b in zip(procs, before)]
    assert max(used) < 0.5, f"CPU seconds in 2 s idle, trainer then workers: {used}"  # a poller: about 2 each
    group.stop()
    scheme.shutdown()


def restarted_worker_is_refused_with_the_reason(scheme, workers):
    """A worker that died and is started again under its index is refused at once, with the reason; the
    others are still served."""
    import os
    import signal

    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    os.kill(group.procs[1].pid, signal.SIGKILL)
    group.procs[1].join(10)
    again = workers(serve, 1, lambda i, conn: ({"policy": scheme}, 1, {"policy": "tiny"}, conn))
    _, log, errors = again.recv(0)
    assert log == [] and "cannot take a rank back" in errors["policy"], errors
    optimizer_step(model, 1)
    scheme.send(worker_ids=[0])
    assert group.ask(0, "state")["policy"] == (1, checksum(model, scheme.strategy.extract_as))
    again.stop()
    group.stop()
    scheme.shutdown()


def the_goodbye_says_whether_the_world_leaves_whole(scheme, workers):
    """``rpc``: the sender's goodbye says whether every worker is alive. With one dropped, the others leave the world
    alone, as the sender does: they waited (5 s) for the world's barrier, which neither the dead worker nor the
    sender joined, and torch printed its failure at their exit ("Failed to respond to 'Shutdown Proceed'")."""
    import os
    import signal

    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    os.kill(group.procs[1].pid, signal.SIGKILL)
    group.procs[1].join(10)
    optimizer_step(model, 1)
    scheme.send()  # (worker 1 dropped)
    scheme.shutdown()
    from weightsync.core.timing import deadline_after, wait_until

    assert wait_until(lambda: group.ask(0, "closed"), deadline_after(30), 0.05)  # (heard at its next look)
    assert group.ask(0, "goodbye") == {"policy": (True, False)}
    group.stop()


def dropped_worker_is_named_and_the_others_go_on(scheme, workers, when="before", then_all=False):
    """``on_failure="drop"``: a worker SIGKILLed before a send (or as the update reaches it) is dropped, named
    in ``stats()``, and later sends go on to the other without waiting for it. ``then_all``: the other is killed
    too, and two more sends go to no one (the test reads what they logged)."""
    import os
    import signal
    import time

    assert scheme.on_failure == "drop"
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start(workers, {"policy": scheme}, {"policy": "tiny"})
    optimizer_step(model, 1)
    if when == "before":
        os.kill(group.procs[1].pid, signal.SIGKILL)
        group.procs[1].join(10)
    else:  # the worker dies as the update reaches it, before applying it
        assert group.ask(1, "die_on_next_update", "policy") == "armed"
    began = time.monotonic()
    scheme.send()
    assert time.monotonic() - began < scheme.timeout
    group.procs[1].join(10)
    extract = scheme.strategy.extract_as
    assert group.ask(0, "state")["policy"] == (1, checksum(model, extract))
    dropped = scheme.stats()["dropped_workers"]
    assert list(dropped) == [1] and "WorkerDiedError" in dropped[1]
    assert scheme.last_send.failed.keys() == {1} and 0 in scheme.last_send.acks
    for step in (2, 3):  # later sends skip the dropped worker quietly
        optimizer_step(model, step)
        scheme.send()
        assert group.ask(0, "state")["policy"] == (step, checksum(model, extract))
    assert scheme.acked_versions[0] == 3
    if then_all:
        os.kill(group.procs[0].pid, signal.SIGKILL)
        group.procs[0].join(10)
        for step in (4, 5):
            optimizer_step(model, step)
            scheme.send()
        assert list(scheme.stats()["dropped_workers"]) == [1, 0]
    group.stop()
    scheme.shutdown()


def a_worker_that_joins_then_dies_costs_connect_its_timeout(scheme, workers):
    """A worker that joined the world's store and died before the world formed: connect() ends within its
    connect_timeout (the gloo group init_rpc forms had torch's default timeout, about 24.8 days)."""
    import subprocess
    import sys

    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    handoff = scheme.receiver_config(0)["connection"]
    joins = (
        "import datetime, sys, torch.distributed as dist\n"
        "store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,\n"
        "                      timeout=datetime.timedelta(seconds=10))\n"
        "store.add('weightsync-joined/1', 1)\n"
    )
    subprocess.run(
        [sys.executable, "-c", joins, handoff["master_addr"], str(handoff["master_port"])], check=True, timeout=60
    )
    began = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="did not form"):
        scheme.connect()
    assert within_its_timeout(time.monotonic() - began, scheme.connect_timeout)
    scheme.shutdown()


def _dies_once_its_agent_runs(config, trainers_agent_runs) -> None:
    """A worker whose process ends inside init_rpc, once its agent and the trainer's started (where the world
    gathers)."""
    import os

    import torch.distributed.rpc.api as api

    def dies(*args, **kwargs):
        trainers_agent_runs.wait(60)
        os._exit(3)

    api._all_gather = dies
    scheme = ws.from_config(config, allow_store_peers_to_run_code=True)
    scheme.init_on_receiver(model=build("tiny"))
    scheme.connect()


def an_agent_whose_world_did_not_form_is_stopped(scheme, workers):
    """The trainer's agent started and the world did not form (its worker died in init_rpc): the agent is stopped
    with the failure (it ran on, serving calls, after shutdown()), the environment set for it restored, and the
    next scheme is told the process ran its RPC world. (The worker dies once the trainer's agent runs: dead
    before, under load, it failed the trainer's init_rpc ahead of its agent, which leaves the process free to
    run a world.)"""
    import multiprocessing
    import os

    import torch.distributed.rpc.api as api

    from weightsync.transports.rpc import session

    before = os.environ.get("TP_SOCKET_IFNAME")
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    context = multiprocessing.get_context("spawn")
    runs = context.Event()
    worker = context.Process(target=_dies_once_its_agent_runs, args=(scheme.receiver_config(0), runs))
    gather = api._all_gather

    def gathers(*args, **kwargs):  # (the trainer's agent runs by now)
        runs.set()
        return gather(*args, **kwargs)

    api._all_gather = gathers
    worker.start()
    try:
        with pytest.raises(ws.SyncTimeoutError, match="did not form"):
            scheme.connect()
    finally:
        api._all_gather = gather
        worker.join(60)
    assert not session.agent_running() and os.environ.get("TP_SOCKET_IFNAME") == before
    scheme.shutdown()
    with pytest.raises(ws.ConfigurationError, match="can run once per process"):
        ws.RPCWeightSyncScheme(allow_store_peers_to_run_code=True).init_on_sender(
            model_id="next", model=build("tiny"), num_workers=1
        )


def connect_waits_its_timeout_for_absent_workers(scheme, workers):
    """No worker comes: connect() ends within its connect_timeout (0.9 T to 1.1 T + 1 s), naming them."""
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=2)
    began = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="worker 0, worker 1 never joined"):
        scheme.connect()
    assert within_its_timeout(time.monotonic() - began, scheme.connect_timeout)
    scheme.shutdown()
