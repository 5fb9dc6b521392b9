"""What the ``multiprocess`` and ``shared_mem`` schemes share: worker processes on this machine."""

from __future__ import annotations

from typing import Any, ClassVar

from .. import checks, options
from ..core.engine import ReceiverEngine, SenderEngine, Sink
from ..core.settings import TransportSettings
from ..options import option
from ..tensors.layout import FlatLayout
from ..transports.local.settings import MAX_SLOTS, MPSettings, SharedMemSettings
from .payload import PayloadScheme

__all__ = ["ABSTRACT_ADDRESS", "LocalScheme"]

#: A listener's address as receiver configs name it: an abstract Unix socket (no file on disk).
ABSTRACT_ADDRESS = checks.text(r"@[A-Za-z0-9_.\-]{1,100}", what="an abstract socket address (@ and a name)")


class LocalScheme(PayloadScheme, config="LocalSchemeConfig"):
    """Base of the schemes that reach worker processes on this machine.

    The trainer opens an authenticated listener on an abstract Unix socket
    (``init_on_sender``); each worker connects with the scheme pickled after
    ``init_on_sender``, or its ``receiver_config(i)``. A send writes the
    weights once into a shared memory slot no worker still reads, and tells
    each targeted worker which slot holds the new version; a worker that died
    may be started again under its index and gets the newest version.
    """

    background_thread: bool = option(options.BACKGROUND_THREAD)
    latest_wins: bool = option(options.LATEST_WINS)
    max_slots: int | None = option(MAX_SLOTS)

    TRANSPORTS: ClassVar[tuple[type[TransportSettings], ...]] = (MPSettings, SharedMemSettings)
    SENDER_HANDLES = ("address",)
    RECEIVER_HANDLES = ("address", "authkey", "authkey_file")
    #: Receivers copy every update into their model's tensors one by one, never binding them.
    keep_storage = False
    #: Every worker gets slots of its own.
    per_worker_weights = False

    def create_transport(self, **kwargs: Any) -> Any:
        """This scheme's transport over ``channel=`` for ``worker_idx=`` (sender side if this is a sender)."""
        sink = self._sending if self.is_sender else None
        return self.transport_class(kwargs["channel"], kwargs["worker_idx"], sink)

    def _sender_engine(self, sink: Sink, layout: FlatLayout, num_workers: int, kwargs: dict[str, Any]) -> SenderEngine:
        from ..transports.local.sender import LocalSender

        settings = self.settings
        assert isinstance(settings, MPSettings)
        return LocalSender(
            sink,
            layout,
            num_workers,
            settings,
            per_worker=self.per_worker_weights,
            checksum=self.checksum,
            address=kwargs.get("address"),
            gpu=self._model_gpu,
        )

    def _receiver_engine(
        self, handoff: dict[str, Any], kwargs: dict[str, Any], where: dict[str, Any]
    ) -> ReceiverEngine:
        from ..transports.local.receiver import LocalReceiver

        settings = self.settings
        assert isinstance(settings, MPSettings)
        placement = "share" if self.transport_class.pinning else ("write" if self.keep_storage else "load")
        device = self.model_device
        return LocalReceiver.from_handoff(
            handoff, kwargs, settings, placement=placement, where=where, device=device and str(device)
        )

    @classmethod
    def check_receiver_connection(cls, connection: Any, model_id: str) -> dict[str, Any]:
        """An abstract socket address, and the path of the key file the sender listening there writes."""
        from ..transports.keyfiles import check_key_file_path

        checked = checks.fields(
            connection,
            {"address": ABSTRACT_ADDRESS, "authkey_file": None},
            "connection",
            required=("address", "authkey_file"),
        )
        checked["authkey_file"] = check_key_file_path(
            checked["authkey_file"], checked["address"], "connection.authkey_file"
        )
        return checked
