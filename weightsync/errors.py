"""The weightsync error tree.

Every error raised by weightsync derives from :class:`WeightSyncError` and
carries, where they are known, the model id, the worker index, the version and
the keys involved, both in its message and as attributes::

    WeightSyncError
    ├── ConfigurationError            bad argument or unknown backend (also ValueError)
    ├── LifecycleError                a call out of order (also RuntimeError)
    ├── InvalidWeightsError           weights that cannot be sent (also TypeError)
    │   └── WeightMismatchError       keys, shapes or dtypes differ from the target
    ├── DeltaBaseError                a delta against a version the worker does not hold (sent whole instead)
    ├── PassOnError                   an update applied, then not passed on by the program the worker serves
    ├── TransportError                the data plane broke
    │   ├── AuthenticationError       a peer failed the auth-key challenge
    │   ├── ConnectionClosedError     the peer closed its end (sender shut down)
    │   ├── WorkerDiedError           a worker process exited while awaited
    │   └── IntegrityError            a payload failed its checksum, or is truncated
    ├── SyncTimeoutError              a bounded wait ran out (also TimeoutError)
    ├── ReceiverError                 a worker failed to apply an update and said why
    └── SendFailedError               several workers failed in one send
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

__all__ = [
    "AuthenticationError",
    "ConfigurationError",
    "ConnectionClosedError",
    "DeltaBaseError",
    "IntegrityError",
    "InvalidWeightsError",
    "LifecycleError",
    "PassOnError",
    "ReceiverError",
    "SendFailedError",
    "SyncTimeoutError",
    "TransportError",
    "WeightMismatchError",
    "WeightSyncError",
    "WorkerDiedError",
]


def context(model_id: str | None = None, worker_idx: int | None = None, version: int | None = None) -> str:
    """``"[model 'policy', worker 0] "``: what a message is about, as every error and log line names it."""
    where = [
        text
        for text, known in (
            (f"model {model_id!r}", model_id is not None),
            (f"worker {worker_idx}", worker_idx is not None),
            (f"version {version}", version is not None),
        )
        if known
    ]
    return f"[{', '.join(where)}] " if where else ""


class WeightSyncError(Exception):
    """Root of every error weightsync raises.

    Attributes:
        model_id: the model the operation was about, if known.
        worker_idx: the worker involved, if known.
        version: the weights version involved, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        model_id: str | None = None,
        worker_idx: int | None = None,
        version: int | None = None,
    ) -> None:
        self.model_id = model_id
        self.worker_idx = worker_idx
        self.version = version
        self.detail = message
        super().__init__(context(model_id, worker_idx, version) + message)

    def __reduce__(self) -> tuple:
        # Subclasses take keyword-only arguments, which the default exception pickling cannot replay;
        # errors cross process boundaries (Ray tasks), so rebuild them from their state instead.
        return (_restore_error, (type(self), self.args, dict(self.__dict__)))


def _restore_error(cls: type[WeightSyncError], args: tuple, state: dict) -> WeightSyncError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ConfigurationError(WeightSyncError, ValueError):
    """An argument, option or backend name is invalid."""


class LifecycleError(WeightSyncError, RuntimeError):
    """A method was called in a state where it is not allowed."""


class InvalidWeightsError(WeightSyncError, TypeError):
    """Weights that cannot be extracted, sent or applied (for example non-tensors)."""


class WeightMismatchError(InvalidWeightsError):
    """An update does not match its target; nothing was written.

    Attributes:
        missing: keys the target has and the update lacks.
        extra: keys the update has and the target lacks.
        mismatched: ``{key: (update_spec, target_spec)}`` for shape or dtype differences.
        why: what the keys have in common and the way out, where the keys alone do not say it.
    """

    def __init__(
        self,
        *,
        missing: Iterable[str] = (),
        extra: Iterable[str] = (),
        mismatched: Mapping[str, tuple[str, str]] | None = None,
        why: str = "",
        **where: Any,
    ) -> None:
        self.missing = sorted(missing)
        self.extra = sorted(extra)
        self.mismatched = dict(mismatched or {})
        parts = []
        if self.missing:
            parts.append(f"missing keys {self.missing}")
        if self.extra:
            parts.append(f"extra keys {self.extra}")
        if self.mismatched:
            shown = ", ".join(f"{k!r}: got {a}, expected {b}" for k, a, b in _triples(self.mismatched))
            parts.append(f"mismatched {{{shown}}}")
        said = "; ".join(parts) + (f": {why}" if why else "")
        super().__init__(f"weights do not match the target: {said} (target left unchanged)", **where)


def _triples(mismatched: Mapping[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
    return [(k, a, b) for k, (a, b) in sorted(mismatched.items())]


class DeltaBaseError(WeightSyncError):
    """A worker was sent the changes against a version it does not hold (another version, other bytes, or a
    model that keeps no copy of them) and refused them, writing nothing: the sender sends that worker the
    version whole, in the same ``send()`` when it waits for acks (else in ``wait_async()``)."""


class PassOnError(WeightSyncError):
    """A worker applied an update (it holds the version, and its ack says so), then the program it serves failed
    to pass the update on (a driver's ``applied()``: TorchRL's collector to its own workers). The trainer's
    :class:`ReceiverError` names it."""


class TransportError(WeightSyncError):
    """The channel to a peer failed."""


class AuthenticationError(TransportError):
    """A peer did not prove it holds the scheme's auth key."""


class ConnectionClosedError(TransportError):
    """The peer closed the channel (for a receiver: the sender shut down or died)."""


class WorkerDiedError(TransportError):
    """A worker's process exited (its channel closed) while the sender waited on it."""


class IntegrityError(TransportError):
    """A payload failed its checksum or does not have the size its layout needs (corrupted or truncated);
    it was not applied and the model kept its previous weights."""


class SyncTimeoutError(WeightSyncError, TimeoutError):
    """A bounded wait ran out before the awaited peers answered."""


class ReceiverError(WeightSyncError):
    """A worker failed to apply an update and reported the cause.

    Attributes:
        remote_type: the exception class name raised in the worker.
        remote_message: its message.
    """

    def __init__(self, remote_type: str, remote_message: str, **where: Any) -> None:
        self.remote_type = remote_type
        self.remote_message = remote_message
        if remote_type == PassOnError.__name__:  # (applied: its message says so, and what failed after)
            super().__init__(f"receiver: {remote_message}", **where)
            return
        super().__init__(f"receiver failed to apply the update: {remote_type}: {remote_message}", **where)


class SendFailedError(WeightSyncError):
    """Several workers failed during one send; ``failures`` maps worker index to its error.

    Workers not listed were updated and acked.
    """

    def __init__(
        self, failures: Mapping[int, WeightSyncError], *, model_id: str | None = None, version: int | None = None
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        lines = "; ".join(f"worker {w}: {type(e).__name__}: {e.detail}" for w, e in self.failures.items())
        super().__init__(f"{len(self.failures)} workers failed: {lines}", model_id=model_id, version=version)


def by_worker(exc: WeightSyncError) -> dict[int, WeightSyncError]:
    """The per-worker failures an error stands for (none if it names no worker): :func:`raise_failures` undone."""
    failures = getattr(exc, "failures", None)
    if failures:
        return dict(failures)
    return {} if exc.worker_idx is None else {exc.worker_idx: exc}


def restated(error: WeightSyncError, version: int | None = None) -> WeightSyncError:
    """``error`` for a later call to report (a worker found gone is named by every send after): a copy, since an
    exception raised again grows its traceback by that call's frames, and keeps them and what they hold, at every
    raise. With ``version`` (a later version's send), about that version, saying since which one it holds. One
    raised before is the copy's cause: its traceback says where it arose."""
    state: dict[str, Any] = {key: list(value) if key == "__notes__" else value for key, value in error.__dict__.items()}
    if version is not None and error.version is not None and version != error.version:
        state.update(version=version, detail=f"since version {error.version}: {error.detail}")
    copy = type(error).__new__(type(error))
    Exception.__init__(copy, context(state["model_id"], state["worker_idx"], state["version"]) + state["detail"])
    copy.__dict__.update(state)
    if error.__traceback__ is not None:
        copy.__cause__ = error
    return copy


def raise_failures(failures: Mapping[int, WeightSyncError], *, model_id: str | None, version: int | None) -> None:
    """Raise the single failure as itself, several as one :class:`SendFailedError`."""
    if not failures:
        return
    if len(failures) == 1:
        raise next(iter(failures.values()))
    raise SendFailedError(failures, model_id=model_id, version=version)


def held_up(said: str, workers: Iterable[int], **where: Any) -> NoReturn:
    """Raise the time-out of a send's wait for a free staging buffer or slot (``said``): one error per worker that
    held it up (each is late: the sender core goes on past them), or one naming no worker where none is known."""
    raise_failures({w: SyncTimeoutError(said, **where, worker_idx=w) for w in workers}, **where)
    raise SyncTimeoutError(said, **where)


def first_line(exc: BaseException) -> str:
    """The gist of an engine's error: its first line, without the source location and the boilerplate advice."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(exc).__name__
    return text.split(". This is typically")[0][:300]
