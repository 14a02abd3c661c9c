"""Prints the peak resident memory of one warm backward, eager and under ca_runtime, as JSON.

Run with MALLOC_MMAP_THRESHOLD_=65536 (every tensor buffer its own mapping,
freed to the system at once) so that RSS follows live tensor bytes; see
bench/run.py's backward_peak_bytes. Usage: backward_peak_memory.py BACKEND
[checkpoint | stance | eager-if-faster]; with ``checkpoint`` each pair of layers
is a non-reentrant checkpointed region; with ``stance`` one earlier hit runs
under ``torch.compiler.set_stance("force_eager")`` (the graph as Python, its
nodes run for real; see [Note: Nodes that run for real keep their saved
tensors]); with ``eager-if-faster`` the compiled graph sleeps 250 ms (eager's backward
here took 261-365 ms on a loaded 2-core machine: 50 ms was within its
spread, and one CI run chose the compiled graph), so that the
entry chooses the eager engine, and the backward measured runs there (see
[Note: The walk lets go before eager runs]).
"""

from __future__ import annotations

import contextlib
import json
import sys

import ca_runtime
import torch
import torch.utils.checkpoint
from ca_testkit.scenarios import slowed_compiler


def _rss_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmHWM", "VmRSS"))}


def peak_above_start(loss: torch.Tensor) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _rss_kib()["VmRSS"]
    loss.backward()
    return (_rss_kib()["VmHWM"] - start) * 1024


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # 8 layers: saved activations (2 MiB each) and weight grads (4 MiB each)
    # of the same order, so freeing the former as the backward goes offsets
    # the latter.
    layers = [m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(512, 1024)
    if sys.argv[2:] == ["checkpoint"]:
        regions = [torch.nn.Sequential(*layers[i : i + 4]) for i in range(0, len(layers), 4)]

        def forward(h: torch.Tensor) -> torch.Tensor:
            for region in regions:
                h = torch.utils.checkpoint.checkpoint(region, h, use_reentrant=False)
            return h

        model.forward = forward  # type: ignore[method-assign]
    eager_if_faster = sys.argv[2:] == ["eager-if-faster"]
    compiler_fn = slowed_compiler(sys.argv[1], 0.25) if eager_if_faster else sys.argv[1]
    contexts = {
        "eager": contextlib.nullcontext,
        "ca": lambda: ca_runtime.enable(compiler_fn, eager_if_faster=eager_if_faster, capture_after=1),
    }
    stance_step = 2 if sys.argv[2:] == ["stance"] else -1
    # eager-if-faster: a first run, 4 untimed hits, 8 timed backwards each way,
    # then the entry runs eagerly ([Note: Eager if faster]).
    ca_steps = 23 if eager_if_faster else 5 if stance_step >= 0 else 4
    peaks = {}
    for name, make in contexts.items():
        steps = ca_steps if name == "ca" else 4  # eager's peak is the same from its second step on
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            stance = (
                torch.compiler.set_stance("force_eager") if step == stance_step else contextlib.nullcontext()
            )
            with make(), stance:
                if step < steps - 1:
                    loss.backward()
                else:
                    peaks[name] = peak_above_start(loss)
    print(json.dumps({"peaks": peaks, "stats": ca_runtime.stats()}))


if __name__ == "__main__":
    main()
