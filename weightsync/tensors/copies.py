"""Copying weights between tensors: in place, whole sets at once, on as many of torch's threads as pay off."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

__all__ = ["copy_tensors", "in_shared_memory", "point_at", "write_into"]

#: torch copies a CPU tensor of this many elements or more on all its threads (``at::internal::GRAIN_SIZE``).
PARALLEL_MIN_NUMEL = 32768
#: A CPU tensor under this many bytes is copied by one thread (it has fewer than 32768 float32 elements).
SMALL_TENSOR_BYTES = 128 << 10
#: Small tensors are spread over torch's threads only when they add up to this much: a thread costs about 0.1 ms.
SPLIT_MIN_BYTES = 4 << 20
#: Copies adding up to less than this run on the calling thread alone (see :func:`copy_tensors`).
SERIAL_MAX_BYTES = 1 << 20


def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor], *, non_blocking: bool = False) -> None:
    """``dst[i].copy_(src[i])`` for every ``i`` (no autograd), on as many of torch's threads as pay off.

    A GPU on either side: the copies are queued on the current stream, ``non_blocking`` as asked. A blocking
    copy between a GPU and (pinned) host memory waits for the stream once per tensor; ``non_blocking=True``
    queues them all, and the caller waits once (the device's stream, or an event) before it reads or acks
    them. One pair is one ``copy_``, which reaches the copy engine's bandwidth (``_foreach_copy_`` of one GPU
    tensor goes through a generic kernel).

    Under 1 MiB in all, everything is copied on the calling thread: torch would hand each tensor of 32768
    elements or more to its other threads, and waking one costs more than the copy saves. On 2 cores,
    with ``OMP_WAIT_POLICY=PASSIVE`` and the workers of a send taking turns on the cores, one send's
    copy of a 0.4 MB MLP took 0.3 ms that way (median under ``cProfile``, 1000 sends) against 0.02 ms on one
    thread; alone in a process, 0.4 MB took 26 to 29 us on 2 threads and 14 to 16 us on one, 1 MB 39 to 41
    against 28 to 30 us. Such tensors are cut into 1-D pieces under 32768 elements, which torch copies on
    the calling thread (the thread count is process state, so it is left alone).

    Above that, one ``torch._foreach_copy_`` copies each small tensor on one thread, in turn: 2000 tensors of
    50 kB (100 MB) took 11.3 ms where one 100 MB copy took 6.7 ms. Spreading the small ones over
    ``torch.get_num_threads()`` threads (a run of them each; large tensors stay on this thread, where torch
    parallelises each) brought that to 9.2 ms on 2 cores (medians of 55, alternating, in one process).
    On a later day, when one thread already copied them in 7.4 ms (one 100 MB copy: 5.4 to 6.0 ms), the
    spread copy took the same time (7.5 ms, medians of 8 alternating rounds): it gains where one thread
    cannot draw the memory bandwidth, and costs nothing measurable where it can.
    """
    if not dst:
        return
    if non_blocking or not (dst[0].is_cpu and src[0].is_cpu):
        with torch.no_grad():  # a GPU is involved: queued on its stream, not spread over threads
            if len(dst) == 1:
                dst[0].copy_(src[0], non_blocking=non_blocking)
            else:
                torch._foreach_copy_(dst, src, non_blocking=non_blocking)
        return
    threads = torch.get_num_threads()
    small: list[int] = []
    large: list[int] = []
    wide: list[int] = []  # those torch may copy on several threads
    small_bytes = total = 0
    if threads > 1:
        for i, t in enumerate(dst):
            n = t.nbytes
            total += n
            if n >= PARALLEL_MIN_NUMEL:  # (an element is at least a byte)
                wide.append(i)
            if n < SMALL_TENSOR_BYTES and t.is_cpu:
                small.append(i)
                small_bytes += n
            else:
                large.append(i)
    with torch.no_grad():
        if threads > 1 and total < SERIAL_MAX_BYTES:
            dst, src = _serial_pieces(dst, src, wide)
        if small_bytes < SPLIT_MIN_BYTES or len(dst) <= 4 * threads:
            torch._foreach_copy_(dst, src)
            return
        runs = [small[k::threads] for k in range(threads)]  # interleaved: runs of about equal bytes
        errors: list[BaseException] = []

        def copy_run(run: list[int]) -> None:
            try:
                with torch.no_grad():  # grad mode is per thread
                    torch._foreach_copy_([dst[i] for i in run], [src[i] for i in run])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller below
                errors.append(exc)

        helpers = [threading.Thread(target=copy_run, args=(run,), daemon=True) for run in runs[1:]]
        for helper in helpers:
            helper.start()
        copy_run(runs[0])
        if large:
            copy_run(large)
        for helper in helpers:
            helper.join()  # no timeout: a memory copy, which cannot block on anything
        if errors:
            raise errors[0]


def _serial_pieces(
    dst: list[torch.Tensor], src: list[torch.Tensor], candidates: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``dst`` and ``src`` with each CPU tensor of ``candidates`` that torch would copy on several threads
    replaced by 1-D pieces it copies on one (both sides contiguous; others are left whole)."""
    dst, src = list(dst), list(src)
    extra_dst: list[torch.Tensor] = []
    extra_src: list[torch.Tensor] = []
    for i in candidates:
        d, s = dst[i], src[i]
        numel = d.numel()
        if numel >= PARALLEL_MIN_NUMEL and d.is_cpu and s.is_cpu and d.is_contiguous() and s.is_contiguous():
            whole, rest = divmod(numel, PARALLEL_MIN_NUMEL - 1)
            sizes = [PARALLEL_MIN_NUMEL - 1] * whole + ([rest] if rest else [])
            # Views tracked as views (not `unsafe_split`): writing into them bumps the tensor's version counter.
            d_pieces = d.view(-1).split_with_sizes(sizes)
            s_pieces = s.view(-1).split_with_sizes(sizes)
            dst[i], src[i] = d_pieces[0], s_pieces[0]
            extra_dst += d_pieces[1:]
            extra_src += s_pieces[1:]
    return dst + extra_dst, src + extra_src


def in_shared_memory(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether some CPU tensor's storage is in shared memory (``share_memory_()``): other processes may read
    it, so a receiver must write into it rather than move the model to a buffer of its own (1 us a tensor)."""
    return any(t.is_cpu and t.is_shared() for t in tensors.values())


def write_into(
    dst: Mapping[str, torch.Tensor],
    src: Mapping[str, torch.Tensor],
    *,
    share: bool = False,
    non_blocking: bool = False,
) -> bool:
    """Copy (or share) ``src[k]`` into ``dst[k]`` for every key; the caller has checked the specs
    (``non_blocking``: see :func:`copy_tensors`).

    Returns whether every tensor was shared (``share`` and all of them on the CPU): the model's tensors
    then hold ``src``'s storage, views and all."""
    with torch.no_grad():  # parameters are written in place as they are: no autograd, no `.data` alias
        if not share:
            copy_tensors(list(dst.values()), [src[key] for key in dst], non_blocking=non_blocking)
            return False
        copies_dst, copies_src = [], []
        for key, target in dst.items():
            value = src[key]
            if target.is_cpu and value.is_cpu:  # (`.device.type` costs 1.5 us a tensor, 10x this)
                target.data = value
            else:
                copies_dst.append(target)
                copies_src.append(value)
        if copies_dst:
            copy_tensors(copies_dst, copies_src, non_blocking=non_blocking)
        return not copies_dst


def point_at(dst: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> None:
    """Make every tensor of ``dst`` the view ``views[k]`` (same device, shape and dtype, checked by the caller):
    the tensor objects stay, their memory becomes the views'."""
    with torch.no_grad():
        for key, tensor in dst.items():
            tensor.data = views[key]
