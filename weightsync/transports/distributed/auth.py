"""The run key of a ``distributed`` scheme: what a worker proves it holds, and where the run's keys live.

The sender draws a random key per run. Workers get it out of band, as the key file a receiver config names (or
inside a pickled scheme), never inside the config itself. From it come:

- the run's prefix in the TCP store, which nothing else names: a process that reaches the store but holds no
  key does not know where the run's keys are;
- each worker's proof, sent with its hello: an HMAC of what it says, its index and its generation. The sender
  admits no worker, at the rendez-vous or later, without a proof it checks.

The store itself stays unauthenticated (torch's TCP store has no authentication): anyone who reaches its port
can write keys of their own, or fill its memory. See docs/multinode.md, "What is exposed".
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

__all__ = ["proof", "proven", "run_prefix"]

_PREFIX_TAG = b"weightsync distributed store prefix\0"
_HELLO_TAG = b"weightsync distributed hello\0"


def run_prefix(model_id: str, key: bytes) -> str:
    """The run's prefix in the store for ``model_id``: ``weightsync/<model_id>/<16 hex digits>``."""
    digest = hmac.new(key, _PREFIX_TAG + model_id.encode(), hashlib.sha256).hexdigest()
    return f"weightsync/{model_id}/{digest[:16]}"


def proof(key: bytes, worker: int, gen: int, hello: dict[str, Any]) -> str:
    """The proof worker ``worker`` (its ``gen``-th process) sends with ``hello`` (everything but the proof)."""
    said = json.dumps({k: v for k, v in hello.items() if k != "proof"}, sort_keys=True).encode()
    return hmac.new(key, _HELLO_TAG + f"{worker}/{gen}\0".encode() + said, hashlib.sha256).hexdigest()


def proven(key: bytes, worker: int, gen: int, hello: dict[str, Any]) -> bool:
    """Whether ``hello`` carries the proof that its sender holds ``key`` (compared in constant time)."""
    given = hello.get("proof")
    return isinstance(given, str) and hmac.compare_digest(given, proof(key, worker, gen, hello))
