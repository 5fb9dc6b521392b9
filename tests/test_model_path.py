"""Model paths inside a context: ``"policy"``, ``"env.value_net"``, ``"env.transform[0].module"``."""

from __future__ import annotations

import pytest
from torch import nn

import weightsync as ws
from tests._workers import Holder


def test_paths_through_attributes_indexes_and_mappings():
    module = nn.Linear(2, 2)
    holder = Holder(module)
    assert ws.resolve_model(holder, "env.transform[0].module") is module
    seq = nn.Sequential(nn.ReLU(), nn.ModuleDict({"head": module}))
    assert ws.resolve_model(seq, "[1].head") is module
    assert ws.resolve_model({"nets": {"value": module}}, "nets.value") is module
    assert ws.resolve_model({"nets": [module]}, "nets[-1]") is module
    assert ws.resolve_model({"a b": module}, '["a b"]') is module


def test_context_get_model_wins():
    module = nn.Linear(2, 2)

    class Collector:
        def get_model(self, model_id):
            return {"policy": module}.get(model_id)

    assert ws.resolve_model(Collector(), "policy") is module
    with pytest.raises(ws.ConfigurationError, match="returned None"):
        ws.resolve_model(Collector(), "value")


def test_a_path_its_contexts_get_model_cannot_find_is_walked_and_a_missing_one_named_with_what_it_said():
    """TorchRL's ``get_model`` raises what its own walk met (``AttributeError: Attribute env from ['env'] not found
    in MultiSyncCollector()``, ``TypeError: 'ModuleTransform' object is not subscriptable``), which reached the
    user as it was, from deep in a collector's start."""
    module = nn.Linear(2, 2)

    class Collector(Holder):
        def get_model(self, model_id):
            raise AttributeError(f"Attribute {model_id.split('.')[0]} not found")

    assert ws.resolve_model(Collector(module), "env.transform[0].module") is module
    with pytest.raises(ws.ConfigurationError, match=r"at '<context>' has no 'nets' \(Collector.get_model said "):
        ws.resolve_model(Collector(module), "nets.value")


def test_missing_segment_is_named():
    with pytest.raises(ws.ConfigurationError, match="'env.transform\\[0\\]' has no 'policy'"):
        ws.resolve_model(Holder(nn.Linear(1, 1)), "env.transform[0].policy")
    with pytest.raises(ws.ConfigurationError, match="has no '\\[3\\]'"):
        ws.resolve_model(Holder(nn.Linear(1, 1)), "env.transform[3].module")
    with pytest.raises(ws.ConfigurationError, match="cannot parse"):
        ws.resolve_model(Holder(nn.Linear(1, 1)), "env..transform")


def test_a_dataset_without_the_key_or_a_path_to_none_is_named():
    """TorchRL's collectors are torch ``IterableDataset``s, whose ``__getitem__`` raises ``NotImplementedError``:
    a path the collector did not hold reached the user as "Subclasses of Dataset should implement __getitem__";
    and a collector given a ``policy_factory`` and no ``policy`` holds ``None`` there, which was taken for its
    model (every weightsync scheme then failed that collector's start)."""
    from torch.utils.data import IterableDataset

    class Collector(IterableDataset):
        policy = None

        def __iter__(self):
            return iter(())

    with pytest.raises(ws.ConfigurationError, match="Collector at '<context>' has no 'value_net'"):
        ws.resolve_model(Collector(), "value_net")
    with pytest.raises(ws.ConfigurationError, match="model path 'policy' names None in Collector"):
        ws.resolve_model(Collector(), "policy")
