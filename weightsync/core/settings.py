"""What every transport's settings are: :class:`TransportSettings`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from .. import registry
from ..errors import LifecycleError
from ..options import Declared

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["TransportSettings"]


class TransportSettings(Declared):
    """A transport's own settings, one immutable object: what its Hydra config holds (the config's
    ``_target_``) and what its engine takes whole.

    A subclass declares its fields with :func:`~weightsync.options.option` and registers as it is defined::

        class MySettings(TransportSettings, name="mine", transport="mypkg.transport:MyTransport"):
            chunk_mb: float = option(CHUNK_MB)

    ``name`` is the transport's name (its config's name in the ``transport`` groups, and what a scheme's
    ``transport=`` may say); ``transport`` the class of the older API's transport to one worker.
    """

    #: The transport's registered name.
    name: ClassVar[str] = ""
    #: ``"module:Class"`` of its transport to one worker (:class:`PeerTransport`), if it has one.
    transport: ClassVar[str | None] = None

    def __init_subclass__(cls, *, name: str = "", transport: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            cls.name, cls.transport = name, transport
            registry.add_transport(cls, name, transport)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: make another with .replace({name}=...)")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TransportSettings)
            and type(other) is type(self)
            and (other.option_values() == self.option_values())
        )

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.option_values().items())))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.option_values().items())
        return f"{type(self).__name__}({fields})"

    def replace(self, **changes: Any) -> Self:
        """These settings with ``changes`` (checked as the constructor checks them)."""
        return type(self)(**{**self.option_values(), **changes})

    @classmethod
    def transport_class(cls) -> Any:
        """The class of the transport to one worker (imported on first use).

        Raises:
            LifecycleError: this transport has none.
        """
        if cls.transport is None:
            raise LifecycleError(f"transport {cls.name!r} has no transport class to one worker")
        return registry.resolve(cls.transport)
