"""Small, deterministic training scenarios shared by tests, examples and benches."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, cast

import torch

__all__ = ["Cube", "Decoder", "batch", "make_mlp", "mlp_step", "slowed_compiler"]


def make_mlp(seed: int = 0, sizes: tuple[int, ...] = (8, 16, 4)) -> torch.nn.Sequential:
    """Linear-ReLU-...-Linear with weights from ``seed``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(n_in, n_out))
    return torch.nn.Sequential(*layers)


def batch(i: int, n: int = 6, features: int = 8, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class targets of step ``i`` (new data every step, reproducible)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def mlp_step(model: torch.nn.Module, n: int = 6) -> Callable[[int], torch.Tensor]:
    """A training step: zero grads, cross-entropy on ``batch(i)``, backward; returns the loss."""
    first = next(model.parameters())
    features = first.shape[1]
    classes = [p for p in model.parameters()][-1].shape[0]

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x, y = batch(i, n, features, classes)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return step


class Cube(torch.autograd.Function):
    """``x**3`` as a Python Function that saves its input: a custom backward in the graph."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a**3

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return 3 * a * a * grad


def slowed_compiler(backend: str, seconds: float) -> Callable[[torch.fx.GraphModule], Any]:
    """A compiler_fn: ``torch.compile(gm, backend=backend)``, each call of which first sleeps ``seconds``.

    Makes a compiled graph reliably slower than the eager engine (see
    ``enable(eager_if_faster=...)``). Keep the returned object alive while
    its entries are inspected: a callable's cache goes with it.
    """

    def compiler_fn(gm: torch.fx.GraphModule) -> Any:
        compiled = torch.compile(gm, backend=backend)

        def run(*args: Any) -> Any:
            time.sleep(seconds)
            return compiled(*args)

        return run

    return compiler_fn


class Decoder(torch.nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm causal blocks, tied head."""

    def __init__(
        self, vocab: int = 512, d: int = 256, heads: int = 4, layers: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "ln1": torch.nn.LayerNorm(d),
                    "qkv": torch.nn.Linear(d, 3 * d),
                    "proj": torch.nn.Linear(d, d),
                    "ln2": torch.nn.LayerNorm(d),
                    "up": torch.nn.Linear(d, 4 * d),
                    "down": torch.nn.Linear(4 * d, d),
                }
            )
            for _ in range(layers)
        )
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        h = self.embed(tokens) + self.pos[:s]
        for block in self.blocks:
            blk = cast(torch.nn.ModuleDict, block)
            q, k, v = blk["qkv"](blk["ln1"](h)).view(b, s, 3, self.heads, -1).unbind(2)
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            h = h + blk["proj"](att.transpose(1, 2).reshape(b, s, -1))
            h = h + blk["down"](torch.nn.functional.gelu(blk["up"](blk["ln2"](h))))
        logits = self.ln(h) @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
