"""What every scheme that moves the weights' bytes takes: :class:`PayloadScheme`."""

from __future__ import annotations

from .. import options
from ..core.scheme import WeightSyncScheme
from ..options import option

__all__ = ["PayloadScheme"]


class PayloadScheme(WeightSyncScheme):
    """Base of the schemes that move the weights' bytes to their workers (all but ``no_sync``)."""

    checksum: bool = option(options.CHECKSUM)
    flatten_sender: bool = option(options.FLATTEN_SENDER)
