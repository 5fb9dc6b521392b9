"""How a scheme reaches its workers: as plain data (``receiver_config``) or pickled, how it is rebuilt, and which
worker the rebuilt receiver is."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .. import checks
from ..errors import LifecycleError
from .states import NEW, SENDING
from .workers import check_worker_idx, same_worker

if TYPE_CHECKING:
    from .drivers import Drive

__all__ = ["HandoffMixin"]


class HandoffMixin:
    """Receiver configs and pickling of :class:`~weightsync.core.scheme.WeightSyncScheme`."""

    TRANSPORTS: ClassVar[tuple[Any, ...]]
    transport_name: str | None
    # What the scheme class provides (the lifecycle's state check, its options as plain data, its configure step).
    _require: Callable[..., None]
    option_values: Callable[[], dict[str, Any]]
    _configure: Callable[[dict[str, Any], dict[str, Any]], None]
    _state: str
    _model_id: str | None
    _worker_idx: int | None
    _num_workers: int | None
    _handoff: dict[str, Any] | None
    _drive: Drive | None
    _sending: Any

    def receiver_config(self, worker_idx: int) -> dict[str, Any]:
        """Plain data (YAML-able, no live objects, no secrets) from which worker ``worker_idx`` builds its side.

        In the worker: ``scheme = weightsync.config.from_config(cfg)`` (or
        ``hydra.utils.instantiate``, for configs you wrote), then
        ``scheme.init_on_receiver(model=...)`` and ``scheme.connect()``.
        Works in any process of this host, also one started by hand.

        Raises:
            LifecycleError: called before ``init_on_sender``.
        """
        self._require(*SENDING, action="receiver_config")
        idx = check_worker_idx(worker_idx, self._num_workers, self._model_id)
        cls = type(self)
        scheme = {"_target_": f"{cls.__module__}.{cls.__qualname__}", **self.option_values()}
        if self.TRANSPORTS and self.transport_name != self.TRANSPORTS[0].name:
            scheme["transport"] = self.transport_name
        assert self._sending is not None and self._sending.engine is not None
        return {
            "_target_": "weightsync.config.make_receiver",
            "scheme": scheme,
            "model_id": self._model_id,
            "worker_idx": idx,
            "connection": self._sending.engine.connection(),
        }

    @classmethod
    def check_receiver_connection(cls, connection: Mapping[str, Any], model_id: str) -> dict[str, Any]:
        """The ``connection`` of a receiver config for this class, checked as data: nothing is read or reached.

        Each scheme checks exactly what its ``receiver_config()`` emits there (by default, nothing). A
        third-party scheme that emits a connection overrides this.

        Raises:
            ConfigurationError: a field that is not this scheme's, a missing one, or one of the wrong shape.
        """
        return checks.fields(connection, {}, "connection")

    @classmethod
    def receiver_unpickles(cls, connection: Mapping[str, Any]) -> str | None:
        """The peer whose messages a receiver built from ``connection`` would unpickle (``None``: none).

        :func:`weightsync.config.from_config` builds such a receiver only with the caller's opt-in (the option the
        class names in ``RECEIVER_OPT_IN``, default ``allow_pickle``).
        """
        return None

    def _prepare_receiver(self, *, model_id: str, worker_idx: int, connection: dict[str, Any]) -> None:
        """Make a new scheme receiver-ready from a receiver config's fields."""
        self._require(NEW, action="prepare a receiver")
        self._model_id = model_id
        self._worker_idx = check_worker_idx(worker_idx, self._num_workers, self._model_id)
        self._handoff = dict(connection)

    def _receiver_idx(self, worker_idx: Any) -> int:
        """The index of this receiver for the ``worker_idx`` its caller gives: from 0 (the pickled :class:`Drive` says
        from which index its program counts), checked, and the one a receiver config made it for, if any."""
        idx = self._drive.worker_idx(worker_idx) if self._drive is not None else worker_idx
        made_for = self._worker_idx if self._handoff is not None else None
        return same_worker(idx, self._num_workers, made_for, self._model_id)

    def __getstate__(self) -> dict[str, Any]:
        """Options plus, for a sender, what a worker needs to reach it and how a program drives it; never runtime
        state."""
        state: dict[str, Any] = {"options": self.option_values(), "transport": self.transport_name}
        if self._sending is not None and self._sending.engine is not None and self._state in SENDING:
            state["handoff"] = self._sending.engine.handoff()
            self._sending.processes.note_spawning()  # a worker process starting with it: connect() watches it
        elif self._handoff is not None:
            state["handoff"] = self._handoff
        if "handoff" in state:
            state.update(model_id=self._model_id, num_workers=self._num_workers, drive=self._drive)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._configure(state["options"], {"transport": state["transport"]})
        self._handoff = state.get("handoff")
        self._model_id = state.get("model_id")
        self._num_workers = state.get("num_workers")
        self._drive = state.get("drive")

    def __copy__(self) -> Any:
        raise LifecycleError("schemes are not copied; build a new one from the same arguments")

    def __deepcopy__(self, memo: dict) -> Any:
        if self._state != NEW:
            raise LifecycleError("only a new (uninitialized) scheme can be deep-copied")
        clone = type(self).__new__(type(self))
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone
