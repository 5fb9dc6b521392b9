"""Options, each declared once (name, default, type, check and meaning), and the classes that take them.

The options several classes take are declared here; an engine's own beside it (its settings module). A class
says which it takes in its body, one typed line each::

    class MyScheme(WeightSyncScheme, name="mine"):
        colour: str = option(COLOUR)

:class:`Declared` reads those lines when the class is made: its ``OPTIONS`` (a base class's first), its
constructor and the constructor's signature, its argument checks. From ``OPTIONS`` come the Hydra dataclass
configs and their YAML copies (:mod:`weightsync.config.configs`), what a pickled scheme carries, what
``receiver_config()`` emits and what a receiver config may hold (:mod:`weightsync.config.receiver`), and the
options tables of the docs. Type checkers and IDEs see the constructor through ``dataclass_transform``
(PEP 681), ``inspect.signature`` at run time; ``tests/test_signatures.py`` keeps the typed lines and the
declarations in step.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from typing_extensions import dataclass_transform

from . import checks
from .errors import ConfigurationError

log = logging.getLogger("weightsync.options")

__all__ = ["Declared", "Option", "option", "positive"]


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
        needs: the option that gives this one its meaning: given while that one is off, it is warned about
            (not refused: a sweep that turns the other off keeps its runs).
    """

    name: str
    default: Any
    annotation: Any
    doc: str
    check: checks.Check
    plain: Callable[[Any], Any] | None = None
    needs: str | None = None

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


def _flag(name: str, default: bool, doc: str, needs: str | None = None) -> Option:
    return Option(name, default, bool, doc, checks.boolean, needs=needs)


def positive(name: str, default: int | None, doc: str) -> Option:
    """An option holding a positive int (or ``None``, where that is its default)."""
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
    "a warning, stops sending to that worker and goes on (a restarted worker may rejoin; one more warning says "
    "when every worker is dropped). A worker that refuses an update raises in both modes.",
    checks.one_of("raise", "drop"),
)
MAX_STALENESS = Option(
    "max_staleness",
    None,
    Optional[int],  # noqa: UP045
    "In asynchronous sends, how many versions a worker may lag behind the one being published; "
    "``send_async`` first waits (at most ``timeout``) for the acks on their way from workers further behind "
    "(a worker that refused its last version, or that sends skipped, has none coming). ``None``: no bound.",
    # (0 would wait for an ack of the version not yet published: the version before is the least lag a send has)
    checks.optional(checks.integer(1, 2**31 - 1, what="a positive int or None")),
)
CHECK_FINITE = _flag(
    "check_finite", False, "Refuse, in the caller and before any byte moves, weights holding NaN or Inf."
)

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
    "Ray cluster to join when Ray is not initialized yet (``None``: ``RAY_ADDRESS``, else a new local cluster; "
    '``"auto"``: the one this user started with ``ray start``).',
    checks.optional(checks.text()),
)
NAMESPACE = Option("namespace", None, Optional[str], "Ray namespace.", checks.optional(checks.text()))  # noqa: UP045

# ------------------------------------------------------ transports' settings
MAX_BUFFERS = positive(
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


DELTA = Option(
    "delta",
    False,
    Any,
    "Send each worker only the values that changed since the version it acked (lossless: the same bits as a "
    'whole send): ``false``, every version whole; ``true``, always the changes; ``"auto"``, per chunk of about '
    "4 MB whichever is smaller on the wire, and the whole version where the changes are most of it. The trainer "
    "keeps one copy of the newest version's bytes to compare the next with (docs/delta.md).",
    checks.one_of(False, True, "auto"),
)
TRACK_WRITES = _flag(
    "track_writes",
    False,
    "Under ``delta``: the trainer and each worker ask Linux (6.7 and later) which pages of the model were written "
    "since the last version, and compare or write only those (a model mostly frozen, or not stepped between two "
    "sends, then costs a small message); the first write to each 4 KB page after a send costs a page fault (about "
    "0.5 us). Where the kernel keeps no such record, every byte is read, as without it (docs/delta.md).",
    needs="delta",
)


class _Declaration:
    """What :func:`option` leaves in a class body, until the class is made and reads it."""

    def __init__(self, spec: Option) -> None:
        self.spec = spec


def option(spec: Option) -> Any:
    """Declare, in a class body, that the class takes the option ``spec``: ``timeout: float = option(TIMEOUT)``.

    The attribute's name must be the option's; its annotation is the type tools see.
    """
    return _Declaration(spec)


@dataclass_transform(kw_only_default=True)
class Declared:
    """A class whose constructor takes the options its body declares (:func:`option`), checked.

    ``OPTIONS`` lists them, a base class's first. The constructor takes each by keyword (in a class defined with
    ``kw_only=False``, those before a ``_: KW_ONLY`` line also by position), with its default, and its signature
    says so: ``inspect.signature`` at run time, type checkers and IDEs through ``dataclass_transform``. A value an
    option refuses raises :class:`~weightsync.errors.ConfigurationError` naming it; an argument the signature
    does not take raises ``TypeError``, as any call would.
    """

    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    #: How many options, from the first, may be given by position.
    POSITIONAL: ClassVar[int] = 0
    #: Arguments that are not options (live objects, such as a transport), keyword-only, after the options.
    EXTRA: ClassVar[tuple[inspect.Parameter, ...]] = ()
    #: Former option names, each with the error that names what replaced it.
    RENAMED: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, *, kw_only: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {}
        for name, value in list(vars(cls).items()):
            if isinstance(value, _Declaration):
                if value.spec.name != name:
                    raise TypeError(f"{cls.__qualname__}.{name} declares the option {value.spec.name!r}")
                own[name] = value.spec
                delattr(cls, name)  # the instance holds the value; a property of a base stays visible
        if own:
            kept = [own.pop(o.name, o) for o in cls.OPTIONS]  # a redeclared option keeps its place
            cls.OPTIONS = (*kept, *own.values())
            if not kw_only:  # those declared before the `_: KW_ONLY` line
                declared = list(inspect.get_annotations(cls))
                before = declared[: declared.index("_")] if "_" in declared else declared
                cls.POSITIONAL = len(kept) + sum(1 for name in own if name in before)
        if "__init__" not in vars(cls):  # a constructor written in the class body is the class's own to keep
            cls.__init__ = _constructor(cls)  # type: ignore[method-assign]

    @classmethod
    def option(cls, name: str) -> Option:
        """The option ``name`` this class takes.

        Raises:
            KeyError: it takes no such option.
        """
        for o in cls.OPTIONS:
            if o.name == name:
                return o
        raise KeyError(name)

    @classmethod
    def option_names(cls) -> list[str]:
        return [o.name for o in cls.OPTIONS]

    def _configure(self, given: dict[str, Any], extras: dict[str, Any]) -> None:
        """Take the options ``given`` (by name, as the caller gave them) and the ``extras``; a subclass that takes
        extras overrides this."""
        self._take(given)

    def _take(self, given: dict[str, Any], exclude: tuple[str, ...] = ()) -> None:
        """Check and hold each option but those in ``exclude``: its value in ``given``, else its default."""
        for o in self.OPTIONS:
            if o.name not in exclude:
                object.__setattr__(self, _attr(o), o.check(given.get(o.name, o.default), o.name))
        for o in self.OPTIONS:
            value = getattr(self, _attr(o), o.default)
            if o.needs is not None and value != o.default and not getattr(self, o.needs, None):
                log.warning("%s: %s=%r does nothing while %s is off", type(self).__name__, o.name, value, o.needs)

    def option_values(self) -> dict[str, Any]:
        """Every option's value, as plain data (what a config or a receiver config holds)."""
        return {o.name: o.to_plain(getattr(self, _attr(o))) for o in self.OPTIONS}


def _constructor(cls: type[Declared]) -> Any:
    """``cls.__init__``: binds the call to the options' signature, then :meth:`Declared._configure`."""
    positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", positional)]
    for i, o in enumerate(cls.OPTIONS):
        params.append(
            inspect.Parameter(
                o.name, positional if i < cls.POSITIONAL else keyword, default=o.default, annotation=o.annotation
            )
        )
    params += [p.replace(kind=keyword) for p in cls.EXTRA]
    signature = inspect.Signature(params, return_annotation=None)
    names = {o.name for o in cls.OPTIONS}

    def __init__(self: Declared, *args: Any, **kwargs: Any) -> None:
        for name in kwargs.keys() & cls.RENAMED.keys():
            raise ConfigurationError(cls.RENAMED[name])
        try:
            bound = signature.bind(self, *args, **kwargs).arguments
        except TypeError as exc:  # (Python's says neither the class nor what it takes)
            taken = ", ".join(p.name for p in params[1:])
            raise TypeError(f"{cls.__name__}: {exc}; it takes {taken}") from None
        self._configure(
            {k: v for k, v in bound.items() if k in names},
            {p.name: bound.get(p.name, p.default) for p in cls.EXTRA},
        )

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    return __init__


def _attr(option: Option) -> str:
    # The strategy is held as a WeightStrategy, behind the read-only `strategy` property.
    return "_strategy" if option is STRATEGY else option.name
