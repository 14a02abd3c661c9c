"""The peak of live CPU tensor bytes while a backward runs, exact, from the allocator's profiler events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The profiler range that marks the backward among the forward's events.
_MARK = "ca_testkit.backward"


def backward_tensor_peak_bytes(
    forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward
) -> tuple[int, int]:
    """(peak, end) bytes of live CPU tensor storage during ``backward(forward())``, above the backward's start.

    ``torch.profiler`` with ``profile_memory=True`` records every allocation
    and free of the CPU allocator: eager's kernels, Inductor's buffers and
    extern kernels' outputs alike. The forward runs inside the profile too, so
    that the frees of its saved tensors during the backward are seen (the
    profiler does not report the frees of blocks allocated before it started).
    Unlike resident memory this counts no Python objects, heap pages or
    mappings: only the tensors the backward holds, byte for byte. Run it on a
    warm backward: a first one compiles, and the compile's own tensors count.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = forward()
        with record_function(_MARK):
            backward(loss)
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("backward_tensor_peak_bytes: the profiler recorded nothing")
    events = results.events()
    mark = next(e for e in events if e.name() == _MARK)
    start, end = mark.start_ns(), mark.end_ns()
    cpu = torch._C._autograd.DeviceType.CPU
    changes = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == cpu
    )
    before = sum(n for t, n in changes if t < start)
    live = peak = before
    for t, n in changes:
        if start <= t <= end:
            live += n
            peak = max(peak, live)
    return peak - before, live - before
