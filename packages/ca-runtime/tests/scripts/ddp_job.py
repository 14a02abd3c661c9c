"""A 2-rank gloo DDP or FSDP2 job compared with eager on every rank (ca_testkit.compare).

Usage: python ddp_job.py CASE BACKEND [STEPS [IMPL]]. CASE is one of CASES;
IMPL a ca_testkit implementation (default "ca", which captures the first
backward; "ca-capture-after-2" is enable()'s default). Prints
one JSON line per rank ({"rank", "ok", "stats", "report"}) and exits non-zero
if any rank's grads differ from eager. Run in a fresh interpreter: ranks are
spawned processes and the job must exit cleanly (see test_distributed.py).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.utils.checkpoint
from ca_testkit import compare, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP


class Branchy(torch.nn.Module):
    """A model with a parameter the forward never uses (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class Checkpointed(torch.nn.Module):
    """``inner`` run under non-reentrant activation checkpointing."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _checkpointed_mlp() -> torch.nn.Module:
    """Two checkpointed blocks, each recomputed inside the compiled graph."""
    return torch.nn.Sequential(
        Checkpointed(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))),
        Checkpointed(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))),
    )


def _fully_shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each Linear its own group, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


#: case -> (model factory, wrapper, optimize_ddp mode, even steps under no_sync())
CASES = {
    "cpp_reducer": (_mlp, DDP, None, False),
    "no_sync": (_mlp, DDP, None, True),
    "find_unused": (Branchy, lambda m: DDP(m, find_unused_parameters=True), None, False),
    "python_reducer": (_mlp, DDP, "python_reducer", False),
    "fsdp2": (_mlp, _fully_shard, None, False),
    "ddp_checkpoint": (_checkpointed_mlp, DDP, None, False),
    "fsdp2_checkpoint": (_checkpointed_mlp, _fully_shard, None, False),
}


def ddp_case(rank: int, world_size: int, case: str, backend: str, steps: int, impl: str = "ca") -> dict:
    make, wrap, optimize_ddp, use_no_sync = CASES[case]
    if optimize_ddp is not None:
        torch._dynamo.config.optimize_ddp = optimize_ddp  # read when DDP wraps the model
    torch.manual_seed(0)
    model = wrap(make())

    def step(i: int) -> torch.Tensor:
        torch.manual_seed(100 + 10 * rank + i)  # each rank its own data
        x = torch.randn(5, 8)
        if use_no_sync and i % 2 == 0:
            with model.no_sync():
                loss = model(x).pow(2).sum()
                loss.backward()
        else:
            loss = model(x).pow(2).sum()
            loss.backward()
        return loss.detach()

    # Dynamo's graphs are recorded on the way to the backend, to show where
    # the all-reduce ended up.
    dynamo_ops: list[str] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        dynamo_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    compiler = lambda gm: torch.compile(gm, backend=recording)
    result = compare(step, compiler, tensors=getattr(model, "module", model), steps=steps, impl=impl)
    return {
        "rank": rank,
        "ok": result.ok,
        "stats": dict(result.stats),
        "report": result.report(),
        "all_reduce_in_graph": any("all_reduce" in op for op in dynamo_ops),
    }


def main(case: str, backend: str, steps: int, impl: str = "ca") -> int:
    results = run_ranks(ddp_case, case, backend, steps, impl, world_size=2, timeout=300)
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 4, *sys.argv[4:5]))
