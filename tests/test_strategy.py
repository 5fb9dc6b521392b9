"""WeightStrategy: extraction formats, in-place apply, and refusal of mismatched updates."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import weightsync as ws
from tests._workers import TinyNet
from weightsync.tensors import copies


def _values(model):
    return {k: v.clone() for k, v in ws.WeightStrategy().flat(model).items()}


def test_extract_formats_and_non_persistent_buffers():
    model = TinyNet()
    td = ws.WeightStrategy("tensordict").extract_weights(model)
    sd = ws.WeightStrategy("state_dict").extract_weights(model)
    assert isinstance(td, TensorDict) and isinstance(sd, dict)
    assert "scale" in td.keys() and "scale" not in sd  # non-persistent buffers only in the tensordict format
    assert td["body", "0", "weight"].data_ptr() == model.body[0].weight.data_ptr()  # no copy
    assert not td["body", "0", "weight"].requires_grad


def test_apply_keeps_parameters_buffers_and_requires_grad():
    src, dst = TinyNet(), TinyNet()
    dst.body[0].bias.requires_grad_(False)
    params = {n: p for n, p in dst.named_parameters()}
    for extract_as in ("tensordict", "state_dict"):
        ws.WeightStrategy(extract_as).apply_weights(dst, src)
        assert all(p is params[n] for n, p in dst.named_parameters())
        assert all(isinstance(p, nn.Parameter) for p in dst.parameters())
        assert dst.body[0].weight.requires_grad and not dst.body[0].bias.requires_grad
        assert "running_mean" in dict(dst.body[1].named_buffers())
        assert torch.equal(dst.body[0].weight, src.body[0].weight)


@pytest.mark.parametrize("form", ["module", "tensordict", "flat", "nested", "state_dict"])
def test_every_input_form_is_accepted(form):
    src, dst = TinyNet(), TinyNet()
    with torch.no_grad():
        src.scale.fill_(3.0)
    weights = {
        "module": src,
        "tensordict": TensorDict.from_module(src),
        "flat": dict(ws.WeightStrategy().flat(src)),
        "nested": ws.WeightStrategy().extract_weights(src).to_dict(),
        "state_dict": src.state_dict(),
    }[form]
    strategy = ws.WeightStrategy("state_dict" if form == "state_dict" else "tensordict")
    strategy.apply_weights(dst, weights)
    assert all(torch.equal(a, b) for a, b in zip(strategy.flat(dst).values(), strategy.flat(src).values()))


def test_mismatch_lists_every_key_and_leaves_the_target_untouched():
    dst = TinyNet()
    before = _values(dst)
    update = dict(ws.WeightStrategy().flat(TinyNet()))
    del update["body.0.bias"]
    update["extra.weight"] = torch.zeros(2)
    update["body.3.weight"] = torch.zeros(3, 8)
    update["body.1.running_mean"] = update["body.1.running_mean"].double()
    with pytest.raises(ws.WeightMismatchError) as info:
        ws.WeightStrategy().apply_weights(dst, update)
    err = info.value
    assert err.missing == ["body.0.bias"] and err.extra == ["extra.weight"]
    assert set(err.mismatched) == {"body.3.weight", "body.1.running_mean"}
    assert "[3, 8] float32" in str(err) and "float64" in str(err)
    after = _values(dst)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_leaf_tensors_are_detached_and_non_tensors_refused():
    model = nn.Linear(2, 2)
    w = torch.ones(2, 2, requires_grad=True) * 2  # non-leaf, requires grad
    flat = ws.WeightStrategy().flat({"weight": w, "bias": torch.zeros(2)})
    assert not flat["weight"].requires_grad and flat["weight"].grad_fn is None
    ws.WeightStrategy().apply_weights(model, {"weight": w, "bias": torch.zeros(2)})
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 2.0)) and model.weight.is_leaf
    with pytest.raises(ws.InvalidWeightsError, match="'bias': 'str'"):
        ws.WeightStrategy().flat({"weight": w, "bias": "zeros"})
    with pytest.raises(ws.InvalidWeightsError, match="got int"):
        ws.WeightStrategy().flat(3)


def test_tensordict_and_dict_destinations_and_share_mode():
    src = {"a": {"b": torch.arange(4.0)}, "c": torch.ones(2)}
    td = TensorDict({"a": {"b": torch.zeros(4)}, "c": torch.zeros(2)}, batch_size=[])
    ws.WeightStrategy().apply_weights(td, src)
    assert torch.equal(td["a", "b"], torch.arange(4.0))
    plain = {"a.b": torch.zeros(4), "c": torch.zeros(2)}
    ws.WeightStrategy().apply_weights(plain, src)
    assert torch.equal(plain["a.b"], torch.arange(4.0))
    model = nn.Linear(2, 2)
    weight_obj = model.weight
    shared = {"weight": torch.full((2, 2), 5.0), "bias": torch.zeros(2)}
    ws.WeightStrategy().apply_weights(model, shared, share=True)
    assert model.weight is weight_obj and model.weight.data_ptr() == shared["weight"].data_ptr()


def test_bad_extract_format():
    with pytest.raises(ws.ConfigurationError, match="extract_as"):
        ws.WeightStrategy("pickle")


def test_layout_roundtrip_and_alignment():
    flat = ws.WeightStrategy().flat(TinyNet())
    layout = ws.FlatLayout.from_weights(flat)
    assert ws.FlatLayout.from_plain(layout.to_plain()) == layout
    assert all(s.offset % 64 == 0 for s in layout.slots)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buf)
    for key, tensor in flat.items():
        views[key].copy_(tensor)
    assert all(torch.equal(layout.views(buf)[k], flat[k]) for k in flat)


def test_layout_pieces_send_large_tensors_as_they_are_and_pack_the_rest():
    flat = {
        "a": torch.randn(3),  # small: packed
        "b": torch.randn(1000),  # large: its own memory
        "c": torch.randn(2, 2).t(),  # large enough but not contiguous: packed
        "d": torch.arange(5, dtype=torch.int64),  # small: packed, another dtype group
        "e": torch.randn(7).to(torch.bfloat16),
    }
    layout = ws.FlatLayout.from_weights(flat)
    staging = torch.zeros(layout.nbytes, dtype=torch.uint8)
    buffers, ranges = layout.pieces(flat, staging, direct_min=16)
    b_slot = next(i for i, s in enumerate(layout.slots) if s.key == "b")
    direct = buffers[ranges.index((b_slot, b_slot + 1))]
    assert direct.data_ptr() == flat["b"].data_ptr()  # no copy
    assert all(b.data_ptr() != flat["b"].data_ptr() for b in buffers if b is not direct)
    assert sorted(i for first, last in ranges for i in range(first, last)) == list(range(len(flat)))
    received = layout.unpack([b.clone() for b in buffers], ranges)
    assert all(torch.equal(received[k], flat[k]) and received[k].dtype == flat[k].dtype for k in flat)


def test_layout_unpack_refuses_a_payload_that_does_not_fit():
    flat = {"a": torch.randn(10), "b": torch.randn(4)}
    layout = ws.FlatLayout.from_weights(flat)
    buffers, ranges = layout.pieces(flat, torch.empty(layout.nbytes, dtype=torch.uint8), direct_min=1)
    with pytest.raises(ws.ConfigurationError, match="holds 39 bytes"):
        layout.unpack([buffers[0][:-1], buffers[1]], ranges)
    with pytest.raises(ws.ConfigurationError, match="does not cover"):
        layout.unpack(buffers[:1], ranges[:1])


def test_layout_wire_dtype_casts_floating_tensors_only_and_travels_in_the_plain_form():
    flat = {"w": torch.randn(100), "step": torch.arange(3, dtype=torch.int64), "h": torch.randn(5).double()}
    layout = ws.FlatLayout.from_weights(flat, torch.bfloat16)
    assert layout.spec == ws.FlatLayout.from_weights(flat).spec  # what the receiver checks: the model's dtypes
    assert {s.key: s.wire for s in layout.slots} == {"w": torch.bfloat16, "step": torch.int64, "h": torch.bfloat16}
    assert {s.key: s.nbytes for s in layout.slots} == {"w": 200, "step": 24, "h": 10}
    assert ws.FlatLayout.from_plain(layout.to_plain()) == layout
    assert ws.FlatLayout.from_plain(layout.to_plain()) != ws.FlatLayout.from_weights(flat)
    buffers, ranges = layout.pieces(flat, torch.zeros(layout.nbytes, dtype=torch.uint8), direct_min=1)
    assert all(b.data_ptr() != flat["w"].data_ptr() for b in buffers)  # a cast tensor is always packed
    out = {k: torch.empty_like(v) for k, v in flat.items()}
    copies.write_into(out, layout.unpack(buffers, ranges))
    for key, tensor in flat.items():
        expected = tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.is_floating_point() else tensor
        assert torch.equal(out[key], expected) and out[key].dtype == tensor.dtype


def test_layout_buckets_tile_the_buffer_at_tensor_boundaries():
    layout = ws.FlatLayout.from_weights(
        {"a": torch.randn(100), "b": torch.randn(10), "c": torch.randn(1000), "d": torch.randn(5)}
    )
    assert layout.buckets(None) == [(0, 4, 0, layout.nbytes)]
    for max_bytes in (1, 500, 4000, 10**9):
        buckets = layout.buckets(max_bytes)
        assert buckets[0][0] == 0 and buckets[0][2] == 0 and buckets[-1][1:4:2] == (4, layout.nbytes)
        for (_, last, _, end), (first, _, start, _) in zip(buckets, buckets[1:]):
            assert last == first and end == start == layout.slots[first].offset
        for first, last, start, _ in buckets:  # within the bound, unless one tensor alone exceeds it
            assert (
                last - first == 1 or layout.slots[last - 1].offset + layout.slots[last - 1].nbytes - start <= max_bytes
            )
    assert [b[:2] for b in layout.buckets(500)] == [(0, 2), (2, 3), (3, 4)]


def _copy_on_threads(dst, src, threads):
    """``copy_tensors(dst, src)`` with torch set to ``threads`` threads, restored after."""
    from weightsync.tensors import copies as strategy

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        strategy.copy_tensors(dst, src)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_small_tensors_are_copied_on_every_thread_exactly(monkeypatch, threads):
    """Above 4 MB of small tensors, copy_tensors spreads them over torch's threads (and keeps the large ones
    on the caller's); every byte lands where it belongs, parameters that require grad included."""
    from weightsync.tensors import copies as strategy

    started = []

    class Spy(strategy.threading.Thread):
        def start(self):
            started.append(self)
            super().start()

    monkeypatch.setattr(strategy.threading, "Thread", Spy)
    gen = torch.Generator().manual_seed(threads)
    shapes = [(64, 64)] * 300 + [(3,)] * 7 + [(1024, 256)] * 2  # 4.9 MB of small tensors, 2 MB of large
    src = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes] + [torch.arange(50, dtype=torch.int64)]
    dst = [torch.zeros_like(t, requires_grad=False) for t in src]
    _copy_on_threads(dst, src, threads)
    assert len(started) == threads - 1  # one helper per extra thread; none with one thread
    for i, (d, s) in enumerate(zip(dst, src)):
        assert torch.equal(d, s.detach()), i
        assert d.grad_fn is None and not d.requires_grad, i


@pytest.mark.parametrize("threads", [1, 2])
def test_small_copies_stay_on_the_calling_thread_exactly(monkeypatch, threads):
    """Under 1 MiB in all, copy_tensors cuts every tensor torch would copy on several threads into pieces it
    copies on one (contiguous ones only); every byte lands where it belongs, casts included, and every
    written tensor's version counter moves (what autograd checks)."""
    from weightsync.tensors import copies as strategy

    calls = []
    real = torch._foreach_copy_

    def spy(dst, src):
        calls.append(([t.numel() for t in dst], torch.get_num_threads()))
        return real(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    gen = torch.Generator().manual_seed(7)
    src = [
        nn.Parameter(torch.randn(183, 183, generator=gen)),  # 33489 elements: torch would use every thread
        torch.randn(70000, generator=gen),  # three pieces
        torch.randn(5, generator=gen),
        torch.randn(200, 180, generator=gen).t(),  # not contiguous: left whole
        torch.randn(40000, generator=gen),  # copied into bfloat16 (a wire cast), in pieces too
    ]
    dst = [torch.zeros(183, 183), torch.zeros(70000), torch.zeros(5), torch.zeros(180, 200)]
    dst.append(torch.zeros(40000, dtype=torch.bfloat16))
    dst[0] = nn.Parameter(dst[0])  # a worker's model, written in place
    versions = [t._version for t in dst]
    _copy_on_threads(dst, src, threads)
    for i, (d, s) in enumerate(zip(dst, src)):
        assert torch.equal(d, s.detach().to(d.dtype)), i
        assert d._version > versions[i], i  # autograd sees every tensor written, pieces or not
    assert dst[0].requires_grad and dst[0].grad_fn is None
    assert all(d.grad_fn is None and not d.requires_grad for d in dst[1:])
    ((sizes, threads_then),) = calls
    assert threads_then == threads  # the process's thread count is not touched
    if threads == 1:
        assert sizes == [t.numel() for t in dst]  # nothing to gain: one call, whole tensors
    else:
        assert sorted(n for n in sizes if n >= strategy.PARALLEL_MIN_NUMEL) == [36000]  # the transposed one
        assert sum(sizes) == sum(t.numel() for t in dst) and len(sizes) == 5 + 1 + 2 + 1


@pytest.mark.parametrize(
    "keys",
    [
        ["body.0.weight", "x", "body.0.bias", "body.y", "buf.a.b", "z", "body.1.w"],  # leaves first, then groups
        ["a", "a.b"],  # a key that is also a prefix: tensordict's own answer
        ["a..b", "c"],  # an empty part: likewise
    ],
)
def test_the_tensordict_format_is_the_unflattened_one(keys):
    # format() nests the keys itself (4 times faster than unflatten_keys, paid at every receive()): same result.
    flat = {key: torch.full((1,), float(i)) for i, key in enumerate(keys)}
    strategy = ws.WeightStrategy("tensordict")
    try:
        expected = TensorDict(dict(flat), batch_size=[]).unflatten_keys(".")
    except Exception as exc:  # noqa: BLE001 - then format() must fail the same way
        with pytest.raises(type(exc)):
            strategy.format(flat)
        return
    got = strategy.format(flat)
    assert list(got.keys(True, True)) == list(expected.keys(True, True))
    assert all(got[key] is expected[key] for key in expected.keys(True, True))  # the same tensors: no copy
    assert got.batch_size == expected.batch_size and got.device == expected.device


def test_weights_whose_bytes_cannot_be_sent_are_refused_by_name_at_init_and_at_send():
    """A sparse, nested, quantized or meta tensor among the trainer's weights was taken at ``init_on_sender`` and
    failed at ``connect()`` inside torch's copy (not naming the tensor; the workers waited their whole
    ``connect_timeout``); given to ``send(weights=)``, the same. Now refused by name, and nothing is sent."""
    unsendable = {
        "sparse_coo": torch.zeros(2, 3).to_sparse(),
        "nested": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "quantized": torch.quantize_per_tensor(torch.zeros(6), 0.1, 0, torch.qint8),
    }
    for why, tensor in unsendable.items():
        scheme = ws.MultiProcessWeightSyncScheme()
        with pytest.raises(ws.InvalidWeightsError, match=rf"not these: \{{'w': '{why}"):
            scheme.init_on_sender(model_id="policy", weights={"w": tensor, "b": torch.zeros(2)}, num_workers=1)
        assert scheme.state == "new"
    scheme = ws.MultiProcessWeightSyncScheme(sync=False)
    scheme.init_on_sender(model_id="policy", weights={"w": torch.zeros(2, 3)}, num_workers=1)
    for bad in (unsendable["sparse_coo"], torch.zeros(2, 3, device="meta")):
        with pytest.raises(ws.InvalidWeightsError, match=r"not these: \{'w': '(sparse_coo|on the meta device)"):
            scheme.prepare_weights({"w": bad})
    # A skeleton on the meta device, whose weights are given at each send, is registered; what reads it is refused.
    skeleton = ws.MultiProcessWeightSyncScheme(sync=False)
    skeleton.init_on_sender(model_id="policy", weights={"w": torch.zeros(2, 3, device="meta")}, num_workers=1)
    with pytest.raises(ws.InvalidWeightsError, match=r"not these: \{'w': 'on the meta device"):
        skeleton.prepare_weights(None)
    assert skeleton.prepare_weights({"w": torch.ones(2, 3)})["w"].sum() == 6


def test_keys_that_are_not_names_are_refused_and_weights_keyed_by_worker_say_how_to_send_them():
    """TorchRL's per-worker form, ``update_policy_weights_({0: w0, 1: w1})``, was refused as "weight keys must be
    strings, got 0 (int)": it says now that it is not one model's weights, and how to send each its own."""
    weights = {"w": torch.zeros(2)}
    with pytest.raises(ws.InvalidWeightsError, match=r"keyed by worker index \(\[0, 1\]\).*worker_ids=i"):
        ws.WeightStrategy().flat({0: weights, 1: weights})
    with pytest.raises(ws.InvalidWeightsError, match="weight keys must be strings, got 3 \\(int\\)"):
        ws.WeightStrategy().flat({"w": torch.zeros(2), 3: torch.zeros(2)})


def test_a_dotted_key_and_a_nested_one_of_the_same_name_are_refused_not_merged():
    """``{"a.b": x, "a": {"b": y}}`` flattened to one ``a.b`` (``y``), and ``x`` was dropped without a word."""
    for weights in (
        {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}},
        {"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)},
    ):
        with pytest.raises(ws.InvalidWeightsError, match="two weights are named 'a.b'"):
            ws.WeightStrategy().flat(weights)
    assert list(ws.WeightStrategy().flat({"a": {"b": torch.ones(1)}, "a.c": torch.ones(1)})) == ["a.b", "a.c"]


@pytest.mark.parametrize("backend", ["multiprocess", "shared_mem"])
def test_a_worker_model_sent_without_weights_is_given_memory_or_refused_naming_what_no_update_fills(backend):
    """A worker's model on the meta device (TorchRL's collectors send a policy so): its first update gives it memory
    in place, and where torch cannot (an LSTM's weights, weakly referenced), its module is given memory anew; the
    LSTM computes with each version. Under ``state_dict``, a non-persistent buffer would stay without data: the
    worker is refused by name at connect, where its first forward pass failed far from there ("Tensor on device
    meta")."""
    from tests._workers import Recurrent, in_process_receiver

    torch.manual_seed(0)
    trainer, x = Recurrent(offset=5.0), torch.randn(3, 2)
    scheme = ws.WeightSyncScheme.from_backend(backend, sync=False, timeout=20, connect_timeout=20)
    scheme.init_on_sender(model_id="policy", model=trainer, num_workers=1)
    worker = Recurrent().to("meta")
    receiver = in_process_receiver(scheme, worker)
    try:
        assert not any(t.is_meta for t in [*worker.parameters(), *worker.buffers()])
        assert torch.equal(worker(x), trainer(x)) and float(worker.offset) == 5.0
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(-2.0)
        scheme.send_async()
        assert receiver.receive(timeout=10) is not None
        scheme.wait_async()
        assert torch.equal(worker(x), trainer(x))
    finally:
        receiver.shutdown()
        scheme.shutdown()
    scheme = ws.WeightSyncScheme.from_backend(backend, strategy="state_dict", timeout=10, connect_timeout=20)
    scheme.init_on_sender(model_id="policy", model=trainer, num_workers=1)
    worker = Recurrent().to("meta")
    with pytest.raises(ws.WeightSyncError, match=r"missing keys \['offset'\]: .*meta device.*strategy 'tensordict'"):
        in_process_receiver(scheme, worker)
    scheme.shutdown()


def test_a_skeleton_whose_weakly_referenced_weights_are_tied_is_refused_and_left_as_it_was():
    """Given memory module by module (``to_empty``), a weight two modules share, or one module under two names,
    would become two, and the tie would be gone: refused, naming the weights, before any tensor is given memory
    (a module beside them too). A module whose other tensors torch can swap (an LSTM subclass's learnt initial
    state) is given memory whole: it was refused as holding data, once that tensor had been given memory."""
    from weightsync.tensors.skeleton import materialize
    from weightsync.tensors.strategy import flatten_weights

    across = nn.ModuleDict({"a": nn.LSTM(2, 2), "b": nn.LSTM(2, 2), "head": nn.Linear(2, 1)}).to("meta")
    across.b.weight_ih_l0 = across.a.weight_ih_l0
    within = nn.LSTM(2, 2, num_layers=2).to("meta")
    within.weight_hh_l1 = within.weight_hh_l0
    for model in (across, within):
        with pytest.raises(ws.ConfigurationError, match=r"weight_hh_l0'.*\] .* shares one of them \(tied\)"):
            materialize(model, flatten_weights(model, "tensordict"), [], "tensordict")
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert across.b.weight_ih_l0 is across.a.weight_ih_l0 and within.weight_hh_l1 is within.weight_hh_l0

    class WithInitialState(nn.LSTM):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.h0 = nn.Parameter(torch.zeros(1, 2))

    model = WithInitialState().to("meta")
    flat = materialize(model, flatten_weights(model, "tensordict"), [], "tensordict")
    assert list(flat) == list(dict(model.named_parameters())) and not any(t.is_meta for t in flat.values())


def test_a_state_dict_with_tied_weights_sent_under_tensordict_is_refused_naming_the_tie():
    """``send(weights=model.state_dict())`` of a model with tied embeddings was refused as "extra keys
    ['head.weight']", a real parameter of the user's model, without a word of the tie or what to send instead."""
    from tests._workers import in_process_receiver

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(4, 3), nn.Linear(3, 4, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    scheme = ws.MultiProcessWeightSyncScheme(sync=False, timeout=20, connect_timeout=20)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, Tied())
    try:
        with pytest.raises(ws.WeightMismatchError, match=r"extra keys \['head.weight'\]: they are tied to \['emb.we"):
            scheme.send_async(weights=model.state_dict())
        with pytest.raises(ws.WeightMismatchError, match=r"extra keys \['head.weight', 'x'\] \(target left"):
            scheme.send_async(weights={**model.state_dict(), "x": torch.zeros(1)})
        assert scheme.version == 0
        scheme.send_async(weights=dict(model.named_parameters()))
        assert receiver.receive(timeout=10) is not None
        scheme.wait_async()
    finally:
        receiver.shutdown()
        scheme.shutdown()
