"""Imported by the tests' fork server (``tests/conftest.py``): the deltas' loops, compiled (or loaded from numba's
cache) once there, so that a worker forked from it applies its first changes without paying numba's import and
the loading (about 0.6 s a process, some hundred processes a run). A worker spawned, or started any other way,
still pays it, as a user's does."""

from __future__ import annotations

from weightsync.tensors.delta import _NP_WORDS
from weightsync.tensors.kernels import prepare, prepare_writes

WORDS = list(_NP_WORDS.values())
prepare_writes(WORDS)
prepare(WORDS)
