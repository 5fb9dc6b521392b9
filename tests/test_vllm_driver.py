"""The trainer's side of vLLM engines (``VLLMEngines``, ``VLLMWeightSyncScheme``), on CPU without vLLM: each
"engine" here is an object with vLLM's four trainer-side calls whose worker side is what weightsync's vLLM backend
does (a receiver built from the config it is sent, loading into an ``ExternalModel``). tests/test_vllm.py runs
the same on real vLLM engines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import weightsync as ws
from tests._bodies import sent_without_a_time_out
from tests._vllm_engine import Engine, engine_spec
from tests._workers import build
from weightsync.core.timing import deadline_after, remaining, wait_until
from weightsync.integrations.vllm import VLLMEngines, VLLMWeightSyncScheme
from weightsync.integrations.vllm.clients import AsyncLLMClient, EngineClient
from weightsync.tensors.strategy import flatten_weights


def _same(engine: Engine, model) -> bool:
    return _same_as(engine, flatten_weights(model, "tensordict"))


def _same_as(engine: Engine, weights: dict[str, torch.Tensor]) -> bool:
    return engine.held.keys() == weights.keys() and all(torch.equal(engine.held[k], v) for k, v in weights.items())


def _step(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _hangs_until(release: threading.Event, spec: dict) -> Engine:
    """An engine whose loads stop answering until ``release`` is set (at most 60 s), then go on."""

    class Hangs(Engine):
        def update_weights(self, update_info: dict) -> None:
            release.wait(60)
            super().update_weights(update_info)

    return Hangs(spec)


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed"])
def test_send_returns_when_every_engine_serves_the_version_it_names(name):
    model = build("tiny")
    engines = [Engine(engine_spec(model)), Engine(engine_spec(model))]
    scheme = VLLMWeightSyncScheme(name, pause_mode="none", timeout=20, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, engines=engines)
        scheme.connect()
        assert all(e.version == "0" and _same(e, model) for e in engines)
        for step in range(1, 4):
            _step(model, step)
            scheme.send()
            assert all(e.version == str(step) and _same(e, model) for e in engines)
            assert scheme.acked_versions == {0: step, 1: step}
        assert engines[0].calls[:3] == ["init", "reset", "start"]
        assert engines[0].calls[3:7] == ["update 1", "finish 1", "reset", "start"]
    finally:
        scheme.shutdown()
    assert all(e.calls[-1] == "shutdown" and e.scheme is None for e in engines)


def test_engines_are_sent_each_version_as_its_changes_under_delta():
    model = build("tiny")
    engines = [Engine(engine_spec(model)), Engine(engine_spec(model))]
    scheme = VLLMWeightSyncScheme("distributed", pause_mode="none", timeout=20, connect_timeout=30, delta="auto")
    try:
        scheme.init_on_sender(model=model, engines=engines)
        scheme.connect()
        for step in range(1, 4):
            with torch.no_grad():
                next(model.parameters()).view(-1)[step] += 1.0  # one value of the model
            scheme.send()
            assert all(e.version == str(step) and _same(e, model) for e in engines)
        assert scheme.stats()["changes_sent"] == 2 * 3  # each version to each engine as its changes
    finally:
        scheme.shutdown()


class _SlowToSayEngine(Engine):
    """An engine whose ``update_weights`` error takes a while to come back (vLLM's travels from its worker through
    its engine core to the front end), and which can refuse to load one version (``refuse_load``) or watch where
    its loads run."""

    def __init__(self, spec: dict, refuse_load: int | None = None) -> None:
        super().__init__(spec)
        self.refuse_load, self.loads, self.in_update = refuse_load, 0, False
        self.loaded_outside: list[str] = []  # the threads that loaded a version outside update_weights

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.scheme is not None and not self.in_update:
            self.loaded_outside.append(threading.current_thread().name)
        self.loads += 1
        if self.loads == self.refuse_load:
            raise RuntimeError("bad weights for this engine")
        super()._load(tensors)

    def update_weights(self, update_info: dict) -> None:
        self.in_update = True
        try:
            super().update_weights(update_info)
        except Exception:
            time.sleep(0.3)
            self.active = False
            raise
        finally:
            self.in_update = False


def test_a_receiver_config_with_background_thread_still_loads_each_version_in_the_pause():
    """A scheme whose receivers apply in a thread of their own (``background_thread=True``): an engine's receiver
    must not, or it loads each version as it arrives, while the engine generates, under the old version's name
    (its stager, refused its takes, used to end at once)."""
    model = build("tiny")
    engine = _SlowToSayEngine(engine_spec(model))
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30, background_thread=True)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([engine], pause_mode="none"))
        scheme.connect()
        for version in (1, 2, 3):
            _step(model, 1)
            scheme.send()
            assert engine.version == str(version) and _same(engine, model)
        assert engine.stager._thread.is_alive()
        assert engine.loaded_outside == []
    finally:
        scheme.shutdown()


def test_a_stager_whose_takes_meet_a_silence_takes_on_and_the_engine_serves_the_next_version():
    """A take that meets a silence (``SyncTimeoutError``: a trainer stopped, then resumed; its store slow to answer)
    ends neither a plain worker nor an engine's stager: the engine serves the version that comes after it. The
    stager used to end at the first one, and every later update of the engine failed with it. An update that
    waits in vain meanwhile names the silence."""
    model = build("tiny")
    engine = Engine(engine_spec(model))
    scheme = VLLMWeightSyncScheme("distributed", pause_mode="none", timeout=20, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, engines=[engine])
        scheme.connect()
        take, silences = engine.scheme.take, iter(range(3))

        def silent_for_a_while(timeout=0.0):
            if next(silences, None) is not None:
                raise ws.SyncTimeoutError("the store did not answer (the test's)")
            return take(timeout)

        engine.scheme.take = silent_for_a_while  # (the stager's scheme: its next three takes meet a silence)
        _step(model, 1)
        scheme.send()
        assert engine.version == "1" and _same(engine, model) and engine.stager._thread.is_alive()
        silences = itertools.count()  # (silent from here on)
        with pytest.raises(ws.SyncTimeoutError, match="the test's"):
            engine.stager.apply_next(deadline_after(0.3))
        assert engine.stager._thread.is_alive()
    finally:
        scheme.shutdown()


def test_a_receivers_refusal_is_reported_once_by_the_send_it_failed_not_again_by_the_next():
    """The receiver refuses version 2 and says so at once; the engine's update_weights fails for it later. The send
    of version 2 raises the receiver's own cause; the engine's failed call is its consequence, not a failure of
    the send of version 3 (which it used to fail, naming version 2)."""
    model = build("tiny")
    engine = _SlowToSayEngine(engine_spec(model), refuse_load=3)  # (loads 1 and 2: versions 0 and 1)
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([engine], pause_mode="none"))
        scheme.connect()
        _step(model, 1)
        scheme.send()
        _step(model, 1)
        with pytest.raises(ws.ReceiverError, match="version 2.*bad weights") as raised:
            scheme.send()
        assert "vLLM engine" not in str(raised.value)  # (the receiver's word, not the engine's call's)
        _step(model, 1)
        scheme.send()
        assert engine.version == "3" and _same(engine, model)
        assert scheme.acked_versions == {0: 3}
    finally:
        scheme.shutdown()


def test_an_engine_that_refuses_a_versions_changes_is_sent_it_whole_in_the_same_send():
    """Under ``delta``, an engine whose kept copy is not the base refuses the changes; the core sends the version
    whole in the same ``send()`` (SPEC 10), even though the engine's call that failed for want of the base ends
    after the receiver said why."""
    model = build("tiny")
    engine = _SlowToSayEngine(engine_spec(model))
    scheme = VLLMWeightSyncScheme(
        "distributed", pause_mode="none", timeout=20, connect_timeout=30, delta=True, checksum=True
    )
    try:
        scheme.init_on_sender(model=model, engines=[engine])
        scheme.connect()
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0
        scheme.send()
        assert scheme.stats()["changes_sent"] == 1
        engine.scheme._runtime.receiving.kept.buffer[0] ^= 0xFF  # its copy of version 1 is not version 1 any more
        with torch.no_grad():
            next(model.parameters()).view(-1)[1] += 1.0
        scheme.send()
        assert engine.version == "2" and _same(engine, model)
        assert engine.calls[-4:] == ["start", "update 2", "finish 2", "reset"]  # (whole, after the refused changes)
        assert scheme.acked_versions == {0: 2}
    finally:
        scheme.shutdown()


def test_an_engine_that_fails_to_serve_a_version_is_named_and_the_other_serves_it():
    model = build("tiny")
    good, bad = Engine(engine_spec(model)), Engine(engine_spec(model), fail_update_at=2)
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([good, bad], pause_mode="none"))
        scheme.connect()
        _step(model, 1)
        scheme.send()
        _step(model, 1)
        with pytest.raises(ws.WeightSyncError, match="worker 1.*could not load"):
            scheme.send()
        assert good.version == "2" and _same(good, model)
        assert bad.version == "1"
    finally:
        scheme.shutdown()


def test_an_engine_whose_init_fails_is_named_at_once_not_at_the_connect_timeout():
    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=60)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([Engine(engine_spec(model), fail_init=True)]))
        started = time.monotonic()
        with pytest.raises(ws.WorkerDiedError, match="vLLM engine 0 could not start weightsync.*not configured"):
            scheme.connect()
        assert time.monotonic() - started < 30
    finally:
        scheme.shutdown()


def test_an_engine_that_does_not_fit_the_trainers_model_is_refused_by_name_before_it_loads():
    model = build("tiny")
    spec = engine_spec(model)
    first = next(iter(spec))
    spec[first] = ((*spec[first][0], 3), spec[first][1])
    engine = Engine(spec)
    scheme = ws.SharedMemWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([engine]))
        with pytest.raises(ws.ReceiverError, match=first) as info:  # (as docs/vllm.md says)
            scheme.connect()
        assert info.value.remote_type == "WeightMismatchError" and info.value.worker_idx == 0
        assert engine.held == {} and engine.version == "checkpoint"
    finally:
        scheme.shutdown()


def test_an_engine_that_could_not_replace_one_still_joined_leaves_that_one_served():
    """``replace`` of an engine that hangs, its receiver still joined (``on_failure="raise"``): the new engine is
    refused (the worker is still connected), and the one it was to replace is served as before: once it answers
    again, the next send reaches it (before, the engine that never joined stood in its place, and every later
    send failed with its error). Its call that hangs still holds its turn: the next version's calls wait behind it
    (they were made at once, and their cleanup ended the session of the call that hangs)."""
    release = threading.Event()
    model = build("tiny")
    good, hangs = Engine(engine_spec(model)), _hangs_until(release, engine_spec(model))
    scheme = ws.MultiProcessWeightSyncScheme(timeout=3, connect_timeout=20)
    engines = VLLMEngines([good, hangs], pause_mode="none")
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        _step(model, 1)
        with pytest.raises(ws.SyncTimeoutError, match="worker 1"):
            scheme.send()
        client = engines.clients[1]
        with pytest.raises(ws.WeightSyncError, match="already connected"):
            engines.replace(1, Engine(engine_spec(model)), timeout=15)
        assert engines.clients[1] is client
        calls = list(hangs.calls)
        _step(model, 1)
        with pytest.raises(ws.WeightSyncError, match="worker 1"):
            scheme.send()
        assert hangs.calls == calls and hangs.active, "a call reached the engine while its call hangs"
        release.set()
        _step(model, 1)
        deadline = deadline_after(30)
        while not (hangs.version == good.version == str(scheme.version) and _same(hangs, model)):
            assert remaining(deadline) > 0, (good.version, hangs.version, scheme.version)
            with contextlib.suppress(ws.WeightSyncError):  # (the hung version's failure, reported late)
                scheme.send()
        assert _same(good, model)
    finally:
        release.set()
        scheme.shutdown()


@contextlib.contextmanager
def _first_engine_gone(release: threading.Event, replaced_after: bool = True):
    """A scheme served one engine, which went away, unnoticed (the trainer has not sent since): yields (model,
    scheme, engines) to try to replace it; then another engine replaces it, and serves the next version."""
    model = build("tiny")
    first = Engine(engine_spec(model))
    scheme = ws.MultiProcessWeightSyncScheme(timeout=5, connect_timeout=20)
    engines = VLLMEngines([first], pause_mode="none")
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        first.shutdown_weight_transfer_engine()
        yield model, scheme, engines
        release.set()
        if replaced_after:
            second = Engine(engine_spec(model))
            engines.replace(0, second)
            _step(model, 1)
            scheme.send()
            assert second.version == str(scheme.version) and _same(second, model)
    finally:
        release.set()
        scheme.shutdown()


@pytest.mark.parametrize("how", ["raises", "hangs", "raises_while_admitted"])
def test_an_engine_whose_receiver_joined_before_its_init_failed_is_dropped_not_the_old_one_put_back(how):
    """The engine to replace went away, unnoticed; the new engine's receiver joins (the scheme takes the worker
    back: its bytes go to the new engine), then its init call raises or hangs past the timeout. The worker is
    named gone; the old engine is not put back (before, it was: the next send failed inside the gone engine's
    calls), and another engine then replaces it. It is named gone after its admission ends too, where that
    admission is still under way when the init fails (before, the admission's end counted it live again)."""
    release, failing = threading.Event(), threading.Event()

    class JoinsThenFails(Engine):
        def init_weight_transfer_engine(self, init_info):
            super().init_weight_transfer_engine(init_info)
            if how == "hangs":
                release.wait(30)
            failing.set()
            raise RuntimeError("the engine broke after its receiver joined")

    with _first_engine_gone(release) as (model, scheme, engines):
        if how == "raises_while_admitted":
            inner = engines._gate.inner
            admit = inner.admit

            def slow_to_end(candidate):  # (the rejoin thread's admission, under the core's lock)
                admitted = admit(candidate)
                gate = engines._gate
                if failing.wait(10) and wait_until(lambda: 0 not in gate._joining, deadline_after(10), 0.01):
                    # The init's failure is being handled. Before the fix it named the worker gone at once, and
                    # this admission's end then counted it live again; now it waits for this admission to end.
                    wait_until(lambda: gate.core.is_dead(0), deadline_after(0.5), 0.01)
                return admitted

            inner.admit = slow_to_end
        broken = JoinsThenFails(engine_spec(model))
        with pytest.raises(ws.WeightSyncError, match="worker 0"):
            engines.replace(0, broken, timeout=3)
        assert engines.clients[0].target is broken
        assert "joined in place of another" in scheme.stats()["failed_workers"][0]


@pytest.mark.parametrize("init_returns", ["after_its_admission", "within_its_admission"])
def test_a_replacement_whose_receiver_joins_after_replace_gave_up_is_dropped_named_and_can_be_replaced(init_returns):
    """The engine to replace went away; the new engine's init is slow, so ``replace`` times out before its
    receiver joins, and the old engine's client is put back. The receiver that joins late is turned away: the
    worker is named gone (before, it was taken back, its bytes went to the new engine and its calls to the gone
    one: every later send failed inside the gone engine, and the worker was never dropped), and another engine
    then replaces it. Also where the new engine's init returns (its receiver welcomed and sent its first version)
    before its admission ends: the end of that init clears the gate's mark (before, the receiver was then
    taken back)."""
    release, ended = threading.Event(), threading.Event()

    class SlowToJoin(Engine):
        def init_weight_transfer_engine(self, init_info):
            release.wait(30)
            try:
                super().init_weight_transfer_engine(init_info)
            finally:
                ended.set()

    with _first_engine_gone(release) as (model, scheme, engines):
        gate = engines._gate
        if init_returns == "within_its_admission":
            admit = gate.inner.admit

            def init_returned_first(candidate):  # (the rejoin thread's admission, before the gate's check)
                admitted = admit(candidate)
                wait_until(lambda: 0 not in gate._abandoned, deadline_after(10), 0.01)  # (the init's end cleared it)
                return admitted

            gate.inner.admit = init_returned_first
        with pytest.raises(ws.WeightSyncError, match="did not join within"):
            engines.replace(0, SlowToJoin(engine_spec(model)), timeout=1)
        release.set()  # its receiver joins now
        assert wait_until(
            lambda: "joined late" in scheme.stats()["failed_workers"].get(0, ""), deadline_after(20), 0.05
        ), scheme.stats()["failed_workers"]
        assert ended.wait(20)  # (its receiver, turned away, let go of what it mapped)
        gc.collect()


def test_a_replacement_for_a_dropped_engine_that_joins_after_replace_gave_up_is_served():
    """As above, but the worker was dropped before ``replace``: nothing is put back in its place, the new engine
    stays its engine, and its receiver joining late is taken back and served by the next send."""
    release = threading.Event()

    class SlowToJoin(Engine):
        def init_weight_transfer_engine(self, init_info):
            release.wait(30)
            super().init_weight_transfer_engine(init_info)

    with _first_engine_gone(release, replaced_after=False) as (model, scheme, engines):
        _step(model, 1)
        with pytest.raises(ws.WeightSyncError, match="worker 0"):
            scheme.send()  # (dropped)
        slow = SlowToJoin(engine_spec(model))
        with pytest.raises(ws.WeightSyncError, match="did not join within"):
            engines.replace(0, slow, timeout=1)
        assert engines.clients[0].target is slow
        release.set()
        assert wait_until(lambda: 0 not in scheme.stats()["failed_workers"], deadline_after(20), 0.05)
        _step(model, 1)
        scheme.send()
        assert slow.version == str(scheme.version) and _same(slow, model)


def test_a_replaced_engine_serves_the_trainers_weights_as_a_new_version():
    model = build("tiny")
    first = Engine(engine_spec(model))
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30)
    engines = VLLMEngines([first], pause_mode="none")
    try:
        scheme.init_on_sender(model=model, context=engines)
        early = Engine(engine_spec(model))
        with pytest.raises(ws.LifecycleError, match="replace: the scheme these engines serve is initialized as"):
            engines.replace(0, early)  # (it took the worker back, then its send said the scheme was not connected)
        assert early.calls == [] and engines.clients[0].target is first
        scheme.connect()
        _step(model, 1)
        scheme.send()
        first.shutdown_weight_transfer_engine()  # the engine goes away (its receiver with it)
        _step(model, 1)
        with pytest.raises(ws.WeightSyncError, match="worker 0"):
            scheme.send()
        second = Engine(engine_spec(model))
        for bad in (7200, -1):  # (refused before the engine is called or the scheme takes the worker back)
            with pytest.raises(ws.ConfigurationError, match=r"replace\(timeout\) must be None or a number"):
                engines.replace(0, second, timeout=bad)
        # (an engine that serves requests while it loads, under pause_mode="none": refused as VLLMEngines refuses it)
        with pytest.raises(ws.ConfigurationError, match="pause_mode='none' would load each version into vLLM engine 0"):
            engines.replace(0, "http://127.0.0.1:8000")
        assert second.calls == [] and engines.clients[0].target is first
        engines.replace(0, second)
        assert second.version == str(scheme.version) == "3" and _same(second, model)
        _step(model, 1)
        scheme.send()
        assert second.version == "4" and _same(second, model)
    finally:
        scheme.shutdown()


class PausingEngine(Engine):
    """An engine that pauses (an ``AsyncLLM`` through its client): the pause clears its prefix cache."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.generating = True

    def pause_generation(self, mode: str) -> None:
        self.calls.append(f"pause {mode}")
        self.generating = False

    def resume_generation(self) -> None:
        self.calls.append("resume")
        self.generating = True


class PausingClient(EngineClient):
    pauses = True

    def pause(self, mode: str, timeout: float) -> None:
        self.target.pause_generation(mode)

    def resume(self, timeout: float) -> None:
        self.target.resume_generation()


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_an_engine_that_can_pause_is_paused_around_each_load_in_the_mode_chosen(mode):
    model = build("tiny")
    engine = PausingEngine(engine_spec(model))
    engines = VLLMEngines([PausingClient(engine, "engine 0")], pause_mode=mode)
    scheme = ws.SharedMemWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        _step(model, 1)
        scheme.send()
        assert engine.calls == [
            f"pause {mode}",
            "init",
            "resume",
            "start",  # (before the pause: it changes nothing the engine computes)
            f"pause {mode}",
            "update 1",
            "finish 1",
            "resume",
        ]
        assert engine.generating and [t.paused for t in engines.timings] == [True, True]
    finally:
        scheme.shutdown()


class JoinedClient(PausingClient):
    """A client whose engine takes start_weight_update and the pause at once (as an ``AsyncLLM``'s does)."""

    starts_with_pause = True

    def start_and_pause(self, mode: str, timeout: float) -> None:
        self.target.calls.append("start and pause")
        self.target.start_weight_update()
        self.target.pause_generation(mode)


def test_an_engine_that_takes_its_start_with_its_pause_is_sent_both_at_once_once_the_bytes_are_out():
    model = build("tiny")
    engine = PausingEngine(engine_spec(model))
    engines = VLLMEngines([JoinedClient(engine, "engine 0")], pause_mode="keep")
    scheme = ws.SharedMemWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        for version in (1, 2):
            _step(model, 1)
            scheme.send()
            assert engine.calls[-6:] == [
                "start and pause",  # (one call: both are answered at the end of the engine's step in flight)
                "start",
                "pause keep",
                f"update {version}",
                f"finish {version}",
                "resume",
            ]
            assert engine.version == str(version) and _same(engine, model) and engine.generating
    finally:
        scheme.shutdown()


class AsyncTarget:
    """An ``AsyncLLM``'s calls that ``AsyncLLMClient.start_and_pause`` makes, one of them failing (``fail``)."""

    def __init__(self, fail: str | None) -> None:
        self.fail, self.calls = fail, []

    async def start_weight_update(self) -> None:
        self.calls.append("start")
        if self.fail == "start":
            raise RuntimeError("start_weight_update called while a weight update is already active")

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause {mode}")
        if self.fail == "pause":
            raise RuntimeError("the engine is dead")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")


@pytest.fixture
def loop():
    """An event loop running in a thread of its own, as an ``AsyncLLM``'s runs beside the trainer's code."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    runner.join(5)
    loop.close()


@pytest.mark.parametrize("fail", [None, "start", "pause"])
def test_an_async_engines_start_and_pause_go_together_and_one_that_fails_undoes_the_other(fail, loop):
    """Where the start fails the engine generates again; where the pause fails its update session is ended."""
    target = AsyncTarget(fail)
    client = AsyncLLMClient(target, "engine 0", loop)
    if fail is None:
        client.start_and_pause("keep", 5)
        assert sorted(target.calls) == ["pause keep", "start"]
    else:
        with pytest.raises(RuntimeError, match="already active" if fail == "start" else "dead"):
            client.start_and_pause("keep", 5)
        undone = "resume" if fail == "start" else "finish None"
        assert sorted(target.calls) == sorted(["pause keep", "start", undone])


def test_engines_and_options_that_are_not_are_refused_by_name():
    with pytest.raises(ws.ConfigurationError, match="not a vLLM engine.*init_weight_transfer_engine"):
        VLLMEngines([object()])
    with pytest.raises(ws.ConfigurationError, match="pause_mode"):
        VLLMEngines([Engine({})], pause_mode="later")
    with pytest.raises(ws.ConfigurationError, match="non-empty"):
        VLLMEngines([])
    with pytest.raises(ws.ConfigurationError, match="AsyncLLM.*loop"):
        VLLMEngines([type("AsyncLLM", (), {})()])
    with pytest.raises(ws.ConfigurationError, match="options"):
        VLLMWeightSyncScheme(ws.MultiProcessWeightSyncScheme(), timeout=3)
    with pytest.raises(ws.ConfigurationError, match="pause_mode"):
        VLLMWeightSyncScheme("multiprocess", pause_mode="soon")
    # An engine that serves requests while it loads (a server, an AsyncLLM) is paused: under "none" its requests
    # in flight computed with a mix of two versions, named for one (a user's audit, 12 to 16 tokens a send).
    with pytest.raises(ws.ConfigurationError, match=r"pause_mode='none' would load each version into vLLM engine 1"):
        VLLMEngines([Engine({}), "http://127.0.0.1:8000"], pause_mode="none")
    # One engine given twice: its two workers' calls met in it, and the first connect waited its whole timeout.
    engine = Engine({})
    with pytest.raises(ws.ConfigurationError, match="vLLM engine 0 and vLLM engine 2 are the same engine"):
        VLLMEngines([engine, Engine({}), engine])
    with pytest.raises(ws.ConfigurationError, match="vLLM engine 0 and vLLM engine 1 are the same engine"):
        VLLMEngines(["http://127.0.0.1:8000", "http://127.0.0.1:8000/"])


def test_vllm_weight_sync_scheme_takes_its_engines_as_context_too_and_serves_them_with_its_own_pause():
    """The GRPO example's call, ``init_on_sender(model=..., context=VLLMEngines(...))``, raised a ``TypeError``
    under ``weightsync/scheme=vllm`` (``engines=`` was required), and ``engines=VLLMEngines(...)`` was refused as
    no engines at all."""
    model = build("tiny")
    for how in ("context", "engines"):
        engines = VLLMEngines([Engine(engine_spec(model))], pause_mode="none")
        scheme = VLLMWeightSyncScheme("multiprocess", pause_mode="abort", timeout=10, connect_timeout=30)
        try:
            scheme.init_on_sender(model=model, **{how: engines})
            assert scheme.engines is engines and engines.pause_mode == "abort"
            assert scheme.num_workers == 1
        finally:
            scheme.shutdown()
    scheme = VLLMWeightSyncScheme("multiprocess", timeout=10, connect_timeout=30)
    engines = VLLMEngines([Engine(engine_spec(model))], pause_mode="none", load_ahead=True)
    with pytest.raises(ws.ConfigurationError, match="unexpected"):  # (the wrapped scheme's refusal)
        scheme.init_on_sender(model=model, context=engines, pipes=[])
    assert (engines.pause_mode, engines.load_ahead, scheme.engines) == ("none", True, None)
    with pytest.raises(ws.ConfigurationError, match="needs the engines"):
        scheme.init_on_sender(model=model)
    with pytest.raises(ws.ConfigurationError, match="give the engines once"):
        scheme.init_on_sender(model=model, engines=[Engine({})], context=VLLMEngines([Engine({})]))
    other = asyncio.new_event_loop()
    with pytest.raises(ws.ConfigurationError, match="has its own"):
        scheme.init_on_sender(model=model, context=VLLMEngines([Engine({})]), loop=other)
    other.close()
    assert scheme.state == "new"


def test_a_subclass_of_vllms_llm_is_called_as_an_llm():
    """RL frameworks subclass ``vllm.LLM``: it takes vLLM's wrapped requests as an ``LLM`` does (given as the
    generic engine, its init failed in vLLM with ``KeyError: 'init_info'``)."""
    from weightsync.integrations.vllm.clients import LLMClient
    from weightsync.integrations.vllm.engines import engine_client

    llm = type("LLM", (), {"llm_engine": None})
    for cls in (llm, type("RolloutLLM", (llm,), {})):
        assert type(engine_client(cls(), "engine 0")) is LLMClient, cls


def test_vllms_requests_are_imported_as_an_actors_engines_are_given_not_within_connect():
    """The trainer of engines in Ray actors need not have imported vLLM: the module of its request classes, which
    imports most of vLLM (4 s on 2 idle cores), is imported by ``VLLMEngines``, not by ``connect`` (where it took a
    connect_timeout of 30 s on 2 busy cores, with the actor's own import)."""
    pytest.importorskip("vllm")
    code = (
        "import sys; from weightsync.integrations.vllm import VLLMEngines\n"
        "module = 'vllm.distributed.weight_transfer.base'\n"
        "assert module not in sys.modules\n"
        "VLLMEngines([type('ActorHandle', (), {})()], pause_mode='none')\n"
        "assert module in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_engines_serve_one_scheme():
    model = build("tiny")
    engines = VLLMEngines([Engine(engine_spec(model))])
    first = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30)
    second = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        first.init_on_sender(model=model, context=engines)
        with pytest.raises(ws.ConfigurationError, match="already serve another scheme"):
            second.init_on_sender(model=model, context=engines)
    finally:
        first.shutdown()
        second.shutdown()


def test_an_engine_client_is_called_by_one_thread_at_a_time():
    """Each engine's calls are serialized: its client need not be thread-safe."""
    model = build("tiny")
    inside = threading.Semaphore(1)
    overlaps: list[str] = []

    class Watched(Engine):
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if name in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                        "finish_weight_update", "reset_prefix_cache", "shutdown_weight_transfer_engine"):  # fmt: skip

                def watched(*a, **k):
                    if not inside.acquire(blocking=False):
                        overlaps.append(name)
                        return attr(*a, **k)
                    try:
                        return attr(*a, **k)
                    finally:
                        inside.release()

                return watched
            return attr

    engine = Watched(engine_spec(model))
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30, sync=False, max_staleness=None)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([engine], pause_mode="none"))
        scheme.connect()
        for _ in range(5):
            _step(model, 1)
            scheme.send()
        scheme.wait_async()
    finally:
        scheme.shutdown()
    assert overlaps == []


def test_a_hung_engine_is_a_named_timeout_within_the_schemes_timeout_and_the_other_serves_the_version():
    """...and while its call still hangs, an engine that replaces it is served at once (the hung call holds its
    old engine's turn, not the new one's), the scheme shuts down within its bound, and no thread of the hung call
    can hold the trainer's interpreter at exit (a thread pool's are joined there)."""
    model = build("tiny")
    release = threading.Event()

    class Hung(Engine):
        def update_weights(self, update_info: dict) -> None:
            release.wait(60)  # an engine that stopped answering

    good, hung = Engine(engine_spec(model)), Hung(engine_spec(model))
    scheme = ws.MultiProcessWeightSyncScheme(timeout=3, connect_timeout=30)
    engines = VLLMEngines([good, hung], pause_mode="none")
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        _step(model, 1)
        started = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match="worker 1"):
            scheme.send()
        assert time.monotonic() - started < 3 + 2
        assert good.version == "1" and _same(good, model)
        hung.shutdown_weight_transfer_engine()  # its process killed: its receiver gone, its call never returns
        _step(model, 1)
        with pytest.raises(ws.WeightSyncError, match="worker 1"):
            scheme.send()
        fresh = Engine(engine_spec(model))
        engines.replace(1, fresh)
        assert fresh.version == str(scheme.version) == "3" and _same(fresh, model)
        started = time.monotonic()
        scheme.shutdown()
        assert time.monotonic() - started < 10
        calls = [t for t in threading.enumerate() if t.name.startswith("weightsync-vllm")]
        assert calls and all(t.daemon for t in calls)  # the hung call's, still waiting
    finally:
        release.set()
        scheme.shutdown()
        for thread in threading.enumerate():
            if thread.name.startswith("weightsync-vllm"):
                thread.join(10)


def test_an_engine_whose_calls_of_two_versions_hang_is_passed_by_and_the_other_is_sent_every_version():
    """A hung engine's first two versions each cost a ``timeout`` (the second's calls wait behind the first's, as
    for a load that outlasts one); then, its calls for version 1 still running, each send passes it by at once,
    naming it, and the other engine serves every version. Sent each version, the hung engine held a slot of each,
    and from the fourth send on no engine was sent any (``shared_mem``). Once its calls return, the next send
    reaches it."""
    model = build("tiny")
    release = threading.Event()
    good, hung = Engine(engine_spec(model)), _hangs_until(release, engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=2, connect_timeout=30)
    engines = VLLMEngines([good, hung], pause_mode="none")
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        for version in (1, 2):
            _step(model, 1)
            with pytest.raises(ws.SyncTimeoutError, match=f"worker 1, version {version}.*no ack"):
                scheme.send()
            assert good.version == str(version) and _same(good, model)
        for version in range(3, 7):
            _step(model, 1)
            started = time.monotonic()
            with pytest.raises(ws.SyncTimeoutError, match="passed by: still no ack for version 2"):
                scheme.send()
            assert time.monotonic() - started < 2  # (not waited for)
            assert good.version == str(version) and _same(good, model)
        release.set()
        assert engines.idle(10)  # (its calls return: version 1's load; version 2's gave up on their turn)
        assert hung.version == "1"
        _step(model, 1)
        scheme.send()
        assert good.version == hung.version == "7" and _same(good, model) and _same(hung, model)
    finally:
        release.set()
        scheme.shutdown()


def test_an_engine_whose_loads_outlast_a_send_or_two_is_served_by_the_next_send_not_passed_by():
    """Only the newest version's calls running, an engine is slow, not hung: the next send serves it, as it did
    before hung engines were passed by (its calls for version 1 done, those for version 2 running, it was passed by
    for three sends)."""
    model = build("tiny")
    loads = {1: 1.2, 2: 0.9}  # (seconds: past the 1 s timeout)

    class Slow(Engine):
        def update_weights(self, update_info: dict) -> None:
            time.sleep(loads.get(update_info["version"], 0.0))
            super().update_weights(update_info)

    good, slow = Engine(engine_spec(model)), Slow(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=1, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([good, slow], pause_mode="none"))
        scheme.connect()
        for version in (1, 2):
            _step(model, 1)
            with pytest.raises(ws.SyncTimeoutError, match=f"worker 1, version {version}.*no ack"):
                scheme.send()
        for version in (3, 4, 5):
            _step(model, 1)
            scheme.send()
            assert good.version == slow.version == str(version) and _same(slow, model)
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("hangs_in", ["load", "engine"])
def test_a_hung_engine_whose_client_gives_up_is_passed_by_until_it_answers_and_the_other_is_sent_every_version(
    hangs_in, loop
):
    """An ``AsyncLLM``'s client gives up on a call at its bound while the engine still runs it: once its calls gave
    up, the engine is passed by until it answers. Each send names it, the other engine is sent every version, and
    no slot more leaves the pool for it. Released, it answers: its load of the version it was sent ends and acks it
    (``load``), or, where its engine was stuck before the update began (``engine``), it is asked once more to load
    that version; the next send reaches it. (Sent each version, it held a slot of each: from the third send on, the
    other engine was sent none.)"""
    pytest.importorskip("vllm")  # (the client builds vLLM's request objects)
    model = build("tiny")
    good, hung = Engine(engine_spec(model)), InOrder(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=1, connect_timeout=30)
    engines = VLLMEngines([good, hung], pause_mode="keep", loop=loop)
    release = threading.Event()
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        if hangs_in == "load":
            hung.loading = release  # (version 1's load goes on once it is set)
        else:
            hung.core.submit(release.wait, 60)  # (its engine core stuck: every call waits behind it)
        pools = engines._gate.inner.pools.values()
        left = []
        for _ in range(10):
            _step(model, 1)
            with pytest.raises(ws.SyncTimeoutError) as raised:
                scheme.send()
            assert raised.value.worker_idx == 1, raised.value
            left.append(sum(len(pool.left) for pool in pools))
        assert good.version == "10" and _same(good, model)
        assert left[-1] == left[4] <= 3, left  # (the slots of the versions sent to it before it was passed by)
        release.set()
        assert wait_until(lambda: sent_without_a_time_out(scheme), deadline_after(20), 0.2)
        assert good.version == hung.engine.version == str(scheme.version)
        assert _same(good, model) and _same(hung.engine, model)
    finally:
        release.set()
        scheme.shutdown()


class SlowToPause:
    """An ``AsyncLLM`` as vLLM 0.32 behaves (on the loop the test runs): its engine core takes the pause at once
    and answers once the requests in flight drained (``pause_mode="wait"``, here while ``draining``), and its worker
    refuses a second ``start_weight_update`` before ``finish_weight_update`` (the :class:`Engine`'s assertion)."""

    def __init__(self, spec: dict) -> None:
        self.engine = Engine(spec)
        self.paused, self.draining = False, False
        self.changed = threading.Condition()  # notified when it resumes or its update session ends
        self.resumes = threading.Event()  # cleared: resume_generation waits until it is set
        self.resumes.set()
        self.loading_s = 0.0  # how long update_weights takes
        self.resumed_at: float | None = None  # time.monotonic() of its last resume

    async def init_weight_transfer_engine(self, request) -> None:
        await asyncio.to_thread(self.engine.init_weight_transfer_engine, request.init_info)

    async def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    async def update_weights(self, request) -> None:
        if request.update_info.get("wait", True):  # (asked not to wait, the backend answers at once)
            await asyncio.sleep(self.loading_s)
        await asyncio.to_thread(self.engine.update_weights, request.update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        try:
            self.engine.finish_weight_update(weight_version)
        finally:
            with self.changed:
                self.changed.notify_all()

    async def update_weight_version(self, version: str) -> None:
        self.engine.version = version

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True
        while self.draining:
            await asyncio.sleep(0.05)

    async def resume_generation(self) -> None:
        await asyncio.to_thread(self.resumes.wait, 10)
        with self.changed:
            self.paused, self.resumed_at = False, time.monotonic()
            self.changed.notify_all()

    async def shutdown_weight_transfer_engine(self) -> None:
        self.engine.shutdown_weight_transfer_engine()


@contextlib.contextmanager
def _serving_slow_to_pause(loop, timeout: float):
    """A connected ``shared_mem`` scheme with ``timeout``, serving one :class:`SlowToPause` (``pause_mode="wait"``):
    (the trainer's model, the engine, the scheme), shut down after."""
    pytest.importorskip("vllm")  # (the client builds vLLM's request objects)
    model = build("tiny")
    target = SlowToPause(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=timeout, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([target], pause_mode="wait", loop=loop))
        scheme.connect()
        yield model, target, scheme
    finally:
        scheme.shutdown()


class _FailsSlowlyAt(Engine):
    """An engine whose load of one version fails after 0.5 s (its later versions load)."""

    def update_weights(self, info):
        if info["version"] == self.fail_update_at and info.get("wait", True):
            time.sleep(0.5)
        return super().update_weights(info)


def test_an_engine_that_serves_a_version_after_an_earlier_ones_load_failed_is_known_to_hold_it():
    """Two async versions: the engine's load of the first fails, slowly; the second is served. ``wait_async``
    names the first's failure, and the trainer knows the engine holds the second: its ack, which came with the
    failure, is passed on (it was dropped: the next ``wait_async`` waited for it until its timeout, and under
    ``on_failure="drop"`` would have dropped an engine that serves the newest version)."""
    model = build("tiny")
    engine = _FailsSlowlyAt(engine_spec(model), fail_update_at=1)
    scheme = ws.MultiProcessWeightSyncScheme(timeout=4, connect_timeout=30, sync=False)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([engine], pause_mode="none"))
        scheme.connect()
        for _ in range(2):
            _step(model, 1)
            scheme.send_async()
        with pytest.raises(ws.WeightSyncError, match=r"version 1\].*could not load"):
            scheme.wait_async()
        assert engine.version == "2" and _same(engine, model) and scheme.acked_versions == {0: 2}
        began = time.monotonic()
        scheme.wait_async()
        assert time.monotonic() - began < 2.0
        _step(model, 1)
        scheme.send_async()
        scheme.wait_async()
        assert engine.version == "3" and _same(engine, model) and scheme.acked_versions == {0: 3}
    finally:
        scheme.shutdown()


def test_an_update_that_fails_in_the_middle_leaves_the_engine_generating_with_no_update_open(loop):
    """A pause that outlasts the timeout (requests that take long to drain, ``pause_mode="wait"``): the send names
    the engine, and the engine is resumed and its update session ended, so that the next versions are served, even
    when the next one's calls are made while the undoing is still under way (here its resume is held until after
    the next send began). The call that timed out, ended past its send, is not raised again by the next send, which
    the engine serves (before, it was)."""
    with _serving_slow_to_pause(loop, timeout=2) as (model, target, scheme):
        target.draining = True
        target.resumes.clear()
        _step(model, 1)
        with pytest.raises(ws.SyncTimeoutError, match="worker 0"):
            scheme.send()
        target.draining = False
        _step(model, 1)
        threading.Timer(0.5, target.resumes.set).start()
        scheme.send()
        assert target.engine.version == "2" and _same(target.engine, model)
        with target.changed:
            assert target.changed.wait_for(lambda: not target.paused and not target.engine.active, 10)
        _step(model, 1)
        scheme.send()
        assert target.engine.version == "3" and _same(target.engine, model) and not target.paused


def test_an_updates_calls_share_the_timeout_so_an_engine_is_not_held_paused_for_several(loop):
    """A pause that drains for most of the timeout, then a load longer than what is left: the load is cut at the
    timeout, and the engine resumed then (each call had the whole timeout: the engine stayed paused until the
    load ended or its own timeout did: 2.4 + 3 s here, against a timeout of 3)."""
    with _serving_slow_to_pause(loop, timeout=3) as (model, target, scheme):
        target.draining, target.loading_s, target.resumed_at = True, 5.0, None
        threading.Timer(2.4, lambda: setattr(target, "draining", False)).start()
        _step(model, 1)
        started = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match="worker 0"):
            scheme.send()
        with target.changed:
            assert target.changed.wait_for(lambda: target.resumed_at is not None, 10)
        assert target.resumed_at - started < 4.4


class InOrder:
    """An ``AsyncLLM`` as vLLM 0.32 runs its calls: its engine core makes them one at a time, in the order they
    came, and one whose caller gave up (its await cancelled at the client's timeout) still runs to its end (vLLM's
    ``collective_rpc`` does). A load goes on until ``loading`` is set, where it is an event (then the next loads
    are at once)."""

    def __init__(self, spec: dict) -> None:
        self.engine = Engine(spec)
        self.core = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="test-engine-core")
        self.loading: threading.Event | None = None
        self.paused = False
        self.finishes_asked: list[str | None] = []  # each finish_weight_update's version, as it is called
        self.starts_asked = 0

    async def _in_core(self, call, *args) -> None:
        # (sent to the engine core at once, as vLLM's utility calls are: a caller that gave up takes back nothing)
        await asyncio.shield(asyncio.wrap_future(self.core.submit(call, *args)))

    async def init_weight_transfer_engine(self, request) -> None:
        await self._in_core(self.engine.init_weight_transfer_engine, request.init_info)

    async def start_weight_update(self) -> None:
        self.starts_asked += 1
        await self._in_core(self.engine.start_weight_update)

    async def update_weights(self, request) -> None:
        def load() -> None:
            if self.loading is not None:
                self.loading.wait(30)
                self.loading = None
            self.engine.update_weights(request.update_info)

        await self._in_core(load)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finishes_asked.append(weight_version)
        await self._in_core(self.engine.finish_weight_update, weight_version)

    async def update_weight_version(self, version: str) -> None:
        await self._in_core(setattr, self.engine, "version", version)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._in_core(setattr, self, "paused", True)

    async def resume_generation(self) -> None:
        await self._in_core(setattr, self, "paused", False)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        await self._in_core(self.engine.reset_prefix_cache)
        return True

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._in_core(self.engine.shutdown_weight_transfer_engine)


def test_an_update_that_outlasts_its_timeout_and_loads_all_the_same_is_named_for_what_the_engine_computes(loop):
    """The engine runs a call to its end whatever became of its caller: a load longer than the timeout fails the
    send, and lands after. The engine is then named for the version it computes with, before it resumes. (Before,
    it computed with version 1 under the name "0".)"""
    pytest.importorskip("vllm")  # (the client builds vLLM's request objects)
    model = build("tiny")
    target = InOrder(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=2, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([target], loop=loop))
        scheme.connect()
        target.engine.calls.clear()
        target.loading = loaded = threading.Event()
        _step(model, 1)
        with pytest.raises(ws.SyncTimeoutError, match="worker 0"):
            scheme.send()
        # The engine's calls have a deadline of their own, a little later than the send's: the load lands once
        # they too gave up on it (their undoing, finish_weight_update(None), is asked, behind the load).
        assert wait_until(lambda: None in target.finishes_asked, deadline_after(10), 0.02)
        loaded.set()  # the load lands past the send that gave up on it
        assert wait_until(lambda: target.engine.version == "1", deadline_after(10), 0.05)
        assert _same(target.engine, model) and not target.engine.active
        assert wait_until(lambda: not target.paused, deadline_after(10), 0.05)
        calls = target.engine.calls
        assert calls[:4] == ["start", "update 1", "finish None", "start"], calls  # the late load, then a look
        _step(model, 1)
        scheme.send()
        assert target.engine.version == "2" and _same(target.engine, model)
    finally:
        scheme.shutdown()
        target.core.shutdown(wait=False)


def test_an_update_that_outlasts_the_look_after_it_leaves_no_session_open(loop):
    """A load that lasts past its calls' undoing and the look whether it landed (each a timeout): the look's
    start, which timed out behind the load, begins a session when the load ends. It is ended behind it, so that the
    next version's start is taken (before, the session stayed open and every later send failed). The next send
    does not raise the engine's own time-out of the version before, reported after the send that timed out for it."""
    pytest.importorskip("vllm")  # (the client builds vLLM's request objects)
    model = build("tiny")
    target = InOrder(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=1, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([target], pause_mode="keep", loop=loop))
        scheme.connect()
        target.engine.calls.clear()
        target.loading = loaded = threading.Event()
        _step(model, 1)
        with pytest.raises(ws.SyncTimeoutError, match="worker 0"):
            scheme.send()
        assert wait_until(lambda: target.starts_asked == 2, deadline_after(10), 0.02)  # the look, behind the load
        time.sleep(1.5)  # (past the look's own timeout: its caller gave up on it)
        loaded.set()
        assert wait_until(lambda: target.engine.calls.count("start") == 2, deadline_after(10), 0.05)
        assert wait_until(lambda: not target.engine.active and not target.paused, deadline_after(10), 0.05), (
            target.engine.calls
        )
        _step(model, 1)
        scheme.send()
        assert target.engine.version == "2" and _same(target.engine, model)
    finally:
        loaded.set()
        scheme.shutdown()
        target.core.shutdown(wait=False)


@contextlib.contextmanager
def _async_behind_a_held_load(loop, versions: int):
    """An ``InOrder`` engine served ``send_async`` (``timeout`` 1 s), whose load of the first of ``versions`` sent
    lasts: yields the scheme and the event that lets the load go on, once the engine's calls for all of them are
    done (failed)."""
    pytest.importorskip("vllm")  # (the client builds vLLM's request objects)
    model = build("tiny")
    target = InOrder(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=1, connect_timeout=30, sync=False)
    engines = VLLMEngines([target], pause_mode="keep", loop=loop)
    loaded = threading.Event()
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        target.loading = loaded
        for _ in range(versions):
            _step(model, 1)
            scheme.send_async()
        gate = engines._gate
        assert wait_until(lambda: all(f.done() for _, f in gate._calls.get(0, [])), deadline_after(20), 0.05)
        _step(model, 1)
        yield scheme, loaded
    finally:
        loaded.set()
        scheme.shutdown()
        target.core.shutdown(wait=False)


def test_an_async_versions_time_out_is_named_by_the_next_send_async_while_the_engine_acked_nothing_newer(loop):
    """``send_async`` alone (no ``wait_async``): the engine's calls for version 1 give up behind a load that lasts,
    and nothing newer was acked since. The next ``send_async`` passes the engine by, naming that time-out (no send
    raised it before)."""
    with _async_behind_a_held_load(loop, 1) as (scheme, _):
        with pytest.raises(ws.SyncTimeoutError, match=r"worker 0, version 2\] passed by: still no ack for version 1"):
            scheme.send_async()


def test_two_async_versions_that_give_up_behind_one_load_are_waited_for_until_it_goes_on(loop):
    """Two ``send_async`` to an engine whose load of version 1 lasts: the calls for version 1 give up at their bound
    while the engine runs on, and version 2's never get their turn. The engine may still answer: ``wait_async``
    waits for version 2 within its own timeout, and raises that time-out, naming the version; once the load goes
    on the engine acks, its calls for version 2 are made again, and it serves version 2."""
    with _async_behind_a_held_load(loop, 2) as (scheme, loaded):
        started = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match=r"worker 0, version 2\] no ack for version 2 within 2s"):
            scheme.wait_async(timeout=2)
        assert time.monotonic() - started < 10
        loaded.set()
        scheme.wait_async(timeout=20)
        assert scheme.acked_versions == {0: 2}


def test_failures_on_both_sides_of_a_served_version_are_named_with_the_later_ones_own_cause():
    """Versions 1 and 3 fail, 2 is served between them: the failure reported is version 3's, with its own cause
    (not version 1's, which the engine's serving version 2 made moot)."""
    hold = threading.Event()

    class Picky(Engine):
        def update_weights(self, update_info):
            if update_info.get("wait", True) and update_info["version"] in (1, 3):
                if update_info["version"] == 1:
                    hold.wait(20)
                self.active = False
                raise RuntimeError(f"bad version {update_info['version']}")
            return super().update_weights(update_info)

    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=20, sync=False)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([Picky(engine_spec(model))], pause_mode="none"))
        scheme.connect()
        for _ in range(3):
            _step(model, 1)
            scheme.send_async()
        hold.set()
        with pytest.raises(ws.WeightSyncError, match=r"version 3\].*bad version 3"):
            scheme.wait_async(timeout=20)
    finally:
        hold.set()
        scheme.shutdown()


def test_an_engine_behind_by_several_versions_names_each_one_it_computes_with():
    """Async sends faster than the engine loads: each update_weights(v) loads version v itself, so that the
    weight version finish_weight_update gives the engine is the one it computes with (a receiver that takes only
    the newest of the versions waiting, as workers do by default, had it compute with v + 1 under the name v)."""
    model = build("tiny")
    sent: dict[int, dict[str, torch.Tensor]] = {}
    named_wrong: list[tuple[int, list[int]]] = []

    class Slow(Engine):
        def update_weights(self, update_info: dict) -> None:
            time.sleep(0.2)  # the step in flight, the load: the next versions come meanwhile
            super().update_weights(update_info)

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            if weight_version is not None and not _same_as(self, sent[int(weight_version)]):
                named_wrong.append((int(weight_version), [v for v, w in sent.items() if _same_as(self, w)]))
            super().finish_weight_update(weight_version)

    engine = Slow(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=10, connect_timeout=30, sync=False)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([engine], pause_mode="none"))
        scheme.connect()
        for version in range(1, 6):
            _step(model, 1)
            sent[version] = {k: v.clone() for k, v in flatten_weights(model, "tensordict").items()}
            scheme.send()
        scheme.wait_async()
        assert named_wrong == []  # (version named, versions held)
        assert engine.version == "5" and _same(engine, model)
    finally:
        scheme.shutdown()


class Resetting:
    """An ``AsyncLLM``'s ``reset_prefix_cache``, as vLLM 0.32 answers it: ``False`` while a request runs, unless
    the running requests are reset too."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.asked.append(reset_running_requests)
        return reset_running_requests


def test_an_async_engine_whose_loop_does_not_run_is_named_at_its_first_call_not_waited_for():
    """Its calls are scheduled on the loop given: one that does not run never ran them, and connect waited its whole
    timeout ("workers [0] did not connect within 5s"), saying nothing of the loop."""
    stopped = asyncio.new_event_loop()
    target = Resetting()
    try:
        with pytest.raises(ws.ConfigurationError, match="engine 0: the event loop given for it does not run"):
            AsyncLLMClient(target, "engine 0", stopped).reset_prefix_cache(60)
    finally:
        stopped.close()
    assert target.asked == []


def test_a_send_from_the_async_engines_own_loop_is_refused_at_once_and_one_from_another_thread_serves(loop):
    """A coroutine on the loop an ``AsyncLLM`` runs on that calls ``send()`` holds that loop, where the engine's
    calls are scheduled: they cannot run, and the send waited its whole ``timeout`` (a user's audit). It is refused
    before anything is published, naming the way out."""
    pytest.importorskip("vllm")  # (the client builds vLLM's request objects)
    model = build("tiny")
    target = InOrder(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=60, connect_timeout=30)

    async def send_here() -> None:
        scheme.send()

    async def send_beside() -> None:
        await asyncio.to_thread(scheme.send)

    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([target], pause_mode="keep", loop=loop))
        scheme.connect()
        _step(model, 1)
        began = time.monotonic()
        with pytest.raises(ws.ConfigurationError, match="engine 0: called from the event loop its AsyncLLM runs on"):
            asyncio.run_coroutine_threadsafe(send_here(), loop).result(90)
        assert time.monotonic() - began < 30 and scheme.stats()["version"] == 0  # (nothing published)
        asyncio.run_coroutine_threadsafe(send_beside(), loop).result(90)
        assert target.engine.version == "1" and _same(target.engine, model)
    finally:
        scheme.shutdown()


def test_an_engine_not_paused_resets_its_running_requests_prefixes_too_and_a_refused_reset_is_an_error(loop):
    """An engine not paused when its prefix cache is reset (its update failed before the pause) may have a request
    running: its cached prefix is reset with the others (vLLM refuses a reset of the cache while a request holds
    part of it), and a refusal is raised, not left as a warning in the engine's log while stale keys and values are
    reused."""
    target = Resetting()
    AsyncLLMClient(target, "engine 0", loop).reset_prefix_cache(5)
    assert target.asked == [True]

    async def refuse(reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return False

    target.reset_prefix_cache = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="engine 0: the engine did not reset its prefix cache"):
        AsyncLLMClient(target, "engine 0", loop).reset_prefix_cache(5)
    with pytest.raises(RuntimeError, match="did not reset its prefix cache"):
        EngineClient(
            type("LLM", (), {"reset_prefix_cache": lambda self, **kw: False})(), "engine 1"
        ).reset_prefix_cache(5)


class Reports:
    """The core's side of the driver's gate: what reached it."""

    model_id = "policy"
    timeout = connect_timeout = 5.0

    def __init__(self) -> None:
        self.failures: list[ws.WeightSyncError] = []

    def failed(self, worker: int, error: ws.WeightSyncError) -> None:
        self.failures.append(error)

    def is_dead(self, worker: int) -> bool:
        return False


@pytest.mark.parametrize("init_fails", [True, False])
def test_a_receivers_failure_during_its_engines_init_waits_for_the_init_whose_error_is_the_cause(init_fails):
    """Ray's version 0 is a call into the engine's actor made after its init call: where the init failed (an engine
    whose worker is a process of its own), that call fails too, for want of a receiver, and its failure may reach
    the trainer first. The engine's error is the one reported (it names the way out); the receiver's, held until
    the init returned, where the init did not fail."""
    from weightsync.integrations.vllm.gate import Gate

    model = build("tiny")
    core = Reports()
    gate = Gate(VLLMEngines([Engine(engine_spec(model))]), None, core)  # type: ignore[arg-type]
    init: concurrent.futures.Future = concurrent.futures.Future()
    gate._calls[0] = [(0, init)]
    consequence = ws.LifecycleError("this actor has no receiver for model 'policy'", model_id="policy", worker_idx=0)
    gate.failed(0, consequence)
    gate._forward()
    assert core.failures == []  # (held: the init is under way)
    if init_fails:
        init.set_exception(RuntimeError("start the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0"))
    else:
        init.set_result(None)
    gate._forward()
    assert len(core.failures) == 1
    message = str(core.failures[0])
    assert ("VLLM_ENABLE_V1_MULTIPROCESSING=0" in message) == init_fails
    assert ("no receiver" in message) != init_fails
    assert gate._failures == {} and gate._calls == {}


def test_a_receivers_failure_held_during_a_rejoining_engines_init_is_reported_once_it_returned():
    """The same hold while a replaced engine's init runs (``engines.replace``): once the init returned, the failure
    held is the core's to know, not left behind for the engine's next update to report."""
    from weightsync.integrations.vllm.gate import Gate

    model = build("tiny")
    core = Reports()
    gate = Gate(VLLMEngines([Engine(engine_spec(model))]), None, core)  # type: ignore[arg-type]
    gate.inner = type("Inner", (), {"pushes": False})()  # type: ignore[assignment]
    refused = ws.ReceiverError("ChecksumError", "the version did not match", model_id="policy", worker_idx=0)

    def init_steps(worker: int, initial: bool):
        def steps(client, left):
            gate.failed(worker, refused)  # (its receiver's failure, while the init call runs)

        return steps

    gate._init_steps = init_steps  # type: ignore[method-assign]
    gate.rejoin(0, 5.0)
    assert core.failures == [refused] and gate._failures == {}


class _Owned(EngineClient):
    """A client like an ``LLM``'s: its calls must end within the send that made them."""

    ends_within_send = True


class _Counted(Engine):
    """An engine whose loads take ``load_s`` (or until ``release``), which counts the trainer's calls under way."""

    def __init__(self, spec: dict, load_s: float) -> None:
        super().__init__(spec)
        self.load_s, self.release, self.under_way = load_s, threading.Event(), 0
        self._count = threading.Lock()

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name not in ("start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"):
            return attr

        def counted(*a, **k):
            with self._count:
                self.under_way += 1
            try:
                if name == "update_weights":
                    self.release.wait(self.load_s)
                return attr(*a, **k)
            finally:
                with self._count:
                    self.under_way -= 1

        return counted


@pytest.mark.parametrize("how", ["timed_out", "async", "still_running", "replaced", "shut_down"])
def test_a_send_returns_only_once_its_calls_into_an_llm_ended(how):
    """A ``vllm.LLM`` takes no call beside another: its owner's ``generate`` after a send that timed out, or
    after ``send_async``, took the update's answer for its own, and the engine failed for good. A send now returns
    only once its calls into such an engine ended; where they outlast the scheme's ``timeout`` once more, the error
    says they still run, and ``VLLMEngines.idle`` waits for them: after ``shutdown()`` too, and not for the calls of
    an engine another replaced (whose sends then settled on them, and failed)."""
    model = build("tiny")
    load_s = {"timed_out": 1.6, "async": 0.5}.get(how, 60)
    target = _Counted(engine_spec(model), load_s=load_s)
    scheme = ws.SharedMemWeightSyncScheme(timeout=1, connect_timeout=30)
    engines = VLLMEngines([_Owned(target, "vLLM engine 0")], pause_mode="none")
    with pytest.raises(ws.ConfigurationError, match=r"worker_ids \[1\] are not workers"):
        engines.idle(0, [1])
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        _step(model, 1)
        if how == "async":
            scheme.send_async()
            assert target.under_way == 0 and engines.idle(0)
            scheme.wait_async()
        elif how == "timed_out":
            with pytest.raises(ws.SyncTimeoutError, match="no ack for version 1"):
                scheme.send()
            assert target.under_way == 0 and engines.idle(0)
        else:
            with pytest.raises(ws.SyncTimeoutError, match="its calls still run") as raised:
                scheme.send()
            assert raised.value.worker_idx == 0 and not engines.idle(0)
            if how == "replaced":  # (its process killed: its receiver gone, its call never returns)
                target.shutdown_weight_transfer_engine()
                _step(model, 1)
                with pytest.raises(ws.WeightSyncError, match="worker 0"):
                    scheme.send()
                fresh = _Counted(engine_spec(model), load_s=0.0)
                engines.replace(0, _Owned(fresh, "vLLM engine 0"))  # (settled on the new engine's calls alone)
                assert engines.idle(0) and fresh.version == "3" and _same(fresh, model)
                target.release.set()
                return
            if how == "shut_down":
                scheme.shutdown()
                assert not engines.idle(0)  # (the call into the LLM still runs past the shutdown)
            target.release.set()
            assert engines.idle(10) and target.under_way == 0
            if how == "shut_down":
                return
        assert target.version == "1" and _same(target, model)
        target.load_s = 0.0
        _step(model, 1)
        scheme.send()
        assert target.version == "2" and _same(target, model)
    finally:
        target.release.set()
        scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed"])
def test_a_trainer_whose_engine_another_took_over_leaves_the_others_receiver_at_shutdown(name):
    """Trainer B re-inits an engine trainer A served (B's receiver replaces A's there); then A shuts down. vLLM's
    call that lets a receiver go names none: A's made the engine let B's go, and B's next send failed. A no longer
    tells an engine whose receiver it found gone (by the time it shuts down, or at its last send)."""
    model = build("tiny")
    engine = Engine(engine_spec(model))
    first = VLLMWeightSyncScheme(name, pause_mode="none", timeout=10, connect_timeout=30)
    second = VLLMWeightSyncScheme(name, pause_mode="none", timeout=10, connect_timeout=30)
    try:
        first.init_on_sender(model=model, engines=[engine])
        first.connect()
        _step(model, 1)
        second.init_on_sender(model=model, engines=[engine])
        second.connect()  # (A's receiver in the engine let go of first)
        assert engine.version == "0" and _same(engine, model)
        if name == "distributed":  # (A finds its receiver gone when it sends: it reads no line between sends)
            with pytest.raises(ws.WorkerDiedError, match="worker 0"):
                first.send()
        first.shutdown()
        assert engine.calls.count("shutdown") == 0 and engine.scheme is not None
        _step(model, 1)
        second.send()
        assert engine.version == "1" and _same(engine, model)
    finally:
        first.shutdown()
        second.shutdown()
    assert engine.calls[-1] == "shutdown"


def test_a_distributed_trainer_whose_master_port_another_served_keeps_its_store_when_that_one_shuts_down(
    monkeypatch,
):
    """Two trainers of one process given one ``MASTER_PORT`` (TorchRL's distributed collector sets it in the process
    and leaves it set): the first serves the store there, and the second found the port taken and joined that
    store as a client. The first's shutdown took the store away: the second's next send timed out (no ack) while
    its rejoin thread tried to reach the store again every second. Its client now holds that store."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    model = build("tiny")
    engines = [Engine(engine_spec(model)), Engine(engine_spec(model))]
    first = VLLMWeightSyncScheme("distributed", pause_mode="none", timeout=10, connect_timeout=30)
    second = VLLMWeightSyncScheme("distributed", pause_mode="none", timeout=10, connect_timeout=30)
    try:
        first.init_on_sender(model=model, engines=[engines[0]])
        first.connect()
        second.init_on_sender(model=model, engines=[engines[1]])
        second.connect()
        first.shutdown()
        _step(model, 1)
        second.send()
        assert engines[1].version == "1" and _same(engines[1], model)
    finally:
        first.shutdown()
        second.shutdown()


class _LeftInAnUpdate(Engine):
    """An engine a trainer died in the middle of updating: paused, its update session open. Its start says what
    vLLM's worker says while a session is open."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.active, self.paused = True, True

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        super().start_weight_update()


class _Pauses(EngineClient):
    pauses = True

    def pause(self, mode: str, timeout: float) -> None:
        self.target.paused = True

    def resume(self, timeout: float) -> None:
        self.target.paused = False


def test_a_trainer_that_takes_over_an_engine_left_in_an_update_ends_that_update_and_generates():
    """A trainer killed between its start (and pause) and its load left the engine paused with its session open:
    the next trainer's connect succeeded, and its first send failed at its start ("already active"), reported as the
    engine's failure."""
    model = build("tiny")
    engine = _LeftInAnUpdate(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([_Pauses(engine, "vLLM engine 0")]))
        scheme.connect()
        assert not engine.paused
        for version in (1, 2):
            _step(model, 1)
            scheme.send()
            assert engine.version == str(version) and _same(engine, model) and not engine.paused
    finally:
        scheme.shutdown()


def test_a_call_into_an_llm_that_outlasts_shutdown_is_waited_for_by_idle():
    """``shutdown()`` tells each engine to let its receiver go, and waits for that at most ``timeout``: a call
    into an ``LLM`` that outlasts it still runs after the shutdown, and ``idle()`` said there was none."""
    model = build("tiny")
    release = threading.Event()

    class SlowToLetGo(Engine):
        def shutdown_weight_transfer_engine(self) -> None:
            release.wait(30)
            super().shutdown_weight_transfer_engine()

    engine = SlowToLetGo(engine_spec(model))
    scheme = ws.SharedMemWeightSyncScheme(timeout=1, connect_timeout=30)
    engines = VLLMEngines([_Owned(engine, "vLLM engine 0")], pause_mode="none")
    try:
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        scheme.shutdown()
        assert not engines.idle(0) and not engines.idle(0, [0])
        release.set()
        assert engines.idle(10) and engine.scheme is None
    finally:
        release.set()
        scheme.shutdown()
