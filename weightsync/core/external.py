"""A model another program owns and loads itself: what a receiver applies updates to when the worker is an engine.

An inference engine (vLLM) owns its model: its own layout of the weights, its own loading path (which packs,
fuses or quantizes them), its own processes. weightsync cannot write into such a model tensor by tensor; it
hands the engine each update as the sender's tensors, by the sender's names, and the engine loads them the
way it loads a checkpoint. The receiver checks every update against the names, shapes and dtypes the engine
says it loads, before anything is handed over, and acks only once the engine's load returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["ExternalModel"]


@dataclass(frozen=True)
class ExternalModel:
    """A worker's model that a program loads itself (give it as ``init_on_receiver(model=...)``).

    Attributes:
        spec: ``{name: (shape, dtype)}`` of every tensor the program loads, by the sender's names. An update
            (and, at connect, the sender's layout) that differs in a name, a shape or a dtype is refused before
            ``load`` is called.
        load: called with ``{name: tensor}`` for each update, under the scheme's ``weights_lock``; it must copy
            what it keeps before it returns (the tensors are views of the transport's memory, which the next
            update reuses). What it raises refuses the update (the sender is told, with the cause); the
            program then says what its model holds.
        device: where ``load`` wants the tensors (engines that can deliver into GPU memory put them there).
        prepare: optional, for a program that takes each version ahead (``scheme.take``) and pauses to load it
            (``pending.apply()``). Called in the thread that takes it (within ``receive()`` too, which applies at
            once), while the program goes on, with the checked ``{name: tensor}`` ``load`` would get. It does
            the part of the load that does not change what the model computes yet (an engine's processing of
            the weights, into memory of its own) and returns the call that makes the version current, which the
            apply makes in place of ``load`` (under ``weights_lock``; what it raises refuses the update as
            ``load``'s would). Returning ``None``, or raising (logged), leaves the version to ``load``. A version
            discarded (``pending.discard()``) drops its call uncalled: what the preparation holds is the
            program's to free, or to reuse at its next ``prepare``.
        ignored: names of :attr:`spec` the program does not load (buffers its model computes itself): an update may
            carry them in any shape and dtype, or not at all, and ``load`` gets them as they came.
    """

    spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    load: Callable[[dict[str, torch.Tensor]], None]
    device: torch.device = torch.device("cpu")
    prepare: Callable[[dict[str, torch.Tensor]], Callable[[], None] | None] | None = None
    ignored: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # torch.Size and lists compare unequal to the tuples a layout holds: one form, so checks compare in C.
        object.__setattr__(self, "spec", {str(k): (tuple(int(d) for d in s), t) for k, (s, t) in self.spec.items()})
        object.__setattr__(self, "ignored", frozenset(str(k) for k in self.ignored))

    def spec_for(
        self, sent: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """What an update that carries ``sent`` (``{name: (shape, dtype)}``) must match: :attr:`spec`, with each of
        :attr:`ignored` as it was sent, or left out where it was not."""
        if not self.ignored:  # (checked at every update: no copy)
            return self.spec
        spec = {k: v for k, v in self.spec.items() if k not in self.ignored}
        spec.update({k: v for k, v in sent.items() if k in self.ignored})
        return spec
