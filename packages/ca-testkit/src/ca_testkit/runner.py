"""What the ``ca_compare`` pytest fixture calls: compare a step, fail readably.

Kept apart from ``plugin.py`` so the plugin stays a thin, lazily importing
shim and this logic can be used without pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ca_testkit.compare import Comparison, Tensors, compare
from ca_testkit.implementations import get_implementation

__all__ = ["CompareRunner", "ComparisonFailed"]


class ComparisonFailed(AssertionError):
    """A compiled run differed from eager; the message is the per-value report."""


@dataclass
class CompareRunner:
    """Runs a step eagerly and under each configured implementation.

    ``backend`` is a torch.compile backend name or a compiler_fn; ``impls``
    the implementations to check (``"ca"``, ``"torch"``).
    """

    backend: Any = "aot_eager"
    impls: Sequence[str] = ("ca",)
    steps: int = 1
    rtol: float = 1e-5
    atol: float = 1e-6

    def __post_init__(self) -> None:
        for impl in self.impls:
            get_implementation(impl)

    def __call__(
        self,
        step: Callable[..., Any],
        *,
        tensors: Tensors = (),
        steps: int | None = None,
        max_captures: int | None = None,
    ) -> list[Comparison]:
        """Compares ``step`` for every implementation; raises ComparisonFailed with all reports."""
        results = [
            compare(
                step,
                self.backend,
                tensors=tensors,
                steps=self.steps if steps is None else steps,
                rtol=self.rtol,
                atol=self.atol,
                impl=impl,
            )
            for impl in self.impls
        ]
        headlines = [r.summary() for r in results if not r.ok]
        problems = [r.report() for r in results if not r.ok]
        if max_captures is not None:
            too_many = [
                f"[{r.impl}] {r.stats['captures']} captures, expected at most {max_captures}"
                for r in results
                if r.stats.get("captures", 0) > max_captures
            ]
            headlines += too_many
            problems += too_many
        if problems:
            # The first line says what failed; the per-value report follows.
            raise ComparisonFailed(
                "compiled autograd differs from eager: " + "; ".join(headlines) + "\n" + "\n".join(problems)
            )
        return results


def parse_impls(value: str) -> tuple[str, ...]:
    """``"ca"``, ``"torch"``, ``"both"`` or a comma-separated list."""
    names = ("ca", "torch") if value == "both" else tuple(v.strip() for v in value.split(","))
    for name in names:
        get_implementation(name)
    return names
