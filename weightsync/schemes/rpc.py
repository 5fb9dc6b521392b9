"""``RPCWeightSyncScheme``: weights to named workers over ``torch.distributed.rpc`` (TensorPipe)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import checks, options
from ..core.engine import ReceiverEngine, SenderEngine, Sink
from ..errors import ConfigurationError
from ..options import DELTA, MAX_BUFFERS, TRACK_WRITES, WIRE_DTYPE, option
from ..tensors.layout import FlatLayout
from ..transports.rpc.settings import RPCSettings
from .network import WORLD_SIZE, NetworkScheme

__all__ = ["RPCWeightSyncScheme"]


class RPCWeightSyncScheme(NetworkScheme, name="rpc"):
    """Synchronize a model to workers reached by ``torch.distributed.rpc``.

    A send copies the weights once into a flat buffer and makes one RPC per
    targeted worker carrying it. The worker holds the update until its loop
    calls ``receive()``, applies it, and answers: the answer is the ack, so
    ``send_async`` returns once the RPCs are made and ``wait_async`` (or a
    transport's ``wait_ack``) waits for the answers, each bounded by
    ``timeout``. A worker whose process dies fails its RPC at once and is named.

    By default the scheme runs the RPC world itself: the sender serves a TCP
    store on ``master_addr:master_port`` and is ``weightsync-trainer``;
    worker ``i`` is ``weightsync-worker-<i>``. Every RPC scheme of a process
    shares that world (one agent per process). If your code already called
    ``rpc.init_rpc``, pass ``worker_names=`` (the workers' RPC names) to
    ``init_on_sender`` and the scheme uses your agent as it is.

    Each message arrives in a buffer of its own, so a worker whose model is on
    the CPU takes that buffer as its model's memory instead of copying it (at
    the first update each tensor becomes a view of the buffer; later updates
    swap the memory behind that one storage, O(1)). ``keep_storage``, a
    ``wire_dtype`` to cast back from, or a model in shared memory at
    ``init_on_receiver`` copy into the model instead.

    **The RPC world runs code for anyone who can reach it.** ``torch.distributed.rpc``
    authenticates no peer: a process that reaches the sender's TCP store can take a
    worker's rank (the store's keys are listed by ``TCPStore.list_keys()``), join
    the world with torch's own ``rpc.init_rpc``, and call any function (``os.system``
    included) in the trainer and in every worker, as the user running them; torch
    unpickles and runs the call before any weightsync code sees it. On loopback that
    is every local user of the host (``/proc/net/tcp`` lists the port); otherwise,
    every host that can route to ``master_addr``. So ``init_on_sender`` and
    ``init_on_receiver`` refuse to start an RPC world (nothing is served, joined or
    spawned) unless you pass ``allow_store_peers_to_run_code=True``, and a receiver
    config is built only with ``from_config(cfg, allow_store_peers_to_run_code=True)``
    (the config's own field is never taken). Opt in only where every process
    that can reach the store is yours; otherwise use ``distributed``, which
    authenticates with the run key.

    An agent you started yourself (``worker_names=`` on the sender, a receiver config
    whose connection is ``{"external": true}``) needs no opt-in: your ``rpc.init_rpc``
    opened that world, weightsync opens nothing and reaches no further into it, so
    securing it is yours (the same risk applies).
    """

    allow_store_peers_to_run_code: bool = option(options.ALLOW_STORE_PEERS_TO_RUN_CODE)
    wire_dtype: str | None = option(WIRE_DTYPE)
    max_buffers: int = option(MAX_BUFFERS)
    delta: Any = option(DELTA)  # false, true or "auto"
    track_writes: bool = option(TRACK_WRITES)

    TRANSPORTS = (RPCSettings,)
    SENDER_HANDLES = ("worker_names",)
    # rpc's earlier switch, which covered only addresses off loopback: name its heir.
    RENAMED = {
        "allow_pickle": "RPCWeightSyncScheme takes allow_store_peers_to_run_code, not allow_pickle: the rpc scheme "
        "runs only for a user who accepts that every process reaching its store (on loopback too) can run code in "
        "the trainer and its workers"
    }

    #: The option only the caller's own code may set for a receiver built from a config
    #: (:func:`weightsync.config.from_config` takes it as an argument; the config's field is never taken).
    RECEIVER_OPT_IN = "allow_store_peers_to_run_code"

    def _check_opt_in(self, **where: Any) -> None:
        """Refuse to run an RPC world unless ``allow_store_peers_to_run_code`` says the user accepts what it allows."""
        if not self.allow_store_peers_to_run_code:
            raise ConfigurationError(
                "the rpc scheme lets every process that can reach its TCP store (every local user on loopback, "
                "every host that can route to master_addr otherwise) run any code in the trainer and every worker: "
                "torch.distributed.rpc authenticates no peer. Pass allow_store_peers_to_run_code=True (a scheme "
                "config's field allow_store_peers_to_run_code: true) only if every such process is yours, or use "
                "the distributed scheme, which authenticates its peers",
                **where,
            )

    def create_transport(self, **kwargs: Any) -> Any:
        """A transport to worker ``worker_idx`` (RPC name ``worker_name``)."""
        from ..transports.rpc.transport import RPCTransport

        return RPCTransport(model_id=self.model_id, **kwargs)

    def _count_workers(self, kwargs: dict[str, Any]) -> int:
        names = kwargs.get("worker_names")
        if names is None:
            if self.num_workers is None:
                raise ConfigurationError("RPCWeightSyncScheme.init_on_sender needs num_workers= (or worker_names=)")
            return self.num_workers
        if self.num_workers is not None and self.num_workers != len(names):
            raise ConfigurationError(
                f"num_workers={self.num_workers} but {len(names)} worker_names", model_id=self.model_id
            )
        return len(names)

    def _sender_engine(self, sink: Sink, layout: FlatLayout, num_workers: int, kwargs: dict[str, Any]) -> SenderEngine:
        from ..transports.network import resolve_master
        from ..transports.rpc.sender import RPCSender
        from ..transports.rpc.session import agent_running

        names = kwargs.get("worker_names")
        master = None
        if names is not None:
            names = [str(n) for n in names]
            if not agent_running():
                raise ConfigurationError(
                    "worker_names= uses an RPC agent you started; call rpc.init_rpc first, or leave worker_names "
                    "out and the scheme runs the RPC world itself",
                    model_id=self.model_id,
                )
        else:
            self._check_opt_in(model_id=self.model_id)
            master = resolve_master(self.master_addr, self.master_port)
        settings = self.settings
        assert isinstance(settings, RPCSettings)
        return RPCSender(
            sink,
            layout,
            num_workers,
            settings,
            names=names,
            master=master,
            checksum=self.checksum,
            gpu=self._model_gpu,
        )

    def _receiver_engine(
        self, handoff: dict[str, Any], kwargs: dict[str, Any], where: dict[str, Any]
    ) -> ReceiverEngine:
        from ..transports.rpc.receiver import RPCReceiver

        if handoff and not handoff.get("external"):
            self._check_opt_in(**where)
            workers = int(handoff["world_size"]) - 1
            if where.get("worker_idx") is not None and not 0 <= where["worker_idx"] < workers:
                raise ConfigurationError(  # (its rank would fail the world's formation with torch's words)
                    f"worker_idx {where['worker_idx']} is not a worker of this RPC world (0..{workers - 1})", **where
                )
        # A model in shared memory may be read by processes of the worker's own: written into, never moved.
        return RPCReceiver(handoff, take=not (self.keep_storage or self._model_kept_shared), where=where)

    @classmethod
    def check_receiver_connection(cls, connection: Any, model_id: str) -> dict[str, Any]:
        """``{"external": true}`` (the worker runs its own RPC agent), or the session to join: its token,
        the sender's store (host, port), the world size and the sender's ``init_rpc`` counter. Either may name the
        sender (``sender``, the id its calls carry), whose calls alone the worker's receiver then takes."""
        sender = {"sender": checks.text(r"[0-9a-f]{16}", what="16 hex digits")}
        if isinstance(connection, Mapping) and connection.get("external") is True:
            return checks.fields(connection, {"external": None, **sender}, "connection")
        fields = {
            "token": checks.text(r"[0-9a-f]{16}", what="16 hex digits"),
            "master_addr": checks.host,
            "master_port": checks.port,
            "world_size": WORLD_SIZE,
            "counter": checks.integer(0, 2**31 - 1),
        }
        return checks.fields(connection, {**fields, **sender}, "connection", required=tuple(fields))

    @classmethod
    def receiver_unpickles(cls, connection: Any) -> str | None:
        """The RPC world the connection names (``None`` for an agent of the worker's own): TensorPipe unpickles
        what its members send."""
        if connection.get("external"):
            return None
        return f"the RPC world at {connection['master_addr']}:{connection['master_port']}"
