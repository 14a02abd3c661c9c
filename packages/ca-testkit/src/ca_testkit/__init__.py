"""ca_testkit: differential runs of compiled autograd against eager autograd."""

from __future__ import annotations

from ca_testkit import scenarios
from ca_testkit.compare import Comparison, TensorDiff, compare
from ca_testkit.distributed import RankError, run_ranks
from ca_testkit.implementations import IMPLEMENTATIONS, Implementation

__all__ = [
    "IMPLEMENTATIONS",
    "Comparison",
    "Implementation",
    "RankError",
    "TensorDiff",
    "compare",
    "run_ranks",
    "scenarios",
]

__version__ = "0.1.0"
