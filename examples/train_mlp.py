"""Demo: a small MLP trained for a few steps under ca compiled autograd.

Prints whether every gradient matches eager autograd, the capture and
cache-hit counters, and the time of each backward: the first runs on the
eager engine (``enable()`` captures a graph on its second backward), the
second captures and compiles, the later ones run the compiled graph.
"""

from __future__ import annotations

import argparse
import time

import ca_runtime
import torch
from ca_testkit.scenarios import batch, make_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--backend", default="aot_eager", help="torch.compile backend (eager, aot_eager, inductor)"
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    eager_model, compiled_model = make_mlp(sizes=(32, 64, 10)), make_mlp(sizes=(32, 64, 10))
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    compiled_opt = torch.optim.SGD(compiled_model.parameters(), lr=0.1)

    ca_runtime.reset()
    print(f"backend: {args.backend}")
    with ca_runtime.enable(args.backend):
        for step in range(args.steps):
            x, y = batch(step, n=16, features=32, classes=10)

            with ca_runtime.disable():
                eager_opt.zero_grad()
                torch.nn.functional.cross_entropy(eager_model(x), y).backward()

            compiled_opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(compiled_model(x), y)
            start = time.perf_counter()
            loss.backward()
            elapsed = time.perf_counter() - start

            match = all(
                torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
                for a, b in zip(eager_model.parameters(), compiled_model.parameters())
            )
            print(
                f"step {step}: loss {loss.item():.4f}  backward {elapsed * 1e3:9.2f} ms  grads match eager: {match}"
            )
            eager_opt.step()
            compiled_opt.step()
            if not match:
                raise SystemExit("gradients differ from eager autograd")

    stats = ca_runtime.stats()
    print(
        f"captures: {stats['captures']}  cache hits: {stats['cache_hits']}  "
        f"graph breaks: {stats['graph_breaks']}  eager fallbacks: {stats['eager_fallbacks']}  "
        f"deferred captures: {stats['deferred_captures']}"
    )


if __name__ == "__main__":
    main()
