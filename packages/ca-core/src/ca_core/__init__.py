"""ca_core: the C++ half of compiled autograd (engine hook, graph walk,
shadow-graph cache, saved-variable swapping, functional registry).

This module is the only place that imports the extension. ca_core is
ABI-bound to the exact torch it was built against; importing it next to any
other torch fails here with a message that says what to do.
"""

from __future__ import annotations

import importlib.metadata

import torch  # loads libtorch before the extension needs its symbols

__all__ = [
    "TORCH_VERSION",
    "BackwardGraph",
    "CacheTreeNode",
    "CapturedGraph",
    "EagerIfFasterChoice",
    "FunctionInfo",
    "NodeInfo",
    "NodeRunStep",
    "TensorPreHookInfo",
    "TensorPreHookKind",
    "ZerosSpec",
    "accumulate_grad_now",
    "apply_node",
    "apply_nodes",
    "apply_with_saved",
    "bound_functionals",
    "cache_tree",
    "call_cpp_tensor_pre_hook",
    "call_opaque_tensor_pre_hook",
    "clear_cache",
    "clear_failed",
    "counters",
    "drop_cache_root",
    "install_engine_hook",
    "installed_runtime",
    "live_node_run_plans",
    "plan_node_run",
    "probe_traceable",
    "rearm_engine_hook",
    "release_node_run_plans",
    "reset_counters",
    "running_graph_hook",
    "set_timing",
    "timings",
    "uninstall_engine_hook",
    "validate_outputs",
]

__version__ = importlib.metadata.version("ca-core")  # from pyproject.toml, its one source


def _check_torch(built_for: str) -> None:
    running = torch.__version__
    if running.split("+")[0] != built_for.split("+")[0]:
        raise ImportError(
            f"ca_core was built against torch {built_for} but torch {running} is "
            "installed. ca_core uses torch's C++ ABI, so the two must match exactly: "
            f"install torch=={built_for.split('+')[0]}, or rebuild ca_core against "
            "this torch with `pip install --no-build-isolation --force-reinstall "
            "packages/ca-core`."
        )


def _torch_requirement() -> str:
    """The exact torch this ca-core release pins (its package metadata, from pyproject.toml)."""
    for requirement in importlib.metadata.requires("ca-core") or ():
        if requirement.replace(" ", "").startswith("torch=="):
            return requirement.replace(" ", "")
    return "the torch version ca-core pins"


try:
    from ca_core import _C
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ca_core's extension failed to load ({e}). It is built against torch's C++ "
        f"ABI; torch {torch.__version__} is installed. Reinstall ca_core with "
        "`pip install --no-build-isolation packages/ca-core` after installing "
        f"{_torch_requirement()}."
    ) from e

_check_torch(_C.TORCH_VERSION)

from ca_core._C import (  # noqa: E402
    TORCH_VERSION,
    BackwardGraph,
    CacheTreeNode,
    CapturedGraph,
    EagerIfFasterChoice,
    FunctionInfo,
    NodeInfo,
    NodeRunStep,
    TensorPreHookInfo,
    TensorPreHookKind,
    ZerosSpec,
    accumulate_grad_now,
    apply_node,
    apply_nodes,
    apply_with_saved,
    bound_functionals,
    cache_tree,
    call_cpp_tensor_pre_hook,
    call_opaque_tensor_pre_hook,
    clear_cache,
    clear_failed,
    counters,
    drop_cache_root,
    install_engine_hook,
    installed_runtime,
    live_node_run_plans,
    plan_node_run,
    probe_traceable,
    rearm_engine_hook,
    release_node_run_plans,
    reset_counters,
    running_graph_hook,
    set_timing,
    timings,
    uninstall_engine_hook,
    validate_outputs,
)
