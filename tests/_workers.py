"""Worker programs the tests run in real child processes (importable by spawn/forkserver)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import signal
import threading
import traceback
from multiprocessing.connection import wait

import torch
from torch import nn

import weightsync as ws


class Recurrent(nn.Module):
    """An LSTM over an observation (a sequence of one step), a linear head, and an offset kept as a non-persistent
    buffer: ``nn.LSTM`` keeps weak references to its weights, so torch cannot swap them in place, and
    ``state_dict`` leaves the buffer out."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.rnn = nn.LSTM(2, 4, batch_first=True)
        self.head = nn.Linear(4, 1)
        self.register_buffer("offset", torch.tensor([offset]), persistent=False)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(observation.unsqueeze(-2))[0][..., -1, :]) + self.offset


class TinyNet(nn.Module):
    """Parameters, a BatchNorm (persistent buffers, an int64 one) and a non-persistent buffer."""

    def __init__(self, hidden: int = 8, out: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, out))
        self.register_buffer("scale", torch.ones(out), persistent=False)


class Holder:
    """A context in the TorchRL style: the model sits at ``env.transform[0].module``."""

    class _T:
        def __init__(self, module):
            self.module = module

    class _Env:
        def __init__(self, module):
            self.transform = [Holder._T(module)]

    def __init__(self, module):
        self.env = Holder._Env(module)


def build(kind: str) -> nn.Module:
    if "@" in kind:  # "tiny@cuda:1": that model on that GPU, which becomes this process's current device
        kind, device = kind.split("@")
        torch.cuda.set_device(torch.device(device))
        return build(kind).to(device)
    if kind == "tiny":
        return TinyNet()
    if kind == "tiny_shared":  # in shared memory, as a worker that shares its model with processes of its own
        return TinyNet().share_memory()
    if kind == "tiny_wrong":  # same keys, one different shape
        return TinyNet(out=3)
    if kind == "value":
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    if kind == "flat4":  # four 64k-float tensors: large enough for a torn read to be visible
        return nn.ParameterList([nn.Parameter(torch.zeros(65536)) for _ in range(4)])
    if kind == "flat2_8mb":  # two 1M-float tensors (8 MiB): over the size distributed stages in its buffers
        return nn.ParameterList([nn.Parameter(torch.zeros(1 << 20)) for _ in range(2)])
    if kind == "flat4_64mb":  # four 4M-float tensors (64 MiB): a GPU copy long enough for a missing fence to show
        return nn.ParameterList([nn.Parameter(torch.zeros(1 << 22)) for _ in range(4)])
    raise ValueError(kind)


def checksum(model, extract_as: str = "tensordict") -> str:
    digest = hashlib.sha256()
    for key, tensor in sorted(ws.WeightStrategy(extract_as).flat(model).items()):
        digest.update(key.encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _scramble(model: nn.Module) -> None:
    with torch.no_grad():
        for tensor in ws.WeightStrategy("tensordict").flat(model).values():
            tensor.fill_(-7)


def leftovers() -> dict:
    """What this process still holds of weightsync after shutdown: threads, slot descriptors, slot mappings."""
    gc.collect()
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if _readable(fd)]
    with open("/proc/self/maps") as maps:
        mapped = sum("memfd:weightsync" in line for line in maps)
    return {
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("weightsync")],
        "memfds": sum("memfd:weightsync" in f for f in fds),
        "maps": mapped,
    }


def _readable(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
        return True
    except OSError:
        return False


def serve(schemes: dict, worker_idx: int, kinds: dict, cmd, use_facade: bool = False, path_context: bool = False):
    """Connect every scheme, then loop: apply updates as they arrive, log (model, version, checksum), obey ``cmd``."""
    try:
        models = {mid: build(kind) for mid, kind in kinds.items()}
        for model in models.values():
            _scramble(model)
        for mid, scheme in schemes.items():
            if path_context:
                scheme.init_on_worker(
                    model_id="env.transform[0].module", context=Holder(models[mid]), worker_idx=worker_idx
                )
            else:
                scheme.init_on_receiver(model_id=mid, model=models[mid], worker_idx=worker_idx)
        errors = {}
        for mid, scheme in schemes.items():
            try:
                scheme.connect()
            except ws.WeightSyncError as exc:
                errors[mid] = f"{type(exc).__name__}: {exc}"
        extract = {mid: s.strategy.extract_as for mid, s in schemes.items()}
        log = [(mid, s.version, checksum(models[mid], extract[mid])) for mid, s in schemes.items() if mid not in errors]
        cmd.send(("ready", log, errors))
        log = []
        closed: dict[str, str] = {}  # why each model's sender ended, as the worker heard it
        channels = [  # local schemes: wake up when the sender writes; other engines are polled
            s.receiver_transport.channel.connection
            for s in schemes.values()
            if hasattr(s.receiver_transport, "channel")
        ]
        # One network model and no thread of its own: wait in its receive(), which its engine wakes as an update
        # lands, instead of looking every 50 ms (a send to this worker would wait for the look: 25 ms on average).
        live = [s for mid, s in schemes.items() if mid not in errors]
        block = 0.05 if not channels and len(live) == 1 and not getattr(live[0], "background_thread", False) else 0.0
        while True:
            ready = wait([cmd, *channels], timeout=0.05 - block)
            for mid, scheme in schemes.items():
                if mid in errors:
                    continue
                lock = getattr(scheme, "weights_lock", None) or threading.RLock()
                with lock:  # a background thread may apply the next version meanwhile
                    try:
                        if use_facade:
                            got = scheme.get_receiver().receive(block)
                        else:
                            got = scheme.receive(block) is not None
                    except ws.ConnectionClosedError as exc:
                        closed.setdefault(mid, str(exc))
                        channels = []
                        continue
                    except ws.WeightSyncError as exc:
                        log.append((mid, "error", f"{type(exc).__name__}: {exc}"))
                        continue
                    if got:
                        log.append((mid, scheme.version, checksum(models[mid], extract[mid])))
            if cmd in ready or cmd.poll():
                op, *args = cmd.recv()
                if op == "log":
                    cmd.send(log)
                    log = []
                elif op == "state":
                    state = {}
                    for mid, s in schemes.items():
                        with getattr(s, "weights_lock", None) or threading.RLock():
                            state[mid] = (s.version, checksum(models[mid], extract[mid]))
                    cmd.send(state)
                elif op == "closed":  # why each model's sender ended, as this worker heard it
                    cmd.send(closed)
                elif op == "goodbye":  # rpc: whether each sender's goodbye came, and said the world leaves whole
                    boxes = {mid: getattr(s._runtime.receiving.engine, "mailbox", None) for mid, s in schemes.items()}
                    cmd.send({mid: (box.closed, box.whole) for mid, box in boxes.items() if box is not None})
                elif op == "storage":  # where the model's first parameter lives now, and its storage object
                    storage = next(models[args[0]].parameters()).untyped_storage()
                    cmd.send((storage.data_ptr(), storage._cdata))
                elif op == "scribble":  # the worker's program writes into its model (undone by the next update)
                    with getattr(schemes[args[0]], "weights_lock", None) or threading.RLock(), torch.no_grad():
                        list(models[args[0]].parameters())[-1].add_(100.0)
                    cmd.send("written")
                elif op == "break_model":  # the worker's model changes shape after connect
                    models[args[0]].body[3] = nn.Linear(8, 3)
                    cmd.send("broken")
                elif op == "pinned":  # whether the host slots this worker copies from are page-locked
                    transport = schemes[args[0]].receiver_transport
                    cmd.send([pin.pinned for pin in transport._pins.values()])
                elif op == "slots":  # the slots this worker maps now (local schemes)
                    cmd.send(sorted(schemes[args[0]].receiver_transport.slot_buffers))
                elif op == "busy":  # the worker's loop is busy in its own code (its agent runs) until the test's
                    cmd.send("busy")  # next command, at most args[0] seconds
                    cmd.poll(args[0])
                elif op == "shutdown":  # the worker's program shuts one scheme down and goes on (its RPC agent too)
                    schemes[args[0]].shutdown()
                    errors[args[0]] = "shut down"
                    block = 0.0
                    cmd.send("shut down")
                elif op == "serve_anew":  # the worker's program builds a model's scheme anew (its sender's, pickled)
                    mid, fresh, idx = args
                    schemes[mid].shutdown()  # (the old one first: one receiver of a model at a time)
                    fresh.init_on_receiver(model_id=mid, model=models[mid], worker_idx=idx)
                    try:
                        fresh.connect()
                    except ws.WeightSyncError as exc:
                        errors[mid] = said = f"{type(exc).__name__}: {exc}"  # (the old one is shut down)
                        cmd.send(said)
                        continue
                    schemes[mid], extract[mid] = fresh, fresh.strategy.extract_as
                    errors.pop(mid, None)
                    cmd.send("connected")
                elif op == "waiting":  # rpc: how many calls for a model wait for a receiver of their sender
                    from weightsync.transports.rpc import mailbox

                    cmd.send(sum(len(box.queue) for box in mailbox._WAITING.get(args[0], {}).values()))
                elif op == "close_channel":  # the worker's end of the transport goes away; the process lives
                    schemes[args[0]].receiver_transport.close()
                    cmd.send("closed")
                elif op == "die_on_next_update":
                    scheme = schemes[args[0]]
                    cmd.send("armed")
                    if scheme.receiver_transport.poll(timeout=60):
                        os.kill(os.getpid(), signal.SIGKILL)
                elif op == "stop":
                    for scheme in schemes.values():
                        scheme.shutdown()
                    cmd.send(("stopped", log, leftovers()))
                    return
    except Exception:  # noqa: BLE001 - shown by the test that reads it
        cmd.send(("crashed", traceback.format_exc()))


def serves_in_a_world_it_joined(port: int, world_size: int, kinds: dict, worker_idx: int, cmd) -> None:
    """A worker whose own program runs RPC (``rpc.init_rpc`` before weightsync, the trainer's scheme given
    ``worker_names=``): join that world on loopback, take the schemes the trainer pickled after ``init_on_sender``
    from ``cmd``, :func:`serve` them, then leave the world with the trainer (its graceful shutdown)."""
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60, _transports=["uv"])
    rpc.init_rpc(f"user-worker-{worker_idx}", rank=worker_idx + 1, world_size=world_size, rpc_backend_options=options)
    try:
        serve(cmd.recv(), worker_idx, kinds, cmd)
    finally:
        rpc.shutdown(graceful=True, timeout=60)


def torn_reader(scheme, worker_idx: int, kind: str, cmd, lock_reads: bool = False):
    """Read the model continuously; count reads that see a mix of two versions."""
    model = build(kind)
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker_idx)
    scheme.connect()
    cmd.send("ready")
    rss_start = _rss()
    reads = torn = applied = 0
    tensors = lambda: list(ws.WeightStrategy().flat(model).values())  # noqa: E731
    while not cmd.poll():
        try:
            if scheme.receive(0.0) is not None:
                applied += 1
        except ws.ConnectionClosedError:
            break
        if lock_reads:
            with scheme.weights_lock:
                values = {float(t.min()) for t in tensors()} | {float(t.max()) for t in tensors()}
        else:
            values = {float(t.min()) for t in tensors()} | {float(t.max()) for t in tensors()}
        reads += 1
        torn += len(values) != 1
    cmd.recv()
    rss_end = _rss()
    scheme.shutdown()
    cmd.send({"reads": reads, "torn": torn, "applied": applied, "version": scheme.version, "rss": (rss_start, rss_end)})


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def live_rss() -> int:
    """This process's resident memory once what it freed went back to the system (glibc's ``malloc_trim``): what
    is still held, without the heap's leftovers of temporaries freed."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # (not glibc: the heap's leftovers count too)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss()


def connect_pair(sender, receiver, timeout: float = 20.0) -> None:
    """Connect a sender and an in-process receiver: the receiver joins from a thread while the sender waits."""
    connect_all(sender, [receiver], timeout)


def connect_all(sender, receivers, timeout: float = 20.0) -> None:
    """Connect a sender and in-process receivers: each joins from a thread of its own while the sender waits."""
    errors = []

    def join(receiver):
        try:
            receiver.connect()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    joiners = [threading.Thread(target=join, args=(receiver,)) for receiver in receivers]
    for joiner in joiners:
        joiner.start()
    try:
        sender.connect()
    finally:
        for joiner in joiners:
            joiner.join(timeout)
    if errors:
        raise errors[0]


def in_process_receiver(sender, model, worker_idx: int = 0):
    """A receiver in this process for ``sender`` (pickled, as a worker would get it), connected."""
    import pickle

    receiver = pickle.loads(pickle.dumps(sender))
    receiver.init_on_receiver(model_id=sender.model_id, model=model, worker_idx=worker_idx)
    connect_pair(sender, receiver)
    return receiver


def until_sender_dies(cfg: dict, report: str, kind: str = "tiny") -> None:
    """A worker built from a receiver config: apply updates until the sender goes away, then shut down
    and write what it noticed (and what it still holds) to ``report``."""
    import json
    import time

    from weightsync.config import from_config

    # The trainer that wrote cfg is this process's parent (and opted in to what an rpc world allows).
    scheme = from_config(cfg, allow_pickle=True, allow_store_peers_to_run_code=True)
    scheme.init_on_receiver(model=build(kind))
    scheme.connect()
    versions, longest = [scheme.version], 0.0  # the longest a receive(timeout=0.05) took
    while True:
        began = time.monotonic()
        try:
            if scheme.receive(timeout=0.05) is not None:
                versions.append(scheme.version)
        except ws.ConnectionClosedError:
            noticed = time.time()
            break
        longest = max(longest, time.monotonic() - began)
    scheme.shutdown()
    with open(report, "w") as out:
        json.dump({"noticed": noticed, "versions": versions, "longest": longest, "leftovers": leftovers()}, out)


def doomed_trainer(name: str, n: int, reports: list, cmd, device: str = "", line: bool = True) -> None:
    """A trainer that starts ``n`` workers from receiver configs, sends two versions, reports, then waits
    (the test kills it). ``device``: the GPU the trainer's and the workers' models are on (``""``: the CPU).
    Told ``"send"`` instead, it sends a third version and shuts down. ``line=False``: its ``distributed``
    workers (forked) dial no line, as a rejoined worker has none: they are announced to in the store."""
    import multiprocessing as mp

    if not line:
        from weightsync.transports.distributed.receiver import DistributedReceiver

        DistributedReceiver._dial = lambda self, store, deadline: None  # type: ignore[method-assign]
    opt_in = {"allow_store_peers_to_run_code": True} if name == "rpc" else {}  # what an rpc world allows
    procs = []
    try:
        scheme = ws.WeightSyncScheme.from_backend(name, timeout=5, connect_timeout=60, **opt_in)
        kind = f"tiny@{device}" if device else "tiny"
        model = build(kind)
        scheme.init_on_sender(model_id="policy", model=model, num_workers=n)
        configs = [scheme.receiver_config(w) for w in range(n)]
        start = mp.get_context("spawn" if device else "fork")  # CUDA, once started here, does not survive a fork
        procs = [start.Process(target=until_sender_dies, args=(configs[w], reports[w], kind)) for w in range(n)]
        for proc in procs:
            proc.start()
        scheme.connect()
        for step in (1, 2):
            with torch.no_grad():
                next(model.parameters()).add_(step)
            scheme.send()
    except Exception:  # noqa: BLE001 - shown by the test (multiprocessing prints it only once its workers exit)
        cmd.send(("crashed", traceback.format_exc()))
        for proc in procs:
            proc.kill()
        return
    cmd.send(([p.pid for p in procs], configs[0]["connection"].get("authkey_file")))
    # The test kills this process; a message (or the test's end closing the pipe) ends it too.
    if cmd.poll(600) and cmd.recv() == "send":
        with torch.no_grad():
            next(model.parameters()).add_(3)
        scheme.send()
        scheme.shutdown()


def fails_at_start(*args) -> None:
    """A worker process that fails before it reaches the scheme (as a spawned child of a script without a
    ``__main__`` guard does)."""
    raise SystemExit(3)


def _fork_idle() -> int:
    """Fork a child that holds every descriptor of this process for a minute (the test kills it); its pid."""
    import time

    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    return child


def forks_then_serves(cfg: dict, pipe) -> None:
    """A worker that forks a child once connected (as an environment started with ``fork`` would be: it inherits
    the worker's end of its channel, and outlives it), says the child's pid, then serves until killed."""
    from weightsync.config import from_config

    scheme = from_config(cfg)
    scheme.init_on_receiver(model=build("tiny"))
    scheme.connect()
    pipe.send(_fork_idle())
    while True:
        scheme.receive(timeout=0.1)


def trainer_that_forks(name: str, pipe) -> None:
    """A trainer that hands the test a worker's receiver config, connects it, forks a helper (which inherits the
    trainer's end of every channel), says the helper's pid, and waits to be killed."""
    scheme = ws.WeightSyncScheme.from_backend(name, timeout=2.0, connect_timeout=60)
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    pipe.send(scheme.receiver_config(0))
    scheme.connect()
    pipe.send(_fork_idle())
    pipe.poll(600)


def idle_trainer(name: str, cmd) -> None:
    """A trainer that serves its store (``init_on_sender``), hands over a worker's config, and waits (the test
    stops it, then kills it)."""
    opt_in = {"allow_store_peers_to_run_code": True} if name == "rpc" else {}
    scheme = ws.WeightSyncScheme.from_backend(name, timeout=2, connect_timeout=3, **opt_in)
    scheme.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    cmd.send(scheme.receiver_config(0))
    cmd.poll(600)


def commanded_trainer(cmd, kind: str = "tiny", **options) -> None:
    """A ``distributed`` trainer of a ``kind`` model with one worker, dropped when it does not ack in time
    (``options``: the scheme's, ``master_port=`` naming a store a job serves, which outlives the trainer). It hands
    over the worker's config and connects, then answers each command with (its version, the workers it dropped,
    the versions acked, its model's checksum, the rejoins it admitted):

    - ``"send"``: steps its model and sends (waiting for the ack when ``sync`` is off);
    - ``"drop"``: steps and sends without waiting until it dropped the worker (at most 60 s);
    - ``("leave", n)``: steps and sends ``n`` times without waiting (the versions pile up on the worker's line);
    - ``"look"``: sends nothing.

    ``"shut down"`` shuts the scheme down and answers ``"down"``; anything else shuts it down too (the test may
    kill it instead). A failure is answered with ``("crashed", traceback)``."""
    import time

    try:
        sync = options.get("sync", True)
        scheme = ws.DistributedWeightSyncScheme(connect_timeout=60, on_failure="drop", **options)
        model = build(kind)
        scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
        cmd.send(scheme.receiver_config(0))
        scheme.connect()
        op = None

        def step_and_send(wait: bool) -> None:
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            try:
                scheme.send()
                if wait and not sync:
                    scheme.wait_async()
            except ws.SyncTimeoutError:  # (its buffers are all on the worker's line: nothing sent)
                pass

        while cmd.poll(600) and ((op := cmd.recv()) in ("send", "drop", "look") or op[0] == "leave"):
            ends = time.monotonic() + 60
            if op == "send":
                step_and_send(wait=True)
            while op == "drop" and not scheme.stats()["dropped_workers"] and time.monotonic() < ends:
                step_and_send(wait=False)
            for _ in range(op[1] if op[0] == "leave" else 0):
                step_and_send(wait=False)
            stats = scheme.stats()
            said = (scheme.version, sorted(stats["dropped_workers"]), scheme.acked_versions, checksum(model))
            cmd.send((*said, stats["rejoins"]))
        scheme.shutdown()
        if op == "shut down":
            cmd.send("down")
    except Exception:  # noqa: BLE001 - shown by the test
        cmd.send(("crashed", traceback.format_exc()))


def ask(cmd, op) -> tuple:
    """The test's side of :func:`commanded_trainer`: its answer to ``op``."""
    cmd.send(op)
    assert cmd.poll(90), f"the trainer did not answer {op!r}"
    answer = cmd.recv()
    assert answer[0] != "crashed", f"the trainer failed:\n{answer[1]}"
    return answer


def worker_of(cmd, model: nn.Module):
    """The worker :func:`commanded_trainer` hands its config to over ``cmd``, made from that config with ``model``,
    connected, and holding version 1 (the trainer's first ``"send"``, received on a thread)."""
    from weightsync.config import from_config

    assert cmd.poll(60), "the trainer did not hand over a config"
    cfg = cmd.recv()
    assert isinstance(cfg, dict), f"the trainer failed:\n{cfg[1]}"
    worker = from_config(cfg)
    try:
        worker.init_on_receiver(model=model)
        worker.connect()
        receiving = threading.Thread(target=worker.receive, kwargs={"timeout": 30}, daemon=True)
        receiving.start()
        assert ask(cmd, "send")[:3] == (1, [], {0: 1})
        receiving.join(30)
        assert worker.version == 1
    except BaseException:
        worker.shutdown()
        raise
    return worker


def joins_a_stopped_trainer(name: str, cfg: dict, trainer: int, when: str, out) -> None:
    """A worker that joins ``trainer`` and stops it with ``SIGSTOP``: before its dial of the trainer's store
    (``when="dial"``), or just after it (``"after"``). Reports (its error's type or ``None``, seconds taken)."""
    import importlib
    import time

    from weightsync.config import from_config

    module = importlib.import_module(
        "weightsync.transports.rpc.session" if name == "rpc" else "weightsync.transports.distributed.receiver"
    )
    dial = module.dial_store

    def stopping(*args, **kwargs):
        if when == "dial":
            os.kill(trainer, signal.SIGSTOP)
        found = dial(*args, **kwargs)
        if when == "after":
            os.kill(trainer, signal.SIGSTOP)
        return found

    module.dial_store = stopping
    scheme = from_config(cfg, allow_store_peers_to_run_code=True)
    scheme.init_on_receiver(model=build("tiny"))
    began, error = time.monotonic(), None
    try:
        scheme.connect()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = type(exc).__name__
    out.send((error, time.monotonic() - began))


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """Stop process ``pid`` (``SIGSTOP``) and wait until each of its threads is stopped. ``kill`` returns before a
    busy host has stopped them: beside two busy processes on 2 cores, a TCP store's process sent ``SIGSTOP`` still
    answered the next call 8 times in 40."""
    from weightsync.core.timing import deadline_after, wait_until

    def states() -> list[str]:
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    found.append(stat.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # (a thread that ended meanwhile)
                pass
        return found

    os.kill(pid, signal.SIGSTOP)
    if not wait_until(lambda: all(state in "tT" for state in states()), deadline_after(timeout), 0.01):
        raise TimeoutError(f"process {pid} did not stop within {timeout}s")


def store_in_a_child():
    """A TCP store served by a child process of its own (listening on every address, until killed), for a test
    to stop: (the child, the store's port)."""
    import subprocess
    import sys

    serve = (
        "import datetime, sys, torch.distributed as d\n"
        "wait = datetime.timedelta(seconds=60)\n"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=wait)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        return server, int(server.stdout.readline())  # type: ignore[union-attr]
    except BaseException:
        server.kill()
        server.wait(10)
        raise
