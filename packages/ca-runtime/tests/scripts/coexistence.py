"""Runs torch's built-in compiled autograd and ours in one fresh process.

Usage: python coexistence.py ORDER BACKEND, ORDER one of torch_first,
ours_first, alternate. Each step's grads are compared with eager; prints one
line per step and exits non-zero on any mismatch. Run in a fresh interpreter
because which compiled autograd receives the generated nodes' functionals
first is decided once per process (see [Note: Sharing functionals with torch]).
"""

from __future__ import annotations

import sys

import ca_runtime
import torch
from torch._dynamo import compiled_autograd as torch_ca

ORDERS = {
    "torch_first": ["torch", "ours"],
    "ours_first": ["ours", "torch"],
    "alternate": ["torch", "ours"] * 3,
}


def main(order: str, backend: str) -> int:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    workloads = {
        "mlp": (mlp, lambda: mlp(torch.randn(4, 8)).pow(2).sum()),
        "transformer": (layer, lambda: layer(torch.randn(2, 5, 16)).pow(2).sum()),
    }

    def grads(impl: str, name: str) -> list[torch.Tensor]:
        model, loss_fn = workloads[name]
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if impl == "torch":
            with torch_ca._enable(lambda gm: torch.compile(gm, backend=backend)):
                loss_fn().backward()
        elif impl == "ours":
            with ca_runtime.enable(backend, capture_after=1):
                loss_fn().backward()
        else:
            loss_fn().backward()
        return [p.grad.clone() for p in model.parameters()]

    failures = 0
    for impl in ORDERS[order]:
        for name in workloads:
            got, want = grads(impl, name), grads("eager", name)
            ok = all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))
            failures += not ok
            print(f"{impl} {name} {'ok' if ok else 'MISMATCH'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
