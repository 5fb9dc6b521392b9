"""``wsfile``: a weight-sync engine that moves each version through files in a private directory.

A package of its own, outside weightsync, that adds an engine the way any installed package would: its
classes register as they are defined, and its entry point (``[weightsync.backends] wsfile = wsfile``) has
``weightsync.registry.load()`` import this module. tests/test_adding_an_engine.py installs it only on a
subprocess's path and checks what weightsync then offers for it, with no edit to weightsync.
"""

from .scheme import WsFileWeightSyncScheme
from .settings import WsFileSettings

__all__ = ["WsFileSettings", "WsFileWeightSyncScheme"]
