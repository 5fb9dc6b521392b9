"""weightsync.app.llama: random-weight Llama models written to a folder with no download, their sizes computed
without building them, and a second write of the same spec that writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from weightsync.app import llama
from weightsync.app.llama import SPEC_FILE, TINY, LlamaSpec, load_llama, spec_for_size, write_llama
from weightsync.core.timing import deadline_after, wait_until
from weightsync.errors import ConfigurationError

transformers = pytest.importorskip(
    "transformers", reason='the Llama builder needs transformers: `pip install -e ".[vllm]"` (or `.[test]`) installs it'
)
pytest.importorskip("tokenizers", reason='the Llama builder needs tokenizers: `pip install -e ".[vllm]"` installs it')
safetensors = pytest.importorskip("safetensors")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("megabytes", [50, 500])
def test_a_spec_for_a_size_is_within_15_percent_of_it_with_more_layers_than_width(megabytes, tie, dtype):
    spec = spec_for_size(megabytes, dtype=dtype, tie_word_embeddings=tie, seed=3)
    assert abs(spec.nbytes / (megabytes * 1e6) - 1) <= 0.15, spec
    assert spec.vocab_size % 64 == 0 and spec.hidden_size <= 1024 and spec.num_layers <= 40
    assert spec.num_tensors >= 100, "the issue asks for hundreds of tensors"
    assert (spec.dtype, spec.tie_word_embeddings, spec.seed) == (dtype, tie, 3)


def test_sizes_are_counted_without_a_model_and_refused_when_they_make_none():
    assert TINY.num_parameters == 1_836_288  # what transformers counts for this shape, untied
    assert replace(TINY, tie_word_embeddings=True).num_parameters == 1_836_288 - 1024 * 256
    assert replace(TINY, dtype="bfloat16").nbytes == TINY.nbytes // 2
    with pytest.raises(ConfigurationError, match="num_kv_heads"):
        replace(TINY, num_kv_heads=3)
    with pytest.raises(ConfigurationError, match="dtype"):
        replace(TINY, dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="megabytes"):
        spec_for_size(0, dtype="float32", tie_word_embeddings=False)


def _stored(folder):
    with safetensors.safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("models") / "tiny", TINY)


def test_a_tiny_model_writes_reloads_and_its_tokenizer_round_trips_text(tiny):
    from transformers import AutoTokenizer

    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", SPEC_FILE} <= {
        p.name for p in tiny.iterdir()
    }
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")], "a staging folder was left behind"
    assert tiny.stat().st_mode & 0o755 == 0o755
    model = load_llama(tiny)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == TINY.num_parameters
    assert (tiny / "model.safetensors").stat().st_size - TINY.nbytes < 64 * 1024  # the rest is the header
    weights = model.state_dict()
    assert weights["model.norm.weight"].eq(1).all()
    assert 0.015 < weights["model.layers.0.mlp.up_proj.weight"].std().item() < 0.025
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"])

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    text = "the quick brown fox jumps over the lazy dog, twice: Ünïcödé 123"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < TINY.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (0, 1)

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), TINY.vocab_size) and torch.isfinite(logits).all()


def test_a_tied_model_stores_the_embedding_once_and_its_state_dict_names_both(tmp_path, tiny):
    tied = write_llama(tmp_path / "tied", replace(TINY, tie_word_embeddings=True))
    stored = _stored(tied)
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    assert len(stored) == replace(TINY, tie_word_embeddings=True).num_tensors
    weights = load_llama(tied).state_dict()
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])

    untied_stored = _stored(tiny)
    assert "lm_head.weight" in untied_stored and len(untied_stored) == TINY.num_tensors
    untied = load_llama(tiny).state_dict()
    assert set(untied) == set(weights)  # the same names: the trainer sends lm_head either way
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])


def test_a_bfloat16_model_is_the_float32_one_rounded(tmp_path, tiny):
    folder = write_llama(tmp_path / "bf16", replace(TINY, dtype="bfloat16"))
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert (folder / "model.safetensors").stat().st_size < TINY.nbytes * 0.51
    bf16 = load_llama(folder)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    f32 = load_llama(tiny).state_dict()
    for name, tensor in bf16.state_dict().items():
        assert torch.equal(tensor, f32[name].to(torch.bfloat16)), name
    assert {p.dtype for p in load_llama(folder, dtype="float32").parameters()} == {torch.float32}


def test_a_second_write_of_the_same_spec_writes_nothing_and_another_spec_replaces_it(tmp_path):
    folder = write_llama(tmp_path / "m", TINY)
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert write_llama(folder, TINY) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes

    other = replace(TINY, seed=1)
    write_llama(folder, other)
    recorded = json.loads((folder / SPEC_FILE).read_text())
    assert recorded.pop("format") == 1 and LlamaSpec(**recorded) == other
    assert (folder / "model.safetensors").stat().st_mtime_ns != mtimes["model.safetensors"]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="did not write"):
        write_llama(mine, TINY)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_folder_another_user_could_have_written_is_refused_not_taken_for_the_model(tmp_path):
    """The docs write their models to folders in ``/tmp``, where another user may make them first, with the spec
    file and their own weights (a review did, as uid 65534): the trainer loaded the stranger's weights."""
    folder = write_llama(tmp_path / "m", TINY)
    folder.chmod(0o777)  # (others may write in it)
    with pytest.raises(FileExistsError, match=r"mode 777: a model in it may be anyone's"):
        write_llama(folder, TINY)
    folder.chmod(0o755)
    assert write_llama(folder, TINY) == folder
    (tmp_path / "link").symlink_to(folder)  # (a stranger's link to a folder of theirs, in /tmp)
    with pytest.raises(FileExistsError, match="is a symbolic link"):
        write_llama(tmp_path / "link", TINY)
    if os.getuid() != 0:
        pytest.skip("giving the folder to another user needs root")
    os.chown(folder, 65534, 65534)
    with pytest.raises(FileExistsError, match=rf"is a folder of user 65534 \(this is user {os.getuid()}\)"):
        write_llama(folder, TINY)


_FLIP = """
import os, sys, time
theirs, name, until = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
while time.monotonic() < until:
    os.rename(theirs, name)
    os.rename(name, theirs)
"""


class _WouldWrite(Exception):
    pass


def test_a_folder_another_user_swaps_in_while_it_is_looked_at_is_never_taken(tmp_path, monkeypatch):
    """A review's race, as uid 65534: a folder of theirs (the spec asked for, weights of their own) renamed in and
    out of the model's name; write_llama looked at the name while it was free, then read the spec through it
    while it was theirs, and the trainer and its engine loaded their weights (one run in three)."""
    if os.getuid() != 0:
        pytest.skip("giving the folder to another user needs root")
    theirs = write_llama(tmp_path / "theirs", TINY)
    os.chown(theirs, 65534, 65534)
    monkeypatch.setattr(llama, "_write", lambda folder, spec: (_ for _ in ()).throw(_WouldWrite()))
    name = tmp_path / "m"
    outcomes = {"taken": 0, "refused": 0, "absent": 0}
    flipper = subprocess.Popen([sys.executable, "-c", _FLIP, str(theirs), str(name), "20"])
    try:
        assert wait_until(lambda: not theirs.exists() or flipper.poll() is not None, deadline_after(20), 0.01)
        began = time.monotonic()  # (it flips: at least 2.5 s of looks, until one met the folder, 15 s at most)
        while (time.monotonic() < began + 2.5 or not outcomes["refused"]) and time.monotonic() < began + 15:
            assert flipper.poll() is None, "the renaming process ended"
            try:
                write_llama(name, TINY)
                outcomes["taken"] += 1
            except FileExistsError:
                outcomes["refused"] += 1
            except _WouldWrite:
                outcomes["absent"] += 1
            except FileNotFoundError:  # (gone between two looks: no model taken either)
                outcomes["absent"] += 1
    finally:
        flipper.kill()
        flipper.wait(10)
    assert outcomes["taken"] == 0 and outcomes["refused"] > 0, outcomes
