"""Where a steady-state backward spends its time: torch.profiler and perf, per implementation.

For each workload of ``bench/run.py`` (``--workloads``; by default the MLP,
transformer and GPT-style decoder with inductor and the chain of 1000 muls
with backend eager and with the no-work compiler) it profiles warm
``loss.backward()`` calls under eager autograd, ours and torch's built-in
compiled autograd (same ``compiler_fn``, 1 CPU thread) and prints:

- each one's top operators by self CPU time (``torch.profiler``);
- for ours (timed and compiled), the breakdown of a backward: our walk,
  lookup (lifting the inputs), the compiled run and our finish, and the
  whole engine hook (``ca_core`` timings), and inside the run Dynamo's guard
  check ("ca: Dynamo guard check" on our direct call, "TorchDynamo Cache
  Lookup" on Dynamo's) and the compiled region's own Python;
- the kernel floor of each workload: the time eager's backward alone spends
  in the matmul and attention kernels that a compiled backward calls
  unchanged (Inductor calls them as extern kernels, same shapes and
  strides), against eager's whole backward, and the same kernels' time in
  ours; no compiled backward that calls those kernels can be faster than
  that fraction of eager (see ``kernel_floor``);
- with ``--perf``, ``perf record`` of a loop of warm backwards per
  implementation, summarised by shared object (where the CPU time goes:
  libtorch's kernels, the Python interpreter, ca_core, libc's allocator).

This is the profile evidence ``bench/LOG.md`` cites.

    python bench/profile_models.py [--workloads mlp:inductor,chain1000:eager] [--rows 12] [--perf] [--floor-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ca_core
import ca_runtime
import torch
from run import IMPLS, Workload, implementation, make_workload, time_backward

DEFAULT = "mlp:inductor,transformer:inductor,gpt:inductor,chain1000:eager,chain1000:no-work"
#: Implementations whose backwards ca_core times, step by step.
TIMED_IMPLS = ("ours", "ours-compiled")
#: ca_core's timed parts of a backward ([Note: The steps of a backward]);
#: "hook" is the whole engine hook, the rest its steps.
HIT_PARTS = ("walk", "lookup", "run", "finish", "hook")
#: Profiler events that are ours to explain (the rest are kernels).
OVERHEAD_EVENTS = (
    "TorchDynamo Cache Lookup",
    "ca: Dynamo guard check",
    "Torch-Compiled Region",
    "## Call CompiledFxGraph",
)


def profile(key: str, compiler_name: str, rows: int, repeats: int = 20) -> dict[str, dict[str, float]]:
    work = make_workload(key, compiler_name)
    summary: dict[str, dict[str, float]] = {}
    for impl in IMPLS:
        for _ in range(3):
            time_backward(work, impl)
        ca_core.set_timing(impl in TIMED_IMPLS)
        before = ca_core.timings()
        times = [time_backward(work, impl) for _ in range(repeats)]
        after = ca_core.timings()
        ca_core.set_timing(False)
        with torch.profiler.profile() as prof:
            for _ in range(repeats):
                time_backward(work, impl)
        per_call = {"median_ms": statistics.median(times) * 1e3}
        for event in prof.key_averages():
            for name in OVERHEAD_EVENTS:
                if event.key.startswith(name):
                    per_call[name] = per_call.get(name, 0.0) + event.self_cpu_time_total / repeats / 1e3
        if impl in TIMED_IMPLS:
            n = max(after["timed_backwards"] - before["timed_backwards"], 1)
            for part in HIT_PARTS:
                per_call[f"ours {part}"] = (after[f"{part}_ns"] - before[f"{part}_ns"]) / n / 1e6
        summary[impl] = per_call
        print(
            f"===== {work.name} ({compiler_name}) / {impl}: "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in per_call.items())
        )
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
        )
    return summary


#: The kernels Inductor (and torch's compiled autograd) call as extern
#: kernels, exactly as eager calls them: their time is the same either way.
EXTERN_KERNELS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::convolution_backward",
)
#: The profiler range a profiled backward runs in.
BACKWARD_RANGE = "ca_bench.backward"


def _in_backward(event: Any) -> bool:
    """Whether ``event`` ran inside the profiled backward range."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == BACKWARD_RANGE:
            return True
        parent = parent.cpu_parent
    return False


def _kernels_ms(work: Workload, impl: str) -> float:
    """ms that one profiled ``loss.backward()`` of ``work`` spends in EXTERN_KERNELS (its forward unprofiled)."""
    loss = work.forward(0)
    for p in work.params:
        p.grad = None
    with (
        torch.profiler.profile() as prof,
        implementation(impl, work.compiler),
        torch.profiler.record_function(BACKWARD_RANGE),
    ):
        loss.backward()
    return (
        sum(e.self_cpu_time_total for e in prof.events() if e.name in EXTERN_KERNELS and _in_backward(e))
        / 1e3
    )


def kernel_floor(key: str, compiler_name: str, rounds: int = 15) -> dict[str, Any]:
    """The share of eager's backward spent in EXTERN_KERNELS: the lowest ours/eager that any compiled
    backward calling those kernels can reach, and the same kernels' time in ours (equal if it calls the same ones).

    Each round times one unprofiled backward per implementation and profiles
    one more; medians over the rounds, so that the machine's drift hits
    both. The profiler's cost per op inflates the many small ops, not these
    long kernels, so their profiled time stands against the unprofiled whole.
    """
    work = make_workload(key, compiler_name)
    impls = ("eager", "ours")
    for impl in impls:
        for _ in range(3):
            time_backward(work, impl)
    totals: dict[str, list[float]] = {impl: [] for impl in impls}
    kernels: dict[str, list[float]] = {impl: [] for impl in impls}
    before = ca_runtime.stats()
    for _ in range(rounds):
        for impl in impls:
            totals[impl].append(time_backward(work, impl) * 1e3)
            kernels[impl].append(_kernels_ms(work, impl))
    after = ca_runtime.stats()
    result: dict[str, Any] = {
        impl: {"backward_ms": statistics.median(totals[impl]), "kernels_ms": statistics.median(kernels[impl])}
        for impl in impls
    }
    # Ours must have run compiled: a silent fallback would profile eager twice.
    result["ours"].update({k: after[k] - before[k] for k in ("cache_hits", "eager_fallbacks")})
    eager, ours = result["eager"], result["ours"]
    result["floor_ratio"] = eager["kernels_ms"] / eager["backward_ms"]
    print(
        f"===== kernel floor {key} ({compiler_name}): eager backward {eager['backward_ms']:.3f} ms, "
        f"of which {eager['kernels_ms']:.3f} ms in matmul/attention kernels (floor {result['floor_ratio']:.2f}x "
        f"eager); ours {ours['backward_ms']:.3f} ms, the same kernels {ours['kernels_ms']:.3f} ms "
        f"({ours['cache_hits']} cache hits, {ours['eager_fallbacks']} eager fallbacks)"
    )
    return result


def perf_loop(key: str, compiler_name: str, impl: str, iters: int) -> None:
    """``--perf-child``: warms up, says so, waits for perf to attach, then runs the loop perf records."""
    work = make_workload(key, compiler_name)
    for _ in range(5):
        time_backward(work, impl)
    print("warm", flush=True)
    sys.stdin.readline()
    for _ in range(iters):
        time_backward(work, impl)


def perf_by_dso(key: str, compiler_name: str, impl: str, iters: int) -> dict[str, float]:
    """Share of CPU samples per shared object over ``iters`` warm backwards (start-up and warm-up excluded)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        command = [sys.executable, __file__, "--perf-child", key, compiler_name, impl, str(iters)]
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        if child.stdout.readline().strip() != "warm":
            child.kill()
            raise RuntimeError(f"{' '.join(command)} did not warm up")
        recorder = subprocess.Popen(
            ["perf", "record", "-q", "-F", "999", "-o", str(data), "-p", str(child.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # perf attaches
        child.stdin.write("go\n")
        child.stdin.flush()
        child.wait()
        recorder.wait(timeout=60)
        report = subprocess.run(
            ["perf", "report", "-i", str(data), "--stdio", "--sort", "dso", "--percent-limit", "1"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith("%") and not line.startswith("#"):
            shares[parts[1]] = float(parts[0].rstrip("%"))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads", default=DEFAULT, help=f"comma-separated KEY:COMPILER (default {DEFAULT})"
    )
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--perf", action="store_true", help="also perf record each implementation, by DSO")
    parser.add_argument("--perf-iters", type=int, default=50)
    parser.add_argument(
        "--floor-only", action="store_true", help="only each workload's kernel floor (see kernel_floor)"
    )
    parser.add_argument("--json", help="write the summaries here")
    parser.add_argument("--perf-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.perf_child:
        key, compiler_name, impl, iters = args.perf_child
        perf_loop(key, compiler_name, impl, int(iters))
        return
    if args.perf and shutil.which("perf") is None:
        parser.error("--perf needs Linux perf on PATH (Debian: apt-get install linux-perf)")
    results: dict[str, dict[str, object]] = {}
    for spec in args.workloads.split(","):
        key, _, compiler_name = spec.partition(":")
        entry: dict[str, object] = {}
        if not args.floor_only:
            entry["profiler"] = profile(key, compiler_name or "inductor", args.rows)
        if not key.startswith("chain"):
            entry["kernel_floor"] = kernel_floor(key, compiler_name or "inductor")
        if args.perf:
            entry["perf_by_dso"] = {
                impl: perf_by_dso(key, compiler_name or "inductor", impl, args.perf_iters) for impl in IMPLS
            }
            for impl, shares in entry["perf_by_dso"].items():  # type: ignore[union-attr]
                print(
                    f"perf {spec} / {impl}: " + ", ".join(f"{dso} {pct:.1f}%" for dso, pct in shares.items())
                )
        results[spec] = entry
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ca_profile_inductor_"))
    main()
