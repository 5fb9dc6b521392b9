"""Every option of a scheme or a transport, declared once: name, default, type, check and meaning.

A class lists the options it takes in ``OPTIONS`` (schemes) or ``SETTINGS``
(a transport's own settings, which its scheme takes too). From that one list
come the class's constructor signature and its argument checks
(:class:`Configurable`), the Hydra dataclass configs and their YAML copies
(:mod:`weightsync.config.configs`), what a pickled scheme carries, what
``receiver_config()`` emits and what a receiver config may hold
(:mod:`weightsync.config.receiver`), and the options tables of the docs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from . import checks
from .errors import ConfigurationError

__all__ = ["Configurable", "Option"]


@dataclass(frozen=True)
class Option:
    """One option: what a constructor takes, a config holds and a receiver config carries.

    Attributes:
        name: the keyword argument, config field and attribute.
        default: its value when not given (plain data).
        annotation: its type in the Hydra config (``bool``, ``Optional[int]``, ...).
        doc: what it does, in one or two sentences.
        check: validates a given value (``check(value, where)``) and returns it as the option holds it.
        plain: the value as plain data, from what ``check`` returned (default: as it is).
    """

    name: str
    default: Any
    annotation: Any
    doc: str
    check: checks.Check
    plain: Callable[[Any], Any] | None = None

    def to_plain(self, value: Any) -> Any:
        return value if self.plain is None else self.plain(value)


def _strategy(value: Any, where: str) -> Any:
    from .tensors.strategy import EXTRACT_FORMATS, WeightStrategy

    if isinstance(value, WeightStrategy):
        return value
    if value not in EXTRACT_FORMATS:
        raise ConfigurationError(f"{where} must be one of {EXTRACT_FORMATS}, got {value!r:.80}")
    return WeightStrategy(value)


def _wire_dtype(value: Any, where: str) -> str | None:
    from .tensors.layout import wire_dtype_from_name

    if value is not None:
        wire_dtype_from_name(checks.text(max_len=40)(value, where))  # a bad name fails here, not at connect
    return value


def _flag(name: str, default: bool, doc: str) -> Option:
    return Option(name, default, bool, doc, checks.boolean)


def _positive(name: str, default: int | None, doc: str) -> Option:
    check = checks.integer(1, 2**31 - 1, what="a positive int" + (" or None" if default is None else ""))
    if default is None:
        return Option(name, None, Optional[int], doc, checks.optional(check))  # noqa: UP045 - omegaconf 2.3
    return Option(name, default, int, doc, check)


# ------------------------------------------------------------- every scheme
STRATEGY = Option(
    "strategy",
    "tensordict",
    str,
    '``"tensordict"`` (every parameter and buffer) or ``"state_dict"`` (persistent buffers only).',
    _strategy,
    plain=lambda strategy: strategy.extract_as,
)
SYNC = _flag("sync", True, "``send()`` blocks until every targeted worker applied and acked.")
TIMEOUT = Option(
    "timeout",
    60.0,
    float,
    "Seconds any single wait may last after connect (acks, receives, shutdown); at most 3600: a receiver config "
    "carries it, so whoever wrote the config decides how long a worker waits, and a wait of an hour (an update of "
    "hundreds of GB over 1 Gb/s) is already a hang to report.",
    checks.seconds,
)
CONNECT_TIMEOUT = Option(
    "connect_timeout",
    120.0,
    float,
    "Seconds the rendez-vous in ``connect()`` may last; at most 3600 (the slowest start of a cluster's workers; "
    "past it, ``connect()`` reports who is missing rather than wait on, whatever a receiver config asks).",
    checks.seconds,
)
ON_FAILURE = Option(
    "on_failure",
    "raise",
    str,
    '``"raise"``: a send raises an error naming a worker that died or did not ack in time; ``"drop"``: it logs '
    "a warning, stops sending to that worker and goes on (a restarted worker may rejoin). A worker that refuses "
    "an update raises in both modes.",
    checks.one_of("raise", "drop"),
)
MAX_STALENESS = Option(
    "max_staleness",
    None,
    Optional[int],  # noqa: UP045
    "In asynchronous sends, how many versions a worker may lag behind the one being published; "
    "``send_async`` first waits (at most ``timeout``) for workers further behind. ``None``: no bound.",
    checks.optional(checks.integer(0, 2**31 - 1, what="a non-negative int or None")),
)
CHECK_FINITE = _flag(
    "check_finite", False, "Refuse, in the caller and before any byte moves, weights holding NaN or Inf."
)
COMMON = (STRATEGY, SYNC, TIMEOUT, CONNECT_TIMEOUT, ON_FAILURE, MAX_STALENESS, CHECK_FINITE)

# ------------------------------------------------------ schemes moving bytes
CHECKSUM = _flag(
    "checksum",
    False,
    "The sender hashes each version's bytes (XXH3-64) and receivers check them before applying; a corrupted or "
    "truncated payload is refused with ``IntegrityError`` and the model keeps its weights.",
)
FLATTEN_SENDER = _flag(
    "flatten_sender",
    False,
    "At ``init_on_sender``, the trainer's weights move into one buffer laid out like the payload (each tensor a "
    "view of it, the Parameter objects kept), so a send is one copy whatever the number of tensors. Off by "
    "default: it changes the trainer's memory.",
)
BYTES = (CHECKSUM, FLATTEN_SENDER)

# ------------------------------------------------------- receivers' choices
LATEST_WINS = _flag("latest_wins", True, "A worker that fell behind applies only the newest of its pending versions.")
BACKGROUND_THREAD = _flag(
    "background_thread", False, "Receivers apply updates in a thread of their own; ``receive()`` reports them."
)
KEEP_STORAGE = _flag(
    "keep_storage",
    False,
    "Workers copy each update into their model's own tensors, whose memory never changes; by default a CPU "
    "model is bound, at its first update, to one buffer laid out like the payload (or takes the buffer the "
    "update arrived in), so that an update costs one copy, or none, whatever the number of tensors.",
)
PER_WORKER_WEIGHTS = _flag("per_worker_weights", False, "Every worker gets slots of its own (more memory).")
ALLOW_PICKLE = _flag(
    "allow_pickle",
    False,
    "Let peers on other machines reach the engine, which unpickles what they send: only if every machine that "
    "can reach it is yours (see docs/multinode.md).",
)
ALLOW_STORE_PEERS_TO_RUN_CODE = _flag(
    "allow_store_peers_to_run_code",
    False,
    "Required to run the RPC world (``rpc``), on loopback too: every process that can reach its TCP store (every "
    "local user of the host on loopback; every host that can route to ``master_addr`` otherwise) can join the "
    "world and run any code in every member of it, trainer included, as the user running it. "
    "``torch.distributed.rpc`` authenticates no peer and runs the calls it unpickles before weightsync sees them. "
    "Use ``distributed`` (it authenticates workers with the run key) unless every such process is yours.",
)

# ----------------------------------------------------------------- networks
MASTER_ADDR = Option(
    "master_addr",
    None,
    Optional[str],  # noqa: UP045
    "The trainer's host as workers reach it (``None``: ``MASTER_ADDR``, else 127.0.0.1).",
    checks.optional(checks.host),
)
MASTER_PORT = Option(
    "master_port",
    None,
    Optional[int],  # noqa: UP045
    "The TCP store's port (``None``: ``MASTER_PORT``, else a free port).",
    checks.optional(checks.integer(0, 65535, what="a port in 0..65535 or None")),
)
ADDRESS = Option(
    "address",
    None,
    Optional[str],  # noqa: UP045
    "Ray cluster to join when Ray is not initialized yet (``None``: ``RAY_ADDRESS``, else a new local cluster).",
    checks.optional(checks.text()),
)
NAMESPACE = Option("namespace", None, Optional[str], "Ray namespace.", checks.optional(checks.text()))  # noqa: UP045

# ------------------------------------------------------ transports' settings
MAX_SLOTS = _positive(
    "max_slots",
    None,
    "Shared weight slots the sender may allocate (``None``: ``num_workers + 2``, which no send "
    "pattern exceeds); fewer make a send wait for lagging workers.",
)
MAX_BUFFERS = _positive(
    "max_buffers",
    2,
    "Staging buffers the sender may hold while workers still take earlier versions; a send "
    "waits (up to ``timeout``) for one to be free.",
)
WIRE_DTYPE = Option(
    "wire_dtype",
    None,
    Optional[str],  # noqa: UP045
    'Floating weights travel as this dtype (``"bfloat16"``: half the bytes of float32) and are cast back when '
    "applied; ``None``: as they are.",
    _wire_dtype,
)
BACKEND = Option(
    "backend", "gloo", str, '``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA, GPU to GPU).', checks.one_of("gloo", "nccl")
)
BUCKET_MB = Option(
    "bucket_mb",
    None,
    Optional[float],  # noqa: UP045
    "Send the weights in buckets of at most this many MB, each copied while the previous one is on the wire "
    "(``None``: one message).",
    checks.optional(checks.number(0.0, 1e9, above=True, what="a positive number of megabytes or None")),
)

#: What the schemes over torch.distributed (its process groups, its RPC) take alike.
NETWORK = (MASTER_ADDR, MASTER_PORT, LATEST_WINS, KEEP_STORAGE)

#: Each transport's own settings (its scheme takes them too, as keyword arguments).
LOCAL_SETTINGS = (MAX_SLOTS,)
DISTRIBUTED_SETTINGS = (BACKEND, WIRE_DTYPE, BUCKET_MB, MAX_BUFFERS)
RPC_SETTINGS = (WIRE_DTYPE, MAX_BUFFERS)
RAY_SETTINGS = (WIRE_DTYPE,)


class Configurable:
    """A class whose constructor takes its declared options (``OPTIONS``), checked, as attributes.

    The constructor's signature is derived from the options: the first ``POSITIONAL`` may be given by
    position, the others by keyword, and ``EXTRA`` parameters (not options: live objects such as a
    transport) follow. A value outside an option's type or range raises
    :class:`~weightsync.errors.ConfigurationError` naming the option.
    """

    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    POSITIONAL: ClassVar[int] = 4
    EXTRA: ClassVar[tuple[inspect.Parameter, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        for i, option in enumerate(cls.OPTIONS):
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i < cls.POSITIONAL else inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(option.name, kind, default=option.default, annotation=option.annotation))
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in cls.EXTRA]
        cls.__signature__ = inspect.Signature(params[1:])  # type: ignore[attr-defined]

    @classmethod
    def option(cls, name: str) -> Option:
        return next(o for o in cls.OPTIONS if o.name == name)

    @classmethod
    def option_names(cls) -> list[str]:
        return [o.name for o in cls.OPTIONS]

    def _bind_options(self, args: tuple, kwargs: dict[str, Any]) -> tuple[set[str], dict[str, Any]]:
        """Check and set every option from a constructor call; return the options given, and the extras.

        Raises:
            TypeError: arguments the signature does not take (as any Python call would).
            ConfigurationError: a value an option refuses, named.
        """
        bound = type(self).__signature__.bind(*args, **kwargs)  # type: ignore[attr-defined]
        given = {name for name in bound.arguments if name in self.option_names()}
        for option in self.OPTIONS:
            value = bound.arguments.get(option.name, option.default)
            setattr(self, _attr(option), option.check(value, option.name))
        extras = {p.name: bound.arguments.get(p.name, p.default) for p in self.EXTRA}
        return given, extras

    def option_values(self) -> dict[str, Any]:
        """Every option's value, as plain data (what a config or a receiver config holds)."""
        return {o.name: o.to_plain(getattr(self, _attr(o))) for o in self.OPTIONS}


def _attr(option: Option) -> str:
    # The strategy is held as a WeightStrategy, behind the read-only `strategy` property.
    return "_strategy" if option is STRATEGY else option.name
