"""Fixtures: real worker processes, the local schemes to run each test body over, leak checks."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import tempfile
import threading

import psutil
import pytest

import weightsync as ws

# OpenMP's idle threads sleep instead of spinning after each parallel region (read when torch loads, which
# `import weightsync` does not do; inherited by every process the tests start): on 2 cores a spinning thread takes
# the core another process of the test needs. tests/test_local_schemes.py and tests/test_faults.py took 97 to 108 s
# with it against 123 to 131 s without (two runs each, alternating). A value set by whoever runs the suite wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray starts its workers (actors, tasks) at niceness 15: beside two busy processes of the test run on 2 cores, a
# Ray test's actors had about 5% of a core, and a vLLM engine in an actor did not start within its connect bound
# of 120 s (the CI of stop 83; the same test took 64 s when its neighbours were idle). Every process this test run
# starts runs at one priority; a value set by whoever runs the suite wins (read by each Ray cluster it starts).
os.environ.setdefault("RAY_worker_niceness", "0")

_CLONE_NEWNS = 0x00020000

#: Groups of tests that run one after the other in one test process (``--dist loadgroup``) and take long:
#: collected first, so that their process starts on them while the others take everything else.
LONG_GROUPS = ("vllm",)


#: Set on a test of an ``xdist_group`` whose id lacks the group under ``--dist loadgroup``.
_UNGROUPED = pytest.StashKey[bool]()


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which adds each test's group to its id
def pytest_collection_modifyitems(config, items):
    def long(item) -> bool:
        return any(m.args[:1] in [(g,) for g in LONG_GROUPS] for m in item.iter_markers("xdist_group"))

    items[:] = sorted(items, key=lambda item: not long(item))  # (stable: each side keeps its order)
    # Under `--dist loadgroup` the tests of a group carry its name in their ids: that is all pytest-xdist's
    # scheduler groups by. A pytest that ignores the ids pytest-xdist rewrites spreads a group over the test
    # processes, each starting the engines its module shares: such tests fail at once, saying why.
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        for item in items:
            if any(item.iter_markers("xdist_group")) and "@" not in item.nodeid:
                item.stash[_UNGROUPED] = True


def pytest_runtest_setup(item):
    if item.stash.get(_UNGROUPED, False):
        pytest.fail(
            f"--dist loadgroup is not in effect: this test of an xdist_group lacks it in its id; pytest "
            f"{pytest.__version__} and this pytest-xdist do not fit together (pyproject.toml pins pytest)",
            pytrace=False,
        )


def _private_dev_shm() -> bool:
    """Give this test run a ``/dev/shm`` of its own: a tmpfs in a private mount namespace, which every process
    the tests start inherits. What appears there was made by this run, so a leak check judges only this
    run's processes, never another program's files. Needs root; ``False`` where it cannot be had."""
    if os.geteuid() != 0 or ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNS) != 0:
        return False
    try:
        subprocess.run(["mount", "--make-rprivate", "/"], check=True, timeout=10, capture_output=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"], check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


# Made before any test process or thread exists (unshare refuses a process with threads).
PRIVATE_SHM = _private_dev_shm()

# tqdm's write lock, made at a process's first bar (transformers' writes draw one), is a multiprocessing RLock,
# whose named semaphore stays in /dev/shm for the process's life once a test's collector set the start method to
# spawn: it was reported by whichever test drew the first bar after that. The test process's bars take a thread
# lock instead (made here, it fixes no start method).
with contextlib.suppress(ImportError):
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())

# vLLM's engines leave their IPC sockets (files named by a uuid) in its VLLM_RPC_BASE_PATH, the temp directory by
# default: this run's engines (and the processes of its doc blocks and examples) put them in a folder of its own,
# removed when the run ends.
if "VLLM_RPC_BASE_PATH" not in os.environ:
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="weightsync-tests-vllm-")
    atexit.register(shutil.rmtree, os.environ["VLLM_RPC_BASE_PATH"], True)

# Workers fork from a server that has already imported torch: a worker starts in milliseconds instead of seconds,
# and still gets its scheme pickled like a spawned one.
PRELOAD = ["torch", "tensordict", "weightsync", "tests._workers"]
_CTX = mp.get_context("forkserver")
# The test process's server also compiles the deltas' loops (tests/_compiled.py: 2 s once, 0.6 s saved a worker);
# the server an RPC test's trainer process starts for its own workers is a fork of that process, and has them too
# (_rpc_trainer.py).
_CTX.set_forkserver_preload([*PRELOAD, "tests._compiled"])

LOCAL_SCHEMES = {
    "multiprocess": lambda **kw: ws.MultiProcessWeightSyncScheme(timeout=20, connect_timeout=60, **kw),
    "shared_mem": lambda **kw: ws.SharedMemWeightSyncScheme(timeout=20, connect_timeout=60, **kw),
    "multiprocess-thread": lambda **kw: ws.MultiProcessWeightSyncScheme(
        timeout=20, connect_timeout=60, background_thread=True, **kw
    ),
    "shared_mem-per_worker": lambda **kw: ws.SharedMemWeightSyncScheme(
        timeout=20, connect_timeout=60, per_worker_weights=True, **kw
    ),
}
# A torch.distributed group on loopback: the shared test bodies run over it as well (RPC runs them in
# trainer processes of their own: tests/test_rpc.py).
ENGINE_SCHEMES = {
    "distributed-gloo": lambda **kw: ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60, **kw),
}
SCHEMES = {**LOCAL_SCHEMES, **ENGINE_SCHEMES}


@pytest.fixture
def ctx():
    return _CTX


@pytest.fixture(params=sorted(SCHEMES))
def make_scheme(request):
    """A factory for the scheme under test (every test body runs over the local and torch.distributed ones)."""
    return SCHEMES[request.param]


def _memfds(pid: int) -> int:
    try:
        return sum("memfd:weightsync" in os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _weightsync_maps(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return sum("memfd:weightsync" in line for line in maps)
    except OSError:
        return 0


def is_ray_cluster(proc: psutil.Process) -> bool:
    """Processes of a Ray cluster a test module started on purpose (it checks they end with ray.shutdown())."""
    try:
        # Ray's own programs: its binaries, and Python scripts under ray/. Not any process whose command line
        # merely mentions a Ray path: importing ray puts ray/thirdparty_files on sys.path, which the
        # multiprocessing forkserver carries in its command line, and that server must outlive the Ray tests.
        return proc.name().startswith(("ray::", "raylet", "gcs_server")) or any(
            arg.endswith(".py") and "/site-packages/ray/" in arg for arg in proc.cmdline()
        )
    except psutil.Error:
        return False


@contextlib.contextmanager
def local_ray_cluster(**init_kwargs):
    """A Ray cluster of this test run on loopback only, shut down at the end; its stragglers ended, bounded."""
    import ray

    from tests._netns import loopback_only_network
    from weightsync.transports.ray.cluster import private_ray_files

    with loopback_only_network():
        # ("local": a new cluster; with no address, Ray joins the one a file any user can write names; its files
        # where only this user may enter: Ray's default, /tmp/ray, is open to every user)
        with private_ray_files() as files:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=files,
                     **init_kwargs)  # fmt: skip
        try:
            assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
            yield
        finally:
            ray.shutdown()
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if is_ray_cluster(p) and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    # Ray's workers exit on their own after shutdown, at their own pace; end any straggler, bounded in time.
    _, alive = psutil.wait_procs(left, timeout=15)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=10)
    shutil.rmtree(os.path.dirname(files), ignore_errors=True)


def kill_actor(actor, **kill_kwargs) -> None:
    """``ray.kill(actor)``, returning once the actor's process has ended (at most 30 s): ``ray.kill`` returns before
    that, and a call sent at once can reach the actor alive and be answered (CI saw an update applied so)."""
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    ray.kill(actor, **kill_kwargs)
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(30)


def _is_leak(proc: psutil.Process) -> bool:
    try:
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "forkserver" not in cmd and "resource_tracker" not in cmd and not is_ray_cluster(proc)


def _held_by(pids: list[int], names: set[str]) -> set[str]:
    """Those of ``names`` (entries of /dev/shm) that one of ``pids`` has open or mapped."""
    held = set()
    for pid in pids:
        try:
            paths = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as maps:
                paths += [line.split()[-1] for line in maps if "/dev/shm/" in line]
        except OSError:
            continue
        held |= {os.path.basename(path) for path in paths if path.startswith("/dev/shm/")} & names
    return held


#: torch's CUDA IPC reference-counter file: ``/torch_<pid>_<random>_<n>`` (``at::NewProcessWideShmHandle``), of
#: ``CUDA_IPC_REF_COUNTER_FILE_SIZE`` (10000) int64 counters after a 64-byte header (``RefcountedMapAllocator``).
_TORCH_REF_COUNTER = re.compile(r"torch_\d+_\d+_\d+")
_REF_COUNTER_BYTES = range(8 * 10000, 8 * 10000 + 4096 + 1)


def _torch_ref_counter(name: str) -> bool:
    """Whether ``name`` (an entry of /dev/shm) is torch's CUDA IPC reference-counter file. A process that shared
    CUDA memory (a device slot) keeps one for its whole life, and one killed by SIGKILL never unlinks it: torch's
    own bookkeeping, not weightsync's, so the leak check leaves it out."""
    if not _TORCH_REF_COUNTER.fullmatch(name):
        return False
    try:
        return os.stat(f"/dev/shm/{name}").st_size in _REF_COUNTER_BYTES
    except OSError:
        return False


#: The CUDA driver's file for a process's interprocess events: ``cuda.shm.<n>.<pid in hex>.<n>``. The driver makes
#: it in the process that first exports an interprocess event handle (``cudaIpcGetEventHandle``: a device slot's
#: event, or torch's ``_share_cuda_``), one per process, and keeps it for that process's life: destroying the
#: event leaves it, and a process that ends without CUDA's teardown (``os._exit``, as every multiprocessing child
#: ends, or SIGKILL) leaves it behind for good.
_CUDA_EVENT_FILE = re.compile(r"cuda\.shm\.\d+\.([0-9a-f]+)\.\d+")


def _cuda_event_file_of_live_process(name: str) -> bool:
    """Whether ``name`` (an entry of /dev/shm) is the CUDA driver's interprocess-event file of a process still
    running: CUDA's own state, like torch's reference-counter file, not a leak. The trainer (this test process)
    makes one at its first device slot and keeps it until it exits. The file of a process that is gone is a
    leak: only a sender exports events, so a worker's file means weightsync made a worker export one."""
    match = _CUDA_EVENT_FILE.fullmatch(name)
    if match is None:
        return False
    try:
        return psutil.Process(int(match.group(1), 16)).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cuda_or_torch_state(name: str) -> bool:
    """Files of /dev/shm that CUDA or torch keep for a process's life, not weightsync's to remove."""
    return _torch_ref_counter(name) or _cuda_event_file_of_live_process(name)


@pytest.fixture(autouse=True)
def no_leaks():
    """After every test: no shared-memory segment, weightsync thread or child process left behind by this run.

    Only this run's processes are judged: /dev/shm is a private tmpfs of the run where root allows it
    (:data:`PRIVATE_SHM`); elsewhere a new entry counts only if a process of this run holds it.
    """
    shm_before = set(os.listdir("/dev/shm"))
    # What an earlier test left is its own failure, reported there: each test answers for what it adds.
    me = psutil.Process()
    threads_before = {t for t in threading.enumerate() if t.name.startswith("weightsync")}
    children_before = {c.pid for c in me.children(recursive=True)}
    memfds_before, maps_before = _memfds(os.getpid()), _weightsync_maps(os.getpid())
    yield

    def leaks() -> list[str]:
        found = []
        children = [c for c in me.children(recursive=True) if c.pid not in children_before and _is_leak(c)]
        if children:
            found.append(f"child processes left behind: {[(c.pid, c.cmdline()) for c in children]}")
        threads = [t.name for t in threading.enumerate() if t.name.startswith("weightsync") and t not in threads_before]
        if threads:
            found.append(f"threads left behind: {threads}")
        if not _memfds(os.getpid()) <= memfds_before:
            found.append("shared-memory slots still open in the test process")
        if not _weightsync_maps(os.getpid()) <= maps_before:
            found.append("shared-memory slots still mapped in the test process")
        new = {name for name in set(os.listdir("/dev/shm")) - shm_before if not _cuda_or_torch_state(name)}
        if not PRIVATE_SHM:
            new = _held_by([me.pid, *(c.pid for c in me.children(recursive=True))], new)
        if new:
            found.append(f"new files in /dev/shm: {sorted(new)}")
        return found

    # What only garbage still holds (a cycle not collected yet) is no leak: looked at again after a collection,
    # which is done only then (a full collection costs 0.15-0.5 s in a test process that imported torch, vLLM and
    # Ray: a few minutes of the suite, done after every test).
    found = leaks()
    if found:
        gc.collect()
        found = leaks()
    assert not found, "\n".join(found)


class WorkerGroup:
    """Worker processes running :func:`tests._workers.serve`, driven over a command pipe each."""

    def __init__(self, ctx, target, n, make_args):
        self.procs, self.cmds = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=make_args(i, child), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.cmds.append(parent)

    def recv(self, i, timeout=30.0):
        if not self.cmds[i].poll(timeout):
            raise TimeoutError(f"worker {i} did not answer within {timeout}s")
        msg = self.cmds[i].recv()
        if isinstance(msg, tuple) and msg and msg[0] == "crashed":
            raise AssertionError(f"worker {i} crashed:\n{msg[1]}")
        return msg

    def ask(self, i, *command, timeout=30.0):
        self.cmds[i].send(command)
        return self.recv(i, timeout)

    def stop(self, timeout=30.0):
        for i, proc in enumerate(self.procs):
            if proc.is_alive():
                try:
                    self.cmds[i].send(("stop",))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(timeout)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for cmd in self.cmds:
            cmd.close()


@pytest.fixture
def workers(ctx):
    """Start worker groups; every group is stopped (and killed if need be) at teardown."""
    groups = []

    def start(target, n, make_args):
        group = WorkerGroup(ctx, target, n, make_args)
        groups.append(group)
        return group

    yield start
    for group in groups:
        group.stop()
