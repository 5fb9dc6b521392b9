"""Hugging Face Llama models with random weights, written to a folder with no download: what the vLLM tests,
example and benchmark serve and sync.

A :class:`LlamaSpec` fixes the shape, the dtype and the seed; :func:`write_llama` writes the model (safetensors),
its config and generation config, and a byte-level BPE tokenizer trained on the spot from a seeded random corpus,
so that ``transformers`` and ``vllm.LLM(model=path)`` load the folder as they would a downloaded checkpoint.
:func:`spec_for_size` picks a shape for a size in megabytes, and :func:`load_llama` loads the trainer's copy.

``transformers`` and ``tokenizers`` (the ``vllm`` extra) are imported by the functions that need them, never by
this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = ["TINY", "LlamaSpec", "load_llama", "spec_for_size", "write_llama"]

Dtype = Literal["float32", "bfloat16"]
_ITEMSIZE = {"float32": 4, "bfloat16": 2}
#: The file :func:`write_llama` writes last, holding the spec: a folder that has it holds that model whole.
SPEC_FILE = "weightsync_spec.json"
_SPEC_FORMAT = 1
_MAX_SPEC_BYTES = 1 << 16  # a spec file is a few hundred bytes: more is not one
_BOS, _EOS = "<s>", "</s>"  # token ids 0 and 1: the tokenizer's special tokens come first
#: Widths :func:`spec_for_size` chooses from (head_dim 64: 4 to 16 heads).
_HIDDEN_SIZES = (256, 384, 512, 640, 768, 896, 1024)
_MAX_LAYERS = 40
_MIN_VOCAB = 512


@dataclass(frozen=True)
class LlamaSpec:
    """The shape, dtype and seed of a random Llama-architecture model (``LlamaForCausalLM``).

    ``head_dim`` defaults to 64 because vLLM's CPU attention refuses some head sizes (16 among them); attention
    has no bias, like Llama's. ``num_heads * head_dim`` need not equal ``hidden_size`` (Llama's config allows it).
    """

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 64
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    dtype: Dtype = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigurationError(f"LlamaSpec.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigurationError(
                f"LlamaSpec.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if type(self.vocab_size) is not int or self.vocab_size < _MIN_VOCAB:
            # The byte-level tokenizer needs its 256 bytes and 2 special tokens, and some merges.
            raise ConfigurationError(f"LlamaSpec.vocab_size must be an int >= {_MIN_VOCAB}, got {self.vocab_size!r}")
        if type(self.max_position_embeddings) is not int or self.max_position_embeddings < 1:
            raise ConfigurationError(
                f"LlamaSpec.max_position_embeddings must be a positive int, got {self.max_position_embeddings!r}"
            )
        if self.dtype not in _ITEMSIZE:
            raise ConfigurationError(f"LlamaSpec.dtype must be one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def num_parameters(self) -> int:
        """The model's parameters, a tied embedding counted once (``sum(p.numel() for p in model.parameters())``)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h  # q, o; k, v; gate, up, down; norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h  # and the final norm

    @property
    def nbytes(self) -> int:
        """The bytes of the weights, which is the safetensors file's size less its header."""
        return self.num_parameters * _ITEMSIZE[self.dtype]

    @property
    def num_tensors(self) -> int:
        """The tensors the safetensors file holds: 9 per layer, the embedding, the final norm, and ``lm_head``
        unless it is tied to the embedding (a tied model's ``state_dict()`` still names both)."""
        return 9 * self.num_layers + 2 + (0 if self.tie_word_embeddings else 1)


#: A two-layer model of 7.3 MB in float32 (1.8 M parameters): the quickest to write and to serve.
TINY = LlamaSpec(
    hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=4, head_dim=64, vocab_size=1024
)


def spec_for_size(megabytes: float, *, dtype: Dtype, tie_word_embeddings: bool, seed: int = 0) -> LlamaSpec:
    """A Llama-like shape whose weights take about ``megabytes`` (10**6 bytes) in ``dtype``.

    Depth is preferred to width: the narrowest width (256 to 1024, head_dim 64, half as many key/value heads as
    heads, an MLP 8/3 as wide rounded up to a multiple of 64, a vocabulary of 8 tokens per unit of width) that
    reaches the size in at most 40 layers is taken, with as many layers as come closest. 50 MB is 16 layers of
    width 256 in float32, 500 MB 26 layers of width 640; a layer is 9 tensors. Above what 40 layers of width
    1024 hold, the model only gets deeper; below what one layer of width 256 holds, it stays one layer.

    Args:
        megabytes: the target size of the weights (:attr:`LlamaSpec.nbytes`), in units of 10**6 bytes.
        dtype: ``"float32"`` or ``"bfloat16"``.
        tie_word_embeddings: whether ``lm_head`` shares the embedding's weight (then it is not stored twice).
        seed: the seed of the weights and of the tokenizer.

    Returns:
        The spec; its ``nbytes`` is within half a layer of the target: 10% of it from 10 MB up, 3% from 40 MB.

    Raises:
        ConfigurationError: ``megabytes`` is not positive, or ``dtype`` is not one of the two.
    """
    if not megabytes > 0:
        raise ConfigurationError(f"spec_for_size needs megabytes > 0, got {megabytes!r}")
    if dtype not in _ITEMSIZE:
        raise ConfigurationError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {dtype!r}")
    target = megabytes * 1e6
    spec = None
    for hidden in _HIDDEN_SIZES:
        heads = hidden // 64
        spec = LlamaSpec(
            hidden_size=hidden,
            num_layers=1,
            intermediate_size=-(-hidden * 8 // 3 // 64) * 64,
            num_heads=heads,
            num_kv_heads=heads // 2,
            vocab_size=8 * hidden,
            tie_word_embeddings=tie_word_embeddings,
            dtype=dtype,
            seed=seed,
        )
        per_layer = replace(spec, num_layers=2).nbytes - spec.nbytes
        layers = max(1, round((target - spec.nbytes) / per_layer) + 1)
        spec = replace(spec, num_layers=layers)
        if layers <= _MAX_LAYERS:
            break
    assert spec is not None
    return spec


def write_llama(path: str | os.PathLike[str], spec: LlamaSpec = TINY) -> Path:
    """Write a random-weight Llama model and its tokenizer to the folder ``path``, unless it holds that spec.

    The folder gets what ``save_pretrained`` writes for the model (``config.json``, ``generation_config.json``,
    ``model.safetensors``: ``lm_head.weight`` is left out when it is tied to the embedding, and loaders tie it
    back), the tokenizer's files, and last :data:`SPEC_FILE`. The weights are transformers' initialization
    (normal with std 0.02, norms at 1) from ``spec.seed``, drawn in float32 (a bfloat16 model holds the float32
    model's weights rounded) without changing torch's global random state.
    The model is written to a temporary folder beside ``path`` and moved there whole, so a folder that holds
    :data:`SPEC_FILE` holds a complete model, and processes that write the same spec at once are all served.

    Args:
        path: the folder; it is created, with its parents, if missing. A folder holding another spec is
            replaced.
        spec: the model's shape, dtype and seed.

    Returns:
        ``path`` as a :class:`pathlib.Path`. When it already held ``spec``, nothing was written.

    Raises:
        FileExistsError: ``path`` is a file, a link, a non-empty folder that :func:`write_llama` did not write, a
            folder of another user or one others may write in, or in a parent folder of another user (not
            root) or that others may write in without the sticky bit.
        ImportError: ``transformers`` or ``tokenizers`` is missing (``pip install -e ".[vllm]"``).
    """
    path = Path(path)
    if _holds(path, spec):
        return path
    _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0o700 would follow the folder into place
        _write(staging, spec)
        if _holds(path, spec):  # another process wrote it meanwhile
            return path
        _check_replaceable(path)
        if path.exists() and any(path.iterdir()):  # an older spec of ours
            shutil.rmtree(path)
        os.replace(staging, path)  # rename(2) replaces an empty folder
    except OSError:
        if _holds(path, spec):  # lost a race to a process that wrote the same spec
            return path
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def load_llama(path: str | os.PathLike[str], *, dtype: Dtype | None = None) -> LlamaForCausalLM:
    """Load the model of a folder :func:`write_llama` wrote (or any Llama checkpoint in safetensors), in eval mode.

    Args:
        path: the folder.
        dtype: the dtype to load the weights in; ``None``: the one they were saved in.

    Returns:
        The ``transformers`` ``LlamaForCausalLM``, on the CPU: the trainer's model.

    Raises:
        ImportError: ``transformers`` is missing (``pip install -e ".[vllm]"``).
        OSError: ``path`` holds no model ``transformers`` can load from safetensors files.
    """
    from transformers import LlamaForCausalLM

    if dtype is not None and dtype not in _ITEMSIZE:
        raise ConfigurationError(f"dtype must be one of {sorted(_ITEMSIZE)} or None, got {dtype!r}")
    # Safetensors only: a pickled checkpoint beside it is never read.
    model = LlamaForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype) if dtype else "auto", use_safetensors=True
    )
    # train(False) is eval(): tests/test_hostile_configs.py refuses any call named eval in the library.
    return model.train(False)


def _spec_at(folder: int) -> LlamaSpec | None:
    """The spec :func:`write_llama` recorded in the open folder ``folder``; ``None`` when there is none, it is not
    a plain file, or it does not parse."""
    try:
        fd = os.open(SPEC_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError:
        return None
    try:
        with open(fd, "rb", closefd=False) as file:  # (a FIFO would block a read: only a plain file is read)
            raw = file.read(_MAX_SPEC_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        recorded = json.loads(raw)
        if recorded.pop("format") != _SPEC_FORMAT:
            return None
        return LlamaSpec(**recorded)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    finally:
        os.close(fd)


def _open_folder(path: Path) -> int | None:
    """The folder ``path`` opened, once it is known to be this user's alone; ``None`` where there is no folder.

    What is checked is the folder opened, and what is read is read through it: a name in ``/tmp`` may stand for
    another user's folder a moment later (a review swapped one in between a look at the name and a read of it).

    Raises:
        FileExistsError: the folder is another user's, or others may write in it; or its parent is another
            user's (not root's), or others may write in it without the sticky bit (they could put their folder in
            its place): its model may be anyone's (the docs' folders are in ``/tmp``, where another user may make
            them first: a review did, as uid 65534).
    """
    with contextlib.suppress(FileNotFoundError):
        parent = os.stat(path.parent)
        others_write = parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX
        if others_write or parent.st_uid not in (0, os.getuid()):
            raise FileExistsError(
                f"{path.parent} is a folder of user {parent.st_uid}, mode {stat.S_IMODE(parent.st_mode):o}: others "
                "may put a folder of theirs in place of the model's; give write_llama a folder in one of yours"
            )
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # (O_NOFOLLOW: a link too)
        if path.is_symlink():  # (a link's target is anyone's folder)
            raise FileExistsError(f"{path} is a symbolic link: give write_llama a folder of yours") from None
        return None
    except PermissionError:  # (another user's folder, closed to this one)
        found = path.lstat()
        raise _not_ours(path, found) from None
    found = os.fstat(folder)
    if found.st_uid != os.getuid() or found.st_mode & 0o022:
        os.close(folder)
        raise _not_ours(path, found)
    return folder


def _not_ours(path: Path, found: os.stat_result) -> FileExistsError:
    return FileExistsError(
        f"{path} is a folder of user {found.st_uid} (this is user {os.getuid()}), mode "
        f"{stat.S_IMODE(found.st_mode):o}: a model in it may be anyone's; give write_llama a folder of yours"
    )


def _holds(path: Path, spec: LlamaSpec) -> bool:
    """Whether the folder ``path``, this user's alone, holds the model of ``spec``.

    Raises:
        FileExistsError: as :func:`_open_folder`.
    """
    folder = _open_folder(path)
    if folder is None:
        return False
    try:
        return _spec_at(folder) == spec
    finally:
        os.close(folder)


def _check_replaceable(path: Path) -> None:
    folder = _open_folder(path)
    if folder is None:
        if path.exists() or path.is_symlink():
            raise FileExistsError(f"{path} exists and is not a folder")
        return
    try:
        if _spec_at(folder) is None and os.listdir(folder):
            raise FileExistsError(f"{path} is a folder write_llama did not write (no {SPEC_FILE}): not replacing it")
    finally:
        os.close(folder)


def _write(folder: Path, spec: LlamaSpec) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, spec.dtype)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        dtype=spec.dtype,
    )
    # transformers' own initialization (normal with std 0.02, norms at 1) takes about a second for 500 MB; in
    # float32 first, so that a bfloat16 model holds the float32 model's weights rounded.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1)
    model.save_pretrained(folder)
    _tokenizer(spec).save_pretrained(folder)
    (folder / SPEC_FILE).write_text(json.dumps({"format": _SPEC_FORMAT, **asdict(spec)}, indent=1) + "\n")


def _tokenizer(spec: LlamaSpec) -> Any:
    """A byte-level BPE tokenizer (``<s>`` = 0, ``</s>`` = 1) trained on a random corpus of lowercase words, its
    vocabulary no larger than the model's (and at most 1024: a bigger one takes longer to train, to no use)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(spec.seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(spec.vocab_size, 1024),
        special_tokens=[_BOS, _EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=_BOS, eos_token=_EOS)
