"""weightsync: move model weights from a trainer to the workers that use them.

Pick a scheme per model (``MultiProcessWeightSyncScheme``,
``SharedMemWeightSyncScheme``, ``RayWeightSyncScheme``,
``DistributedWeightSyncScheme``, ...), call
``init_on_sender`` and ``connect`` in the trainer, ``init_on_receiver`` and
``connect`` in each worker, then ``send()`` and ``receive()``.

``import weightsync`` loads the error tree only: every other name, each
scheme's engine and the Hydra layer load on first use.
"""

from __future__ import annotations

from . import errors
from ._lazy import lazy
from .errors import *  # noqa: F403 - the error tree is public, and costs nothing to load

__version__ = "0.1.0"

# Where each public name of the core lives (a module of this package), imported when the name is first asked
# for; the names engines define (schemes, transports, their settings) come from the registry.
_HOME = {
    name: module
    for module, names in {
        "core.scheme": ("WeightSyncScheme",),
        "core.external": ("ExternalModel",),
        "core.facade": ("WeightReceiver", "WeightSender"),
        "core.settings": ("TransportSettings",),
        "registry": ("available_backends", "get_backend", "register_backend"),
        "transports.base": ("TransportBackend",),
        "tensors.strategy": ("WeightStrategy",),
        "tensors.layout": ("FlatLayout",),
        "metrics": ("SendRecord",),
        "model_path": ("resolve_model",),
        "config": ("from_config",),
    }.items()
    for name in names
}

__getattr__, __dir__ = lazy(__name__, _HOME, under="", extra=tuple(errors.__all__))
