"""``DistributedWeightSyncScheme``: weights over a torch.distributed process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from typing import Any

import torch

from .. import checks
from ..core.engine import ReceiverEngine, SenderEngine, Sink
from ..errors import ConfigurationError
from ..integrity import digest_device_check
from ..options import DELTA, MAX_BUFFERS, TRACK_WRITES, WIRE_DTYPE, option
from ..tensors.layout import FlatLayout
from ..transports.distributed.settings import BACKEND, BUCKET_MB, DistributedSettings
from .network import WORLD_SIZE, NetworkScheme

__all__ = ["DistributedWeightSyncScheme"]


class DistributedWeightSyncScheme(NetworkScheme, name="distributed", aliases=("torch_distributed", "gloo")):
    """Synchronize a model to workers over a torch.distributed process group of its own.

    The sender serves a TCP store (``master_addr:master_port``) and forms a
    group with its workers: rank 0 is the sender, rank ``i + 1`` worker ``i``.
    The group is standalone: the default process group, if the training job
    uses one, is not touched; if ``master_port`` is already the job's store,
    the scheme joins it under a key prefix of its own. A send copies the
    weights once into a flat buffer and sends it to each targeted worker
    (one message per worker and bucket, whatever the number of tensors); the
    worker acks over the group, so a dead rank fails the send at once.

    A worker applies updates in ``receive()`` (in its own thread: no update
    lands while it computes). A worker whose model is on the CPU (and whose
    weights travel in their own dtype) takes the buffer an update arrived in
    as its model's memory, which saves a copy of the weights per update: at
    the first update each tensor becomes a view of the buffer (the Parameter
    objects stay), later updates swap the memory behind that one storage,
    O(1) whatever the number of tensors. ``keep_storage``, a GPU model, a
    ``wire_dtype`` to cast back from, or a model in shared memory at
    ``init_on_receiver`` (``share_memory()``) copy into the model instead.

    A worker that died (or was dropped) may be started again under its index:
    it forms a two-rank group with the sender and gets the newest version
    published, while the others go on in the first group; a worker dropped
    while alive (its link was down) does so by itself at its next
    ``receive()``. A worker whose process is still alive keeps its index
    (checked when both run on one machine; from another machine the
    newcomer replaces it).

    Each run draws a random key. ``receiver_config(i)`` names the file it is
    in (``authkey_file``, owner-only), never the key: copy that file to each
    worker's host with the config. The store and the group's formation are
    open to whoever reaches the store's port (its keys, prefix included, are
    listed to anyone), so the key does the work: a worker's hello carries an
    HMAC made with it (no process without the key is admitted as a worker);
    everything a worker acts on from the sender (layout, verdicts,
    announcements, digests) is sealed with it; and each update's bytes are
    checked, in the buffer they arrived in and before the model sees them,
    against a keyed digest the sender sealed (AES-GMAC or Poly1305 under a
    one-time key, whichever costs less on the sender's CPU for the model's
    size, or HMAC-SHA256 where the ``cryptography`` package is missing; a
    worker whose libraries lack the MAC the sender picked reads each version's
    bytes and refuses it by name). A process that claims rank 0 without the
    key cannot make a worker apply anything.
    ``checksum=True`` adds nothing to that check here.

    ``init_on_sender`` needs ``num_workers=``; workers get the scheme pickled
    or as ``receiver_config(i)`` and call ``init_on_receiver(model=...,
    worker_idx=i)`` then ``connect()``.
    """

    backend: str = option(BACKEND)
    wire_dtype: str | None = option(WIRE_DTYPE)
    bucket_mb: float | None = option(BUCKET_MB)
    max_buffers: int = option(MAX_BUFFERS)
    delta: Any = option(DELTA)  # false, true or "auto"
    track_writes: bool = option(TRACK_WRITES)

    TRANSPORTS = (DistributedSettings,)
    RECEIVER_HANDLES = ("master_addr", "master_port", "world_size", "authkey", "authkey_file")

    def _checked_settings(self) -> DistributedSettings:
        """The transport's settings, once this process can run their backend (and ``checksum`` on its device)."""
        settings = self.settings
        assert isinstance(settings, DistributedSettings)
        if settings.backend == "nccl":
            import torch.distributed as dist

            if not (dist.is_nccl_available() and torch.cuda.is_available()):
                raise ConfigurationError(
                    "backend='nccl' needs CUDA and a torch build with NCCL; use backend='gloo' on CPU",
                    model_id=self.model_id,
                )
        digest_device_check(self.checksum, settings.device, model_id=self.model_id)
        return settings

    def create_transport(self, **kwargs: Any) -> Any:
        """A transport to worker ``worker_idx`` (``sync=``: whether its ``send_weights`` waits for the ack)."""
        from ..transports.distributed.transport import DistributedTransport

        return DistributedTransport(**kwargs)

    def _sender_engine(self, sink: Sink, layout: FlatLayout, num_workers: int, kwargs: dict[str, Any]) -> SenderEngine:
        from ..transports.distributed.sender import DistributedSender
        from ..transports.network import resolve_master

        settings = self._checked_settings()
        master = resolve_master(self.master_addr, self.master_port)
        return DistributedSender(sink, layout, num_workers, settings, master=master, gpu=self._model_gpu)

    def _receiver_engine(
        self, handoff: dict[str, Any], kwargs: dict[str, Any], where: dict[str, Any]
    ) -> ReceiverEngine:
        from ..transports.distributed.receiver import DistributedReceiver

        handoff = dict(handoff)  # with what init_on_receiver named (authkey_file=: the run key file's copy here)
        for key in ("master_addr", "master_port", "world_size", "authkey_file"):
            value = kwargs.pop(key, None)
            if value is not None:
                handoff[key] = value
        settings = self._checked_settings()
        # A model in shared memory may be read by processes of the worker's own: written into, never moved.
        return DistributedReceiver(
            handoff,
            settings,
            take=not (self.keep_storage or self._model_kept_shared),
            where=where,
            model_device=self.model_device,
        )

    @classmethod
    def check_receiver_connection(cls, connection: Any, model_id: str) -> dict[str, Any]:
        """The sender's store (host, port), the world size, the path of the run key's file (copied to the
        worker's host out of band; the key prefixes the run's keys in the store and proves the worker's hello),
        and, optional, that prefix (``run``), which the worker checks its ``model_id`` and key against."""
        from ..transports.keyfiles import check_run_key_path

        fields = {
            "master_addr": checks.host,
            "master_port": checks.port,
            "world_size": WORLD_SIZE,
            "authkey_file": None,
            "run": checks.text(r"weightsync/.+/[0-9a-f]{16}", what="a run's prefix (weightsync/<model_id>/<16 hex>)"),
        }
        required = ("master_addr", "master_port", "world_size", "authkey_file")  # (run: optional)
        checked = checks.fields(connection, fields, "connection", required=required)
        checked["authkey_file"] = check_run_key_path(checked["authkey_file"], "connection.authkey_file")
        return checked
