"""The trainer's side of the Ray engine: one object in the store per version, one call per actor."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from ... import checks
from ...core.engine import Outgoing, SenderEngine, Sink
from ...core.timing import remaining
from ...errors import ConfigurationError, LifecycleError, ReceiverError, WeightSyncError
from ...tensors.layout import FlatLayout
from .settings import RaySettings
from .transport import LayoutWanted, RayActorTransport, RayTransport, ReceiverShutDown, apply_in_actor

__all__ = ["DIRECT_MIN_BYTES", "RaySender", "ray"]

# A tensor of at least this many bytes is put in the object store straight from its own memory; smaller
# ones are packed together first (one object store buffer costs about as much as copying 100 KB).
DIRECT_MIN_BYTES = 256 * 1024
#: The longest error text an actor's failure is reported with.
MAX_ERROR_TEXT = 2000
#: How often the trainer looks for the call of a version held back (``latest_wins``) while Ray's thread has not
#: yet reported the end of the call before it, which sends it.
HELD_BACK_S = 0.002
#: How long a close waits for calls still on their way to end, to read their failures (seconds).
CLOSE_READ_S = 2.0


def ray() -> Any:
    """The ``ray`` module (imported on first use: a missing Ray costs nothing until a Ray scheme is used)."""
    try:
        import ray as module
    except ImportError as exc:  # pragma: no cover - needs an install without the ray extra
        raise ConfigurationError("the Ray schemes need Ray: pip install 'weightsync[ray]'") from exc
    return module


class RaySender(SenderEngine):
    """The sender's staging buffer, the newest version's object (for rejoins), one transport per actor.

    Args:
        settings: the transport's: ``ray`` (:class:`RayTransport`, calls into any actor) or ``ray_actor``
            (:class:`RayActorTransport`, calls the actor's own ``update_weights_*`` methods).
        actors: the actors' handles; worker ``i`` is the ``i``-th.
        extract_as: the strategy's format, for the actor's method.
    """

    pushes = True
    takes_deltas = True

    def __init__(
        self,
        sink: Sink,
        layout: FlatLayout,
        num_workers: int,
        settings: RaySettings,
        *,
        actors: list[Any],
        extract_as: str,
        checksum: bool = False,
        gpu: torch.device | None = None,
        latest_wins: bool = False,
    ) -> None:
        super().__init__(sink, layout, num_workers, checksum=checksum, gpu=gpu)
        self.latest_wins = latest_wins
        self.settings = settings
        self.transport_class: type[RayTransport] = settings.transport_class()
        self._in_actor: Callable[..., int] = apply_in_actor
        self.extract_as = extract_as
        self.transports = {i: self._transport(actor, i) for i, actor in enumerate(actors)}
        self._staging: torch.Tensor | None = None
        self._staging_views: dict[str, torch.Tensor] = {}
        self.newest: tuple[int, Any] | None = None  # (version, object ref) of the last send, for rejoins
        self._has_layout: set[int] = set()  # actors that applied once: they hold the layout
        #: The newest version's bytes (the sender core's) and version, where only changes were sent of it.
        self._unstaged: tuple[torch.Tensor | None, int] | None = None

    @property
    def passes_late_by(self) -> bool:  # type: ignore[override]
        """Where every actor's later versions are held back behind its call on its way (``latest_wins``: the newest
        replaces them, and goes once that call ended), a late actor holds one version and is sent the next as soon
        as it can take it; elsewhere each version would be a call pinning its object in the store: passed by."""
        return not all(transport.coalesce for transport in self.transports.values())

    def _transport(self, actor: Any, worker: int) -> RayTransport:
        transport = self.transport_class(actor, worker, self.sink.model_id, self.extract_as, self.sink)
        transport.in_actor = self._in_actor
        # (an integration's call around each update, a vLLM engine's, names each version it loads: all go)
        transport.coalesce = self.latest_wins and self._in_actor is apply_in_actor
        return transport

    def run_in_actor(self, call: Callable[..., int]) -> None:
        """Have each actor run ``call`` for each update from now on, in place of :func:`.transport.apply_in_actor`
        (same arguments and return; it calls that): an integration's work around the update, in the same call
        of the actor's.

        Raises:
            ConfigurationError: the transport is ``ray_actor``, whose updates are calls of the actor's own methods.
        """
        if issubclass(self.transport_class, RayActorTransport):
            raise ConfigurationError(
                f"the ray_actor transport's updates are calls of the actor's own update_weights_{self.extract_as} "
                "method: this actor's updates need the ray transport (RayWeightSyncScheme)"
            )
        self._in_actor = call
        for transport in self.transports.values():
            transport.in_actor, transport.coalesce = call, False

    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        return {}  # nothing to join: version 0 reaches each actor as a call

    def _staged(self) -> torch.Tensor:
        """The staging buffer, made at first use and reused by every send (ray.put copies out of it)."""
        if self._staging is None:
            self._staging = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._staging_views = self.layout.views(self._staging)
        return self._staging

    def stage(self, out: Outgoing, deadline: float) -> Any:
        if not out.whole_to and out.delta is not None:  # every actor is sent its changes: nothing whole is put
            return None
        if out.whole is not None and out.whole.is_cpu:  # flatten_sender: the weights lie in one buffer, in place
            buffers, ranges = self.layout.whole(out.whole)
        elif out.whole is not None:  # ... on a GPU: one copy out of it
            staging = self._staged()
            staging.copy_(out.whole)
            buffers, ranges = self.layout.whole(staging)
        else:
            # Large CPU tensors go as they are, the rest is packed: ray.put copies each byte once into the store.
            staging = self._staged()
            buffers, ranges = self.layout.pieces(out.flat, staging, DIRECT_MIN_BYTES, self._staging_views)
        return ray().put((ranges, [b.numpy() for b in buffers], self.digest(buffers)))

    def submit(self, out: Outgoing, staged: Any) -> None:
        if out.delta is not None:
            changes = ray().put(((), [out.delta.body.numpy()], None, out.delta.to_plain()))
            for w in out.delta_workers:  # (they applied a version: they hold the layout)
                self.transports[w].submit(out.version, changes, None, whole=False)
        if staged is None:  # an actor that rejoins is sent the core's copy of the version, put then
            self.newest, self._unstaged = None, (out.published, out.version)
            return
        for w in out.whole_to:
            # The layout travels until the actor has applied once (its first update carries it).
            self.transports[w].submit(out.version, staged, None if w in self._has_layout else self.layout.to_plain())
        self.newest, self._unstaged = (out.version, staged), None

    def resubmit(self, worker: int, actor: Any = None) -> int:
        """A new actor for ``worker`` (``None``: the same handle, restarted by Ray) is sent the newest version
        published; return that version."""
        if self.newest is None and self._unstaged is not None:
            published, version = self._unstaged
            assert published is not None
            buffers, ranges = self.layout.whole(published)
            self.newest = (version, ray().put((ranges, [b.numpy() for b in buffers], self.digest(buffers))))
        if self.newest is None:  # (connect() published version 0: changes alone went since, then a send failed)
            raise LifecycleError(
                "no whole version to send: the newest went as changes alone, and a send after it failed before it "
                "was published; rejoin after a send succeeded",
                model_id=self.sink.model_id,
                worker_idx=worker,
            )
        version, payload = self.newest
        old = self.transports[worker]
        old.close()  # (a version it held back is not sent: the newest goes now)
        self.transports[worker] = self._transport(old.actor if actor is None else actor, worker)
        self._has_layout.discard(worker)
        self.sink.rejoining(worker, version)  # from here on, a failure is this actor's
        self.transports[worker].submit(version, payload, self.layout.to_plain())
        return version

    def _newest_version(self) -> int | None:
        """The newest version published whole or as changes (what :meth:`resubmit` sends), if any."""
        if self.newest is not None:
            return int(self.newest[0])
        return self._unstaged[1] if self._unstaged is not None and self._unstaged[0] is not None else None

    def unpublished(self) -> None:
        self._unstaged = None  # (a whole version put before, in self.newest, still stands)

    def _refs(self, workers: list[int]) -> dict[Any, tuple[int, int, RayTransport]]:
        """``{ref: (worker, version, transport)}`` of the calls on their way to ``workers``."""
        transports = {w: self.transports[w] for w in workers}
        return {ref: (w, v, t) for w, t in transports.items() for v, ref in t.refs().items()}

    def poll(self, workers: list[int]) -> None:
        refs = self._refs([w for w in workers if not self.sink.is_dead(w)])
        if not refs:
            return
        ray_ = ray()
        ready, _ = ray_.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            w, v, transport = refs[ref]
            transport.forget(v)
            try:
                held = ray_.get(ref)
            except ray_.exceptions.RayActorError as exc:
                what = (
                    "is unavailable (restarting, or out of reach)"
                    if isinstance(exc, ray_.exceptions.ActorUnavailableError)
                    else "died"
                )
                self.sink.died(w, f"its actor {what} ({type(exc).__name__})")
                continue
            except Exception as exc:  # noqa: BLE001 - the actor's failure, as Ray delivers it
                cause = getattr(exc, "cause", None) or exc
                if isinstance(cause, ReceiverShutDown):
                    self.sink.died(w, "its receiver shut down (the actor lives on)")
                    continue
                if isinstance(cause, LayoutWanted) and self._newest_version() is not None:
                    # A new process behind the handle: sent the newest version whole, which acks this one too.
                    if self.transports[w] is transport:  # (once: a later call of the old process's says the same)
                        self.sink.rejoined(w, self.resubmit(w))
                    continue
                text = str(cause).splitlines()[-1][:MAX_ERROR_TEXT] if str(cause) else repr(cause)
                self.sink.failed(
                    w, ReceiverError(type(cause).__name__, text, model_id=self.sink.model_id, worker_idx=w, version=v)
                )
                continue
            if type(held) is not int or held < v:  # (an actor's own update method returns what it likes)
                self.sink.failed(w, self._not_held(w, v, held))
                continue
            self._has_layout.add(w)
            self.sink.acked(w, held)

    def _not_held(self, worker: int, version: int, said: Any) -> ReceiverError:
        return ReceiverError(
            "TypeError",
            f"the actor's update call returned {checks.shown(said)}, not the version it holds ({version} or later): "
            "an actor's own update_weights_* method returns what apply_in_actor returns",
            model_id=self.sink.model_id,
            worker_idx=worker,
            version=version,
        )

    def wait(self, workers: list[int], deadline: float) -> None:
        refs = list(self._refs(workers))
        if refs:
            ray().wait(refs, num_returns=len(refs), timeout=remaining(deadline))
        elif any(self.transports[w].holds_back() for w in workers):  # (a call for it soon: looked for again)
            time.sleep(min(HELD_BACK_S, max(remaining(deadline), 0.0)))
        else:  # no call on its way to them: nothing can come before the deadline
            time.sleep(max(remaining(deadline), 0.0))

    def close(self, timeout: float) -> None:
        # A call that failed and that no one read (an actor whose engine refused to start is sent version 0 all the
        # same) would be printed by Ray as an unhandled error, traceback and all, once its ref is dropped: those that
        # end within a moment are read here (that one was still on its way at the close of a connect that raised at
        # once, on a busy machine). One still running then is the actor's to report.
        # (Ray shut down already, at the process's exit: its calls would start a cluster anew, Ray's default way)
        refs = list(self._refs(list(self.transports))) if ray().is_initialized() else []
        with contextlib.suppress(Exception):  # Ray may be shut down already: nothing is reported then
            within = min(timeout, CLOSE_READ_S)
            ready, _ = ray().wait(refs, num_returns=len(refs), timeout=within) if refs else ([], [])
            for ref in ready:
                with contextlib.suppress(Exception):
                    ray().get(ref, timeout=0)
        for transport in self.transports.values():
            transport.close()
        self.transports.clear()
        self.newest, self._unstaged, self._staging, self._staging_views = None, None, None, {}
        self._has_layout.clear()
