"""Property-based tests (hypothesis) over random model structures: the strategy's extract/apply round trip,
the flat layout, and the refusal of any mismatching update without a partial write."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import weightsync as ws
from weightsync.tensors.copies import write_into
from weightsync.tensors.layout import FlatLayout, wire_dtype_from_name
from weightsync.tensors.strategy import flatten_weights

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def structures(draw, depth: int = 0):
    """A plain description of a module tree: leaves are (kind, shape, dtype, persistent) tuples."""
    children = {}
    for i in range(draw(st.integers(1, 3))):
        if depth < 2 and draw(st.booleans()):
            children[f"m{i}"] = draw(structures(depth + 1))
        else:
            kind = draw(st.sampled_from(["param", "buffer"]))
            dtype = torch.float32 if kind == "param" else draw(st.sampled_from(DTYPES))
            shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
            children[f"t{i}"] = (kind, shape, dtype, draw(st.booleans()))
    return children


def build(structure: dict, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    module = nn.Module()
    for name, spec in structure.items():
        if isinstance(spec, dict):
            module.add_module(name, build(spec, seed + 1))
            continue
        kind, shape, dtype, persistent = spec
        values = torch.randn(shape, generator=gen) * 100
        tensor = values.to(dtype) if dtype.is_floating_point else values.abs().to(dtype)
        if kind == "param":
            module.register_parameter(name, nn.Parameter(tensor))
        else:
            module.register_buffer(name, tensor, persistent=persistent)
    return module


def ws_wire(name: str | None) -> torch.dtype | None:
    return wire_dtype_from_name(name)


def values(model: nn.Module, extract_as: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ws.WeightStrategy(extract_as).flat(model).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@SETTINGS
@given(structure=structures(), extract_as=st.sampled_from(["tensordict", "state_dict"]))
def test_extract_then_apply_reproduces_every_tensor(structure, extract_as):
    src, dst = build(structure, 1), build(structure, 2)
    strategy = ws.WeightStrategy(extract_as)
    assume(strategy.flat(src))  # a structure of empty persistent-less leaves has nothing to synchronize
    strategy.apply_weights(dst, strategy.extract_weights(src))
    assert same(values(dst, extract_as), values(src, extract_as))


@SETTINGS
@given(
    structure=structures(),
    wire=st.sampled_from([None, "bfloat16", "float16"]),
    direct_min=st.sampled_from([None, 1, 16, 1 << 30]),
)
def test_layout_round_trip_through_one_flat_buffer(structure, wire, direct_min):
    """Through one buffer, or (``direct_min``) through :meth:`FlatLayout.pieces` and ``unpack``, as Ray does."""
    src, dst = build(structure, 3), build(structure, 4)
    flat = flatten_weights(src)
    assume(flat)
    layout = FlatLayout.from_weights(flat, ws_wire(wire))
    assert FlatLayout.from_plain(layout.to_plain()) == layout
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    if direct_min is None:
        write_into(layout.views(buffer), flat)
        received = layout.views(buffer)
    else:
        pieces, ranges = layout.pieces(flat, buffer, direct_min)
        received = layout.unpack([piece.clone() for piece in pieces], ranges)
    write_into(flatten_weights(dst), received)
    got = flatten_weights(dst)
    for key, tensor in flat.items():
        expected = tensor
        if wire is not None and tensor.is_floating_point():
            expected = tensor.to(ws_wire(wire)).to(tensor.dtype)
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], expected), key


@SETTINGS
@given(
    structure=structures(),
    change=st.sampled_from(["drop", "rename", "extra", "shape", "dtype", "non_tensor"]),
    pick=st.integers(0, 1000),
)
def test_any_mismatch_is_refused_by_name_and_nothing_is_written(structure, change, pick):
    dst = build(structure, 5)
    flat = dict(flatten_weights(build(structure, 6)))
    assume(flat)
    key = sorted(flat)[pick % len(flat)]
    if change == "drop":
        del flat[key]
    elif change == "rename":
        flat[key + "_renamed"] = flat.pop(key)
    elif change == "extra":
        flat["extra.tensor"] = torch.zeros(1)
    elif change == "shape":
        flat[key] = torch.zeros(*flat[key].shape, 2, dtype=flat[key].dtype)
    elif change == "dtype":
        flat[key] = flat[key].to(torch.float64 if flat[key].dtype != torch.float64 else torch.float32)
    else:
        flat[key] = [1.0, 2.0]
    before = values(dst, "tensordict")
    with pytest.raises(ws.InvalidWeightsError) as info:
        ws.WeightStrategy().apply_weights(dst, flat)
    named = "extra.tensor" if change == "extra" else key
    assert named in str(info.value)
    assert same(values(dst, "tensordict"), before)


@SETTINGS
@given(structure=structures(), tie=st.booleans())
def test_the_model_walk_matches_torchs_named_parameters_and_buffers(structure, tie):
    from weightsync.tensors.strategy import _module_tensors

    model = build(structure, 7)
    if tie:  # one parameter under two names, and a module reached twice: each is listed once, first name
        shared = nn.Parameter(torch.ones(3))
        model.register_parameter("tied_a", shared)
        holder = nn.Module()
        holder.register_parameter("tied_b", shared)
        model.add_module("holder", holder)
        model.add_module("again", holder)
    expected = dict(model.named_parameters())
    expected.update(model.named_buffers())
    got = _module_tensors(model, "tensordict")
    assert list(got) == list(expected)
    assert all(got[k] is expected[k] for k in expected)
