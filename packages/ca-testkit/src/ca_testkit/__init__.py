"""ca_testkit: differential runs of compiled autograd against eager autograd.

The package imports nothing heavy itself: torch, ca_runtime and the C++
extension load on first use of a name below (PEP 562), so the pytest plugin
(``ca_testkit.plugin``, loaded by every pytest run where ca-testkit is
installed) costs nothing to suites that never ask for its fixtures.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

__version__ = importlib.metadata.version("ca-testkit")  # from pyproject.toml, its one source

#: Public name -> the submodule that defines it.
_HOMES = {
    "IMPLEMENTATIONS": "implementations",
    "Implementation": "implementations",
    "Comparison": "compare",
    "TensorDiff": "compare",
    "compare": "compare",
    "RankError": "distributed",
    "run_ranks": "distributed",
}


def __getattr__(name: str) -> Any:
    if name == "scenarios":
        return importlib.import_module("ca_testkit.scenarios")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ca_testkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ca_testkit.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
