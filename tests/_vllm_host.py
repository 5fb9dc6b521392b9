"""A rollout process holding one vLLM engine (``vllm.LLM`` or ``AsyncLLM``), as a trainer's engines live: the test
(the trainer) drives it over a pipe, through :class:`HostClient`. The engine's own processes (engine core, worker)
are children of this one, so killing this process's group kills the engine.

In the host, the engine's control calls go through weightsync's own clients (``engine_client``): the test
exercises them on the real engine.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import signal
import threading
import time
import traceback
from typing import Any

import psutil

from tests.conftest import _held_by
from weightsync.errors import SyncTimeoutError
from weightsync.integrations.vllm.clients import EngineClient

#: How long a host may take to start its engine (2 cores, a loaded CI machine).
START_S = 240.0


def engine_args(model_dir: str, dtype: str, backend: str | None = "weightsync") -> dict[str, Any]:
    """A small engine's arguments (a 64 MB KV cache: the CPU backend would otherwise reserve a share of RAM)."""
    args: dict[str, Any] = dict(
        model=model_dir,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 * 2**20,
        seed=0,
    )
    if backend is not None:
        args["weight_transfer_config"] = {"backend": backend}
    return args


def _engine(
    model_dir: str, kind: str, dtype: str, backend: str | None, executor: str = "mp"
) -> tuple[Any, Any, asyncio.AbstractEventLoop | None]:
    args = engine_args(model_dir, dtype, backend)
    if kind == "llm":
        from vllm import LLM

        # Its engine core in this process and its worker in a process of its own, as docs/vllm.md's "Stopping an
        # engine" says: an engine core process idle in queue.get() can miss its SIGTERM (its main thread never
        # runs the handler), and its shutdown then waits a minute. The worker ends when its pipe closes.
        # (An AsyncLLM cannot: vLLM runs its engine core in a process of its own.) With ``executor="uni"`` the
        # worker runs in this process too: one import of vLLM less (10 s of CPU here), for the tests whose subject
        # is not where the worker runs.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return LLM(**args, distributed_executor_backend=executor), None, None
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True).start()

    async def build() -> Any:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    return asyncio.run_coroutine_threadsafe(build(), loop).result(START_S), None, loop


class _Host:
    def __init__(self, model_dir: str, kind: str, dtype: str, backend: str | None, executor: str) -> None:
        from weightsync.integrations.vllm import engine_client

        self.kind = kind
        self.engine, _, self.loop = _engine(model_dir, kind, dtype, backend, executor)
        self.client = engine_client(self.engine, f"engine in {os.getpid()}", self.loop)
        self.background: dict[int, Any] = {}
        self.produced: dict[int, int] = {}
        self._progress = threading.Condition()  # notified at each output of a request of start()

    # -------------------------------------------------------------- generation
    def _sampling(self, n: int, **kw: Any) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from vllm.inputs import TokensPrompt

        if self.kind == "llm":
            outs = self.engine.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], self._sampling(n), use_tqdm=False
            )
            return [list(o.outputs[0].token_ids) for o in outs]
        return [self._collect(self._start(p, n)).get("tokens") for p in prompts]

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        from vllm.inputs import TokensPrompt

        assert self.kind == "llm"
        out = self.engine.generate(
            [TokensPrompt(prompt_token_ids=prompt)], self._sampling(1, prompt_logprobs=0), use_tqdm=False
        )[0]
        return (
            [next(iter(d.values())).logprob if d else 0.0 for d in out.prompt_logprobs[1:]]
            if out.prompt_logprobs
            else []
        )

    def _start(self, prompt: list[int], n: int) -> int:
        from vllm.inputs import TokensPrompt

        key = len(self.background)
        self.produced[key] = 0

        async def run(rid: str) -> dict:
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt), self._sampling(n), rid):
                final = out
                with self._progress:
                    self.produced[key] = len(out.outputs[0].token_ids)
                    self._progress.notify_all()
            o = final.outputs[0]
            spans = [(s.version, s.start, s.end) for s in (o.weight_versions or [])]
            return {"tokens": list(o.token_ids), "finish": o.finish_reason, "spans": spans}

        self.background[key] = asyncio.run_coroutine_threadsafe(run(f"r{key}-{time.time_ns()}"), self.loop)
        return key

    def start(self, prompt: list[int], n: int) -> int:
        return self._start(prompt, n)

    def tokens_out(self, key: int, at_least: int, timeout: float) -> int:
        """How many tokens request ``key`` (of :meth:`start`) has produced, once that is ``at_least`` or it ended
        (waiting at most ``timeout``)."""
        with self._progress:
            self._progress.wait_for(lambda: self.produced[key] >= at_least or self.background[key].done(), timeout)
            return self.produced[key]

    def _collect(self, key: int) -> dict:
        return self.background.pop(key).result(120)

    def collect(self, key: int) -> dict:
        return self._collect(key)

    def version(self) -> str:
        if self.kind == "llm":
            return self.engine.get_weight_version()
        return asyncio.run_coroutine_threadsafe(self.engine.get_weight_version(), self.loop).result(30)

    def backend(self, attribute: str) -> list[Any]:
        """Each worker's weightsync backend's ``attribute`` (a dotted path: ``"_stager.cpus"``); an ``llm`` host's."""
        assert self.kind == "llm"

        def look(worker: Any) -> Any:  # (a closure: sent to the worker by value)
            found = worker.weight_transfer_engine
            for name in attribute.split("."):
                found = getattr(found, name)
            return found

        return self.engine.collective_rpc(look)

    def compute_cpus(self) -> list[list[int]]:
        """The CPUs each worker's main thread (the one vLLM binds to compute) runs on; an ``llm`` host's."""
        assert self.kind == "llm"

        def look(worker: Any) -> list[int]:
            import os

            return sorted(os.sched_getaffinity(0))

        return self.engine.collective_rpc(look)

    # -------------------------------------------------------------- control
    def control(self, call: str, *args: Any) -> Any:
        return getattr(self.client, call)(*args)


def serve(conn: Any, model_dir: str, kind: str, dtype: str, backend: str | None, executor: str = "mp") -> None:
    """The host's loop: answer each ``(method, args)`` with ``("ok", result)`` or ``("err", type, text)``."""
    os.setpgid(0, 0)  # the engine's processes join this group: the test kills them all at once
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")  # its 5 s can kill a slow exit on 2 cores
    try:
        host = _Host(model_dir, kind, dtype, backend, executor)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("err", type(exc).__name__, traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "stop":
            break
        try:
            conn.send(("ok", getattr(host, method)(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            conn.send(("err", type(exc).__name__, f"{exc}"))
    try:
        if host.kind == "llm":
            host.engine.llm_engine.engine_core.shutdown(timeout=60)  # (an LLM has none of its own)
        else:
            host.engine.shutdown(timeout=60)  # vLLM's 5 s default kills a slow exit: leaked /dev/shm
    except Exception:  # noqa: BLE001 - the process ends anyway
        traceback.print_exc()
    conn.send(("ok", None))


class HostError(RuntimeError):
    """The host's engine raised (its type and message)."""


#: What vLLM's processes leave in /dev/shm when they die without their own teardown (SIGKILL): shared memory
#: and semaphores of Python's multiprocessing, which their resource tracker (killed too) would have removed.
_ENGINE_SHM = re.compile(r"psm_[0-9a-f]+|sem\.mp-\w+")


class Host:
    """The test's handle on a rollout process: start it, ask it things, kill it. One caller at a time."""

    def __init__(
        self,
        model_dir: str,
        kind: str = "llm",
        dtype: str = "float32",
        backend: str | None = "weightsync",
        executor: str = "mp",
    ) -> None:
        """Start the host and return once its engine serves (at most ``START_S``).
        ``executor``: vLLM's ``distributed_executor_backend`` of an ``llm`` host, ``"mp"`` (its worker in a process
        of its own, as the module's engines) or ``"uni"`` (in the host's process)."""
        self._lock = threading.Lock()
        self._shm_before = set(os.listdir("/dev/shm"))
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, model_dir, kind, dtype, backend, executor)
        self.proc = ctx.Process(target=serve, args=args, name=f"vllm-host-{kind}")
        self.proc.start()
        child.close()
        self.kind = kind
        self.pid: int | None = None
        self.wait()

    def wait(self) -> None:
        """Return once the engine serves (at most ``START_S``)."""
        if self.pid is None:
            self.pid = self.ask_raw(START_S)

    def ask_raw(self, timeout: float, method: str | None = None, *args: Any) -> Any:
        with self._lock:  # one question, one answer: a question that timed out leaves the pipe to no one
            if self.conn.closed:
                raise EOFError("vLLM host: its pipe is closed (a question timed out, or it stopped)")
            if method is not None:
                self.conn.send((method, args))
            if not self.conn.poll(timeout):
                self.conn.close()
                raise TimeoutError(f"vLLM host: {method or 'start'} did not answer within {timeout:.0f}s")
            reply = self.conn.recv()
        if reply[0] == "err":
            raise HostError(f"{reply[1]}: {reply[2]}")
        return reply[1]

    def ask(self, method: str, *args: Any, timeout: float = 120.0) -> Any:
        self.wait()
        return self.ask_raw(timeout, method, *args)

    def client(self) -> HostClient:
        self.wait()
        return HostClient(self)

    def _group(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == self.proc.pid:
                    found.append(proc)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def engine_processes(self) -> list[psutil.Process]:
        """The engine's own processes (its engine core and worker), not the host's, which makes its calls."""
        return [p for p in self._group() if p.pid != self.proc.pid]

    def kill(self) -> None:
        """SIGKILL the host and every process of its engine, and remove what they left in /dev/shm."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.join(30)
        psutil.wait_procs(self._group(), timeout=30)
        remove_engine_leftovers(self._shm_before)

    def stop(self) -> None:
        """Shut the engine down, let its processes end on their own (their resource trackers clean up), then end
        whatever is left."""
        if self.proc.is_alive():
            try:
                self.ask_raw(60, "stop")
            except (TimeoutError, HostError, EOFError, OSError):
                pass
        self.proc.join(30)
        psutil.wait_procs(self._group(), timeout=20)
        self.kill()
        self.conn.close()


def remove_engine_leftovers(before: set[str]) -> None:
    """Remove what killed engines left in /dev/shm since ``before`` (vLLM's message queues, the named locks of its
    spawned processes), unless a live process still holds it: a process killed cannot remove its own."""
    left = {n for n in set(os.listdir("/dev/shm")) - before if _ENGINE_SHM.fullmatch(n)}
    for name in left - _held_by(psutil.pids(), left):
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass


class HostClient(EngineClient):
    """The trainer's client of a host's engine: each call runs in the host, through weightsync's client there (an
    ``AsyncLLM``'s gives up at its ``timeout`` while the engine runs on: its time-out is raised here as there)."""

    def __init__(self, host: Host) -> None:
        super().__init__(host, f"engine in host {host.pid}")
        self.host = host
        self.pauses = self.gives_up = host.kind == "async"

    def _do(self, call: str, timeout: float, *args: Any) -> Any:
        try:
            return self.host.ask("control", call, *args, timeout, timeout=timeout + 5)
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise ConnectionError(f"{self.name} is gone: {exc!r}") from exc
        except HostError as exc:
            said = str(exc)
            if said.startswith(f"{SyncTimeoutError.__name__}: "):
                raise SyncTimeoutError(said.split(": ", 1)[1]) from None
            raise

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self._do("init", timeout, init_info)

    def start(self, timeout: float) -> None:
        self._do("start", timeout)

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self._do("update", timeout, update_info)

    def finish(self, version: str, timeout: float) -> None:
        self._do("finish", timeout, version)

    def set_version(self, version: str, timeout: float) -> None:
        self._do("set_version", timeout, version)

    def reset_prefix_cache(self, timeout: float) -> None:
        self._do("reset_prefix_cache", timeout)

    def pause(self, mode: str, timeout: float) -> None:
        self._do("pause", timeout, mode)

    def resume(self, timeout: float) -> None:
        self._do("resume", timeout)

    def shutdown(self, timeout: float) -> None:
        self._do("shutdown", timeout)
