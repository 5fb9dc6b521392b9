"""How a scheme reaches its workers: as plain data (``receiver_config``) or pickled, how it is rebuilt, and which
worker the rebuilt receiver is."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

from .. import checks, options
from ..errors import ConfigurationError, LifecycleError
from .choice import TransportChoice
from .properties import SchemeProperties
from .states import NEW, SENDING
from .workers import check_worker_idx, same_worker

__all__ = ["RECEIVER_OPT_INS", "SchemeHandoff"]

#: The opt-ins :func:`weightsync.config.from_config` takes, by name: a scheme's ``RECEIVER_OPT_IN`` is one.
RECEIVER_OPT_INS = ("allow_pickle", "allow_store_peers_to_run_code")


class SchemeHandoff(SchemeProperties, TransportChoice, options.Declared):
    """Receiver configs and pickling of :class:`~weightsync.core.scheme.WeightSyncScheme`: what a scheme hands a
    worker is its options (:class:`~weightsync.options.Declared`), its transport (:class:`TransportChoice`) and,
    from its runtime (:class:`SchemeProperties`), the sender's handoff, model and workers."""

    #: The caller's opt-in :func:`weightsync.config.from_config` needs to build a receiver that unpickles what a
    #: peer sends (:meth:`receiver_unpickles`): one of :data:`RECEIVER_OPT_INS`, the arguments it takes.
    RECEIVER_OPT_IN: ClassVar[str] = "allow_pickle"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.RECEIVER_OPT_IN not in RECEIVER_OPT_INS:  # from_config could never be given it
            raise ConfigurationError(
                f"{cls.__qualname__}.RECEIVER_OPT_IN is {cls.RECEIVER_OPT_IN!r}: from_config takes one of "
                f"{list(RECEIVER_OPT_INS)}"
            )

    def receiver_config(self, worker_idx: int) -> dict[str, Any]:
        """Plain data (YAML-able, no live objects, no secrets) from which worker ``worker_idx`` builds its side.

        In the worker: ``scheme = weightsync.config.from_config(cfg)`` (or
        ``hydra.utils.instantiate``, for configs you wrote), then
        ``scheme.init_on_receiver(model=...)`` and ``scheme.connect()``.
        Works in any process of this host, also one started by hand.

        Raises:
            LifecycleError: called before ``init_on_sender``.
        """
        rt = self._runtime
        rt.require(*SENDING, action="receiver_config")
        idx = check_worker_idx(worker_idx, rt.num_workers, rt.model_id)
        cls = type(self)
        scheme = {"_target_": f"{cls.__module__}.{cls.__qualname__}", **self.option_values()}
        if self.TRANSPORTS and self.transport_name != self.TRANSPORTS[0].name:
            scheme["transport"] = self.transport_name
        engine = rt.sending.engine if rt.sending is not None else None  # (none: a scheme that moves nothing)
        return {
            "_target_": "weightsync.config.make_receiver",
            "scheme": scheme,
            "model_id": rt.model_id,
            "worker_idx": idx,
            "connection": engine.connection() if engine is not None else {},
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
        class names in ``RECEIVER_OPT_IN``: ``allow_pickle`` unless it names the other of
        :data:`RECEIVER_OPT_INS`).
        """
        return None

    def _prepare_receiver(self, *, model_id: str, worker_idx: int, connection: dict[str, Any]) -> None:
        """Make a new scheme receiver-ready from a receiver config's fields."""
        rt = self._runtime
        rt.require(NEW, action="prepare a receiver")
        rt.model_id = model_id
        rt.worker_idx = check_worker_idx(worker_idx, rt.num_workers, rt.model_id)
        rt.handoff = dict(connection)

    def _receiver_idx(self, worker_idx: Any) -> int:
        """The index of this receiver for the ``worker_idx`` its caller gives: from 0 (the pickled :class:`Drive` says
        from which index its program counts), checked, and the one a receiver config made it for, if any."""
        rt = self._runtime
        idx = rt.drive.worker_idx(worker_idx) if rt.drive is not None else worker_idx
        made_for = rt.worker_idx if rt.handoff is not None else None
        return same_worker(idx, rt.num_workers, made_for, rt.model_id)

    def __getstate__(self) -> dict[str, Any]:
        """Options plus, for a sender, what a worker needs to reach it and how a program drives it; never runtime
        state."""
        rt = self._runtime
        state: dict[str, Any] = {"options": self.option_values(), "transport": self.transport_name}
        if rt.sending is not None and rt.sending.engine is not None and rt.state in SENDING:
            state["handoff"] = rt.sending.engine.handoff()
            rt.sending.processes.note_spawning()  # a worker process starting with it: connect() watches it
        elif rt.handoff is not None:
            state["handoff"] = rt.handoff
        if "handoff" in state:
            state.update(model_id=rt.model_id, num_workers=rt.num_workers, drive=rt.drive)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._configure(state["options"], {"transport": state["transport"]})  # a scheme's ends in a new runtime
        rt = self._runtime
        rt.handoff = state.get("handoff")
        rt.model_id = state.get("model_id")
        rt.num_workers = state.get("num_workers")
        rt.drive = state.get("drive")

    def __copy__(self) -> Any:
        raise LifecycleError("schemes are not copied; build a new one from the same arguments")

    def __deepcopy__(self, memo: dict) -> Any:
        if self._runtime.state != NEW:
            raise LifecycleError("only a new (uninitialized) scheme can be deep-copied")
        clone = type(self).__new__(type(self))
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone
