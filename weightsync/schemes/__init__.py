"""Schemes: the lifecycle of one model across workers, one backend a module (loaded on first use).

Every scheme registered (:mod:`weightsync.registry`) defined in this package is a name of it.
"""

from __future__ import annotations

from .._lazy import lazy

__getattr__, __dir__ = lazy(__name__, {}, under="weightsync.schemes.")
