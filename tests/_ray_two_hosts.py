"""The trainer side of the Ray two-host test, run on host A: joins the cluster whose head runs there, places two
actors on host B (its custom resource), hands each its receiver config (the actor opts in to pickles), sends
three versions and prints, for each, whether both actors hold the trainer's weights; then where the actors ran.

With ``--faults``, it then waits for a line on its input (the test pulls host B's cable), times one more send
(it fails, naming the actors), waits for another line (the cable is back) and sends again; then waits for a
last line (the test killed the actors' processes on host B), sends (it fails, naming them), starts two new
actors on B and has each rejoin in its place.
"""

from __future__ import annotations

import sys
import time

import ray
import torch

import weightsync as ws
from tests._ray_actors import Collector
from tests._workers import build, checksum


def _bump(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def _hold(actors, scheme, model) -> bool:
    """Whether every actor holds the scheme's version with the trainer's weights."""
    states = ray.get([a.state.remote() for a in actors])
    return all(state == (scheme.version, checksum(model, "tensordict")) for state in states)


def join_cluster(address: str, resource: str, count: float, within: float = 90.0) -> None:
    """``ray.init`` the cluster at ``address`` once its head answers, and wait until it offers ``count`` of the
    custom ``resource`` (the other host's node joined): both start beside this process, so both are waited for,
    within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            ray.init(address=address, namespace="two-hosts", log_to_driver=False)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    while ray.cluster_resources().get(resource, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no node offering {resource} joined within {within:.0f} s: {ray.cluster_resources()}")
        time.sleep(0.5)


def main(address: str, faults: bool = False) -> None:
    join_cluster(address, "hostB", 2)
    actors = [Collector.options(resources={"hostB": 1}).remote("tiny") for _ in range(2)]
    model = build("tiny")
    scheme = ws.RayWeightSyncScheme(allow_pickle=True, timeout=5 if faults else 60)
    scheme.init_on_sender(model_id="policy", model=model, remote_collectors=actors)
    ray.get([a.join.remote(scheme.receiver_config(i), i, allow_pickle=True) for i, a in enumerate(actors)])
    scheme.connect()
    for _ in range(3):
        _bump(model)
        scheme.send()
        print(f"version {scheme.version} held by both: {_hold(actors, scheme, model)}", flush=True)
    print("actors on", sorted(set(ray.get([a.node_ip.remote() for a in actors]))), flush=True)
    if faults:
        for phase in ("cable out", "cable back"):
            print(f"ready for: {phase}", flush=True)
            sys.stdin.readline()
            _bump(model)
            began = time.monotonic()
            try:
                scheme.send()
                print(f"{phase}: sent version {scheme.version} in {time.monotonic() - began:.1f} s", flush=True)
            except ws.WeightSyncError as exc:
                print(f"{phase}: send failed after {time.monotonic() - began:.1f} s: {exc!r}", flush=True)
            try:
                states = ray.get([a.state.remote() for a in actors], timeout=5)
                print(f"{phase}: actors hold {[v for v, _ in states]}, trainer {scheme.version}", flush=True)
            except Exception as exc:  # noqa: BLE001 - what Ray says is the finding
                print(f"{phase}: actors unreachable: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if faults:
        print("ready for: actors killed", flush=True)
        sys.stdin.readline()
        _bump(model)
        try:
            scheme.send()
            print(f"actors killed: sent version {scheme.version}", flush=True)
        except ws.WeightSyncError as exc:
            print(f"actors killed: send failed: {exc!r}", flush=True)
        actors = [Collector.options(resources={"hostB": 1}).remote("tiny") for _ in range(2)]
        ray.get([a.join.remote(scheme.receiver_config(i), i, allow_pickle=True) for i, a in enumerate(actors)])
        held = [scheme.rejoin(i, actor) for i, actor in enumerate(actors)]
        same = _hold(actors, scheme, model)
        print(f"new actors rejoined at versions {held}: hold the trainer's weights: {same}", flush=True)
    scheme.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], "--faults" in sys.argv)
