"""The main job's workers for Ray schemes: one Ray actor per worker, holding that worker's models.

The job starts them on the cluster the scheme names (``address``, ``RAY_ADDRESS``,
or a new local one it also shuts down), hands each its receiver configs, and
asks for a ``(model, version, checksum)`` report after every send: an update is
a call that runs inside the actor, so when a synchronous send returns (or
``wait_async()`` does) the report already shows the new version.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..config import from_config
from ..core.scheme import WeightSyncScheme
from ..core.timing import shown_seconds
from ..errors import WeightSyncError
from ..schemes.ray import RayModuleTransformScheme
from ..transports.ray import apply_in_actor
from ..transports.ray.sender import ray as ray_module
from .models import build_model, checksum

__all__ = ["RayWorkers"]


class JobActor:
    """One worker of the main job, as a Ray actor: builds its models, joins their schemes, reports."""

    def __init__(self, idx: int, specs: dict[str, dict]) -> None:
        torch.set_num_threads(1)
        self.idx = idx
        self.models = {m: build_model(spec) for m, spec in specs.items()}
        self.schemes: dict[str, WeightSyncScheme] = {}

    def join(self, configs: dict[str, dict]) -> None:
        for model_id, cfg in configs.items():
            scheme = from_config(cfg)
            scheme.init_on_receiver(model=self.models[model_id])
            scheme.connect()
            self.schemes[model_id] = scheme

    def report(self, model_id: str | None = None) -> list[tuple[str, int | None, str]]:
        return [(m, s.version, checksum(self.models[m])) for m, s in self.schemes.items() if model_id in (None, m)]

    # What RayModuleTransformScheme calls on the actor hosting its module.
    def update_weights_tensordict(self, model_id: str, version: int, payload: Any, layout: dict | None) -> int:
        return apply_in_actor(self, model_id, version, payload, layout)

    def update_weights_state_dict(self, model_id: str, version: int, payload: Any, layout: dict | None) -> int:
        return apply_in_actor(self, model_id, version, payload, layout)

    def shutdown(self) -> None:
        for scheme in self.schemes.values():
            scheme.shutdown()


class RayWorkers:
    """The job's Ray actors for the models whose schemes are Ray schemes.

    Args:
        schemes: model id -> a Ray scheme, not initialized yet.
        specs: model id -> the model's spec (``build_model``).
        num_workers: how many actors.
        timeout: bound on every call the job makes to an actor.
    """

    def __init__(self, schemes: dict[str, Any], specs: dict[str, dict], num_workers: int, timeout: float) -> None:
        ray = ray_module()  # a one-line error naming the extra where Ray is not installed

        self.ray, self.timeout = ray, timeout
        self.started = next(iter(schemes.values())).join_ray(include_dashboard=False, log_to_driver=False)
        actor_cls = ray.remote(num_cpus=0, max_restarts=0)(JobActor)
        self.actors = [actor_cls.remote(i, {m: specs[m] for m in schemes}) for i in range(num_workers)]

    def sender_kwargs(self, scheme: Any) -> dict[str, Any]:
        """What ``init_on_sender`` needs besides the model: the actors."""
        if isinstance(scheme, RayModuleTransformScheme):
            return {"actor": self.actors[0]}
        return {"remote_collectors": self.actors}

    def join(self, schemes: dict[str, WeightSyncScheme]) -> None:
        """Each actor builds its receivers from the senders' receiver configs (before the senders connect)."""
        configs = [{m: s.receiver_config(i) for m, s in schemes.items()} for i in range(len(self.actors))]
        self._get([a.join.remote(c) for a, c in zip(self.actors, configs)], "join")

    def reports(self, model_id: str | None = None) -> list[tuple]:
        """``("applied", worker, model, version, checksum)`` from every actor for its models (or ``model_id``)."""
        per_actor = self._get([a.report.remote(model_id) for a in self.actors], "report")
        return [("applied", i, *row) for i, rows in enumerate(per_actor) for row in rows]

    def _get(self, refs: list, what: str) -> list:
        """The results of one call per actor, within the timeout; a failure names its worker."""
        deadline = time.monotonic() + self.timeout
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except self.ray.exceptions.GetTimeoutError:
                raise WeightSyncError(
                    f"its Ray actor did not {what} within {shown_seconds(self.timeout)}", worker_idx=i
                ) from None
            except self.ray.exceptions.RayActorError as exc:
                raise WeightSyncError(f"its Ray actor died ({type(exc).__name__})", worker_idx=i) from None
            except self.ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                raise WeightSyncError(f"its Ray actor failed to {what}: {cause}", worker_idx=i) from None
        return results

    def close(self) -> None:
        """Shut the actors' receivers down, end the actors, and the cluster if the job started it."""
        try:
            self.ray.get([a.shutdown.remote() for a in self.actors], timeout=min(self.timeout, 30.0))
        except Exception:  # noqa: BLE001 - best effort: the actors are killed next anyway
            pass
        for actor in self.actors:
            self.ray.kill(actor)
        if self.started:
            self.ray.shutdown()
