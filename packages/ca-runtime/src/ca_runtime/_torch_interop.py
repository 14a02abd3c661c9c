"""Every private torch API the Python side uses, in one audited place.

Checked against torch 2.13.0 (the version ca-core pins); each has a smoke test
in tests/test_torch_interop.py, so a torch upgrade that moves one fails there,
by name. An AST scan there fails when another module of ca_runtime names a
private torch attribute or module (except _aot.py, item 6). The C++ side's
list is ca_core's csrc/torch_private.h.

Used through this module:
  1. ``torch._dynamo.compiled_autograd._disable``: wrapped once per process;
     see [Note: torch clears the engine slot] below.
  2. ``torch._dynamo.compiled_autograd.compiled_autograd_enabled`` and
     ``torch._C._dynamo.compiled_autograd.set_autograd_compiler``: whether
     torch's built-in compiled autograd is on, and re-arming it (see
     [Note: Restoring the engine hook] in _enable.py).
  3. ``torch._dynamo.external_utils.FakeBackwardCFunction``: the ctx a
     Python Function's backward gets in a graph (its ``saved_tensors`` are
     the lifted ones); Dynamo inlines a backward only when handed exactly
     this type. ``call_backward`` below replaces torch's helper of that name;
     see [Note: ctx writes in a backward]. Registered as a virtual subclass
     of ``torch.autograd.graph.Node``; see [Note: The ctx a backward sees is a Node].
     Its ``__delattr__``, ``__hash__`` and ``__eq__`` are set to act on the
     real ctx; see [Note: The ctx a backward sees is the real one to the user].
  4. ``torch._dynamo.trace_rules.lookup`` and ``SkipFunctionVariable``:
     whether Dynamo would inline a hook (``dynamo_skips``).
  5. ``torch._dynamo.utils.set_locals_to_steal``: lets Dynamo take over the
     graph's ``inputs`` list and free each saved tensor after its last use
     (see [Note: Saved tensors freed early] in ca_core); and
     ``flatten_graph_inputs`` (with ``GmWrapper``), which Inductor's
     ``compile_fx`` and AOTAutograd's backends (``torch._dynamo.backends.common``)
     call for such a graph, replaced in both by one without pytree for it;
     see [Note: A stolen list flattened without pytree].
  7. ``torch._dynamo.callback.callback_handler``: Dynamo's compile start/end
     callbacks; see [Note: Warnings while Dynamo traces].
  8. Non-reentrant ``torch.utils.checkpoint``'s internals: its unpack hooks'
     code objects and their ``frame`` closure cell (the region's
     ``_CheckpointFrame``), the frame's ``saved_args`` (``SavedTensor.unpack_hook``), ``weak_holders`` and ``x_metadatas``
     (shape, dtype and device of each saved tensor, recorded at pack time by
     ``_default_meta_extractor``); see [Note: Checkpoint regions in the graph]
     in _checkpoint.py.
  9. ``torch.fx.graph_module._loader`` (``next_id``, ``eval_cache``): FX
     keeps the source of every GraphModule it generates, and a linecache
     entry for it, for the life of the process; see [Note: Sources of our
     graphs].
  10. ``torch._dynamo.eval_frame._TorchDynamoContext`` and
     ``innermost_backend``: the backend a ``torch.compile`` context compiles
     with, so that the context ``torch._dynamo.config.compiled_autograd``
     makes anew on every call keys one cache (see [Note: Compilers made
     anew] in _compiler_key.py); with ``torch._dynamo.lookup_backend``, and
     the ``compiler_fn`` of the wrapper ``torch.compile`` puts around a
     backend, whether that backend is Dynamo's ``"eager"`` (see [Note:
     create_graph=True graphs stay differentiable] in _runtime.py).
  11. ``torch._dynamo.compiled_autograd._enable``, ``active_disable_ctx`` and
     Dynamo's compile stance: replaced by ``replace_torch()``; see [Note:
     Running torch's entry points on ca] in _enable.py.
  12. ``torch._logging._internal``: ``register_log`` (``torch._logging.set_logs(ca=...)``)
     and ``log_state.is_artifact_enabled`` (``TORCH_LOGS=compiled_autograd``);
     see _log.py.
  13. Dynamo's per-code state: ``_debug_get_cache_entry_list``,
     ``eval_frame.remove_from_cache``, ``CheckFunctionManager.invalidate``
     finalizers in ``weakref.finalize._registry``, ``pgo._CODE_STATE``,
     ``bytecode_transformation._cached_cleaned_instructions``,
     ``guards.code_framelocals_names_reversed_cached``,
     ``eval_frame.cached_backends`` and the ``seen`` lists of
     ``convert_frame.input_codes``/``output_codes``; see [Note: What Dynamo keeps of a
     dropped graph].
  14. ``torch._dynamo.variables.builtin.SetAttrBuiltinVariable.call_function``:
     wrapped so that a traced ``setattr(...)`` is None; see [Note: setattr is
     None in a trace].
  15. ``ShapeEnv.tracked_fakes`` and ``torch._dynamo.convert_frame.compile_lock``:
     cleared once a first run's compiles are done; see [Note: Fakes a
     finished compile still tracks].
  16. ``torch._dynamo.utils.get_metrics_context()`` and its ``_edits``: the
     stacks Dynamo records of each compile's metrics, let go of once no
     compile is in progress on the thread; see [Note: Stacks Dynamo's metrics
     keep].
  17. The ``compile_id`` Dynamo sets on an exception of a failed compile
     (``exc.get_exc_message``) and the ``compile_id.frame_id`` of a code's
     cache entries: which frame's compile failed; see [Note: A recompile
     that fails on a hit] in _dynamo_direct.py.
  18. ``torch._dynamo.config.suppress_errors``, read by Dynamo's
     ``ConvertFrame`` when a compile fails, ``torch._dynamo.pgo.FrameStateSizeEntry.is_stride_dynamic``
     (automatic dynamic's one reading of a stride, wrapped by ours, which
     answers False on a thread that asks for static strides),
     ``CompileContext.current_compile_id()`` in a compile start callback
     (item 7), and the ``torch._dynamo.convert_frame`` logger's record of a
     suppressed error: a frame after the graph's own keeps static strides
     and, when it fails to compile, runs uncompiled; see [Note: A later
     frame that fails to compile] and [Note: Later frames keep static
     strides] in _dynamo_direct.py.
  19. ``torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)``
     and ``torch._subclasses.FakeTensor``: whether a node's apply runs while
     Dynamo or AOTAutograd trace (``on_fake_tensors``); see [Note: User
     errors are tagged] in _graph_ops.py.
  20. ``torch._functorch.autograd_function.vmapify_autograd_function``: the
     Function class ``torch.func.vmap`` generates for a Function with
     ``generate_vmap_rule=True`` (``is_generated_vmap_rule``), whose
     backward wraps its ctx in ``CtxWithSavedTensors``, which Dynamo refuses
     (it asserts a ``FakeBackwardCFunction``); see _capture.py's
     ``_FUNCTIONS_RUN_EAGERLY``.
  21. Inductor's compile entry points, for the background compiler
     (``BackgroundInductor`` in _background.py): ``torch._TorchCompileInductorWrapper``,
     the backend ``torch.compile`` wraps Inductor in, which ``BackgroundInductor``
     subclasses (its ``config`` and ``name``, and its ``__call__`` for options);
     ``torch._inductor.compile_fx.compile_fx``, called with an
     ``inner_compile`` of ours, and ``compile_fx_inner``, looked up at each
     call; and what sends a graph's compile to the calling thread:
     ``torch._inductor.config.distributed_max_autotune_gemm`` and AOTAutograd's
     ``should_bundle_autograd_cache()``. See [Note: Compiling in the background].
  22. The compile state the background compile thread takes over
     (_background.py): Dynamo's ``GlobalStateGuard`` of torch's process-global
     flags, taken at capture and checked on the thread (see [Note: State at
     capture time]); ``torch._guards``' ``TracingContext`` and
     ``CompileContext`` of the capture, re-entered there with
     ``compile_context``/``tracing`` as AOTAutograd's lazy backward compile
     does; Dynamo's ``convert_frame.compile_lock``, held for the whole compile
     (see [Note: One Inductor compile at a time]); and
     ``torch._C._DisableAutocast``, autocast off as in Dynamo's own compiles.
  23. Dynamo's cache entries of a code (``_debug_get_cache_entry_list``, an
     entry's ``backend``, ``guard_manager.check``, ``code`` and
     ``compile_id``), the backend they are stored with
     (``innermost_backend`` of an ``OptimizedModule``'s context callback)
     and how many a code may have (``torch._dynamo.config.recompile_limit``):
     ``DirectDynamoCall`` looks a graph up as Dynamo's lookup does; see
     [Note: Calling Dynamo's cached code directly] in _dynamo_direct.py.
  24. What Dynamo's wrappers around an ``OptimizedModule`` call do, which a
     direct call may skip only when they would do nothing else (same Note):
     the compile stance (``eval_frame._stance``), the thread's eval-frame
     callback, global ``nn.Module`` hooks (``_has_any_global_hook``) and a
     module's own hook dicts, ``torch._C._is_tracing``,
     ``torch.fx._symbolic_trace.is_fx_symbolic_tracing``,
     ``TracingContext.try_get``, the types ``OptimizedModule`` and
     ``OptimizeContext`` (``_orig_mod``, ``enter_exit_hooks``, among them
     ``eval_frame.call_on_enter``), ``GenerationTracker.generation``, which
     that hook bumps, and ``torch.autograd.profiler._is_profiler_enabled``.
  25. The dispatch-key TLS (``torch._C._dispatch_tls_local_exclude_set``,
     ``_dispatch_tls_local_include_set`` and ``_ForceDispatchKeyGuard``): the
     checkpoint recompute puts eager's excluded keys back inside an
     AOTAutograd backward; see [Note: Recomputing with autograd on] in
     _checkpoint.py.
  26. ``torch._C._get_privateuse1_backend_name``: the device type of the
     PrivateUse1 backend, one of the device types a checkpoint region's
     recorded tensors may be on (_checkpoint.py's ``_DEVICE_TYPES``).
  27. C++ reference counts, of a tensor (``Tensor._use_count``) and of a
     storage (``torch._C._storage_Use_Count`` of ``UntypedStorage._cdata``):
     which recomputed tensors nothing else holds; see [Note: Checkpoint
     regions in the graph] (outputs are fresh) in _checkpoint.py.
  28. Inductor's configuration module ``torch._inductor.config`` (its
     ``_is_default`` and ``_make_closure_patcher``), which torch's docs
     name as the place of Inductor's options: the options set around a
     captured backward's compile (``inductor_config``); see [Note: Inductor
     options for backward graphs] in _runtime.py. And
     ``torch._inductor.custom_graph_pass`` (``CustomGraphPass``,
     ``get_hash_for_files``), the documented base of a post-grad pass that
     Inductor's cache can key (_inductor_passes.py).
  29. ``torch._dynamo.maybe_mark_dynamic`` (documented with torch.compile's
     dynamic shapes): a first run marks the sizes and tensor dims that
     changed dynamic (``maybe_mark_dynamic``); see [Note: Dynamic sizes] in
     ca_core.
  30. Retired: whether a backward runs inside a vmap or another functorch
     transform is ca_core's reading (``BackwardGraph.inside_a_vmap``, the
     bit the root's key holds; see [Note: Backwards inside a vmap] in
     ca_core), not a second one here.
  31. Inductor's buffer reuse in the code it generates: the method that
     decides one (``torch._inductor.codegen.wrapper.AllocateLine.should_reuse_buffer``,
     wrapped once per process so that a rule of ours decides for our graphs),
     the free and allocation lines' ``scheduler_node_index``, the wrapper's
     ``estimate_peak`` (Inductor's estimated level per scheduler node, a
     ``SegmentedTree`` queried with ``summarize_range``), ``V.graph``'s
     ``scheduler.nodes`` and ``graph_inputs``, and
     ``torch._inductor.memory.get_freeable_input_buf`` (each input's readers
     and bytes); see [Note: Buffer reuse that keeps the peak] in
     _inductor_buffer_reuse.py.
  32. ``torch._functorch.autograd_function.vmapify_autograd_function`` (the
     Function class ``torch.func.vmap`` generates for a Function with
     ``generate_vmap_rule=True``, one per call) and the backward class's
     ``_autograd_function_id`` that ``Function._compiled_autograd_key``
     returns: wrapped once per process so that generated classes of the same
     Function, in_dims, batch size and randomness share one id; see [Note:
     Generated vmap rules share a key] (``stable_generated_vmap_rule_ids``).
Used in place, because they are what the module is about:
  6. AOTAutograd's ``CompiledFunction`` internals in _aot.py (``_aot_id``,
     ``_bw_prologue_fn``, ``metadata``, ``maybe_subclass_metadata``,
     ``boxed_grads_call``, ``ctx._forward_cls``) and
     ``torch._dynamo.compiled_autograd.extract_bw_module``.

[Note: torch clears the engine slot]
AOTAutograd and Inductor compile under
``torch._dynamo.compiled_autograd._disable()``, which empties the engine's
compiled-autograd slot and, on exit, puts back *torch's* prior compiler --
nothing, when torch's compiled autograd is off. Any ``torch.compile`` run inside
``ca_runtime.enable()`` (our own capture, or the user's compiled forward) would
therefore silently switch our hook off for the rest of the context. We wrap
``_disable`` once per process: the slot stays empty inside it (AOTAutograd's
tracing must not reach us), and on exit our hook is re-armed if a ca_runtime
context is still active. ``torch._dynamo.reset()`` empties the slot too
(through ``compiled_autograd.reset()``), and a user may call it inside
``enable()``, between models or after changing a config: ``reset`` is
wrapped the same way.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import functools
import linecache
import logging
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ca_core
import torch
import torch.utils.checkpoint
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, get_eval_frame_callback
from torch._dynamo import eval_frame as _eval_frame
from torch._dynamo import maybe_mark_dynamic
from torch._dynamo.callback import callback_handler as _callback_handler
from torch._dynamo.external_utils import FakeBackwardCFunction
from torch._dynamo.mutation_guard import GenerationTracker
from torch._dynamo.pgo import FrameStateSizeEntry
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.modules.module import _has_any_global_hook

__all__ = [
    "CustomGraphPass",
    "DynamoCompileContexts",
    "FakeBackwardCFunction",
    "InductorReuseCandidate",
    "TorchCompileInductorWrapper",
    "TorchGlobalState",
    "aot_autograd_bundles_its_cache",
    "autocast_disabled",
    "bump_dynamo_generation",
    "call_backward",
    "checkpoint_frame",
    "checkpoint_inputs_have_hooks",
    "checkpoint_saved_index",
    "checkpoint_saved_metadata",
    "clear_finished_tracked_fakes",
    "compiled_frame_id",
    "compiles_with_dynamo_eager",
    "dispatch_keys_excluded_as",
    "dynamo_cache_entries",
    "dynamo_compile_lock",
    "dynamo_context_backend",
    "dynamo_recompile_limit",
    "dynamo_skips",
    "dynamo_wrappers_inert",
    "entered_when_dynamo_compiles",
    "excluded_dispatch_keys",
    "failed_compile_frame_id",
    "forget_metric_stacks",
    "forget_sources_with",
    "get_hash_for_files",
    "inductor_autotunes_across_ranks",
    "inductor_compile_fx",
    "inductor_compile_fx_inner",
    "inductor_config",
    "install_inductor_reuse_rule",
    "is_generated_vmap_rule",
    "is_plain_torch_compile_of",
    "keep_hook_across_torch_disable",
    "later_frames_static_and_uncompiled_on_failure",
    "maybe_mark_dynamic",
    "on_fake_tensors",
    "optimized_module_backend",
    "privateuse1_device_type",
    "profiler_enabled",
    "rearm_torch_compiled_autograd",
    "register_ca_logs",
    "release_dynamo_state",
    "release_dynamo_state_with",
    "routed_torch_compiled_autograd",
    "set_locals_to_steal",
    "sources_made",
    "storage_key",
    "storage_use_count",
    "tensor_use_count",
    "torch_compiled_autograd_enabled",
    "warnings_ignored_while_dynamo_compiles",
]


def keep_hook_across_torch_disable() -> None:
    """1. Installs the ``_disable`` and ``reset`` wrappers of [Note: torch clears the engine slot] (idempotent)."""
    module = torch._dynamo.compiled_autograd
    original: Callable[..., Any] = module._disable
    if not getattr(original, "_ca_rearms", False):

        @functools.wraps(original)
        @contextlib.contextmanager
        def _disable(*args: Any, **kwargs: Any) -> Iterator[None]:
            try:
                with original(*args, **kwargs):
                    yield
            finally:
                ca_core.rearm_engine_hook()

        _disable._ca_rearms = True  # type: ignore[attr-defined]
        module._disable = _disable
    original_reset: Callable[..., Any] = module.reset
    if not getattr(original_reset, "_ca_rearms", False):

        @functools.wraps(original_reset)
        def reset(*args: Any, **kwargs: Any) -> Any:
            try:
                return original_reset(*args, **kwargs)
            finally:
                ca_core.rearm_engine_hook()

        reset._ca_rearms = True  # type: ignore[attr-defined]
        module.reset = reset


def torch_compiled_autograd_enabled() -> bool:
    """2. Whether torch's built-in compiled autograd holds the engine's slot."""
    return bool(getattr(torch._dynamo.compiled_autograd, "compiled_autograd_enabled", False))


def rearm_torch_compiled_autograd() -> None:
    """2. Puts torch's own engine hook back, keeping torch's compiler object."""
    set_compiler = torch._C._dynamo.compiled_autograd.set_autograd_compiler
    prior = set_compiler(None, False)
    set_compiler(*prior)


# [Note: ctx writes in a backward]
# A Function's backward may set attributes on its ctx (``ctx.backward_ran =
# True``), and eager code can read them from ``y.grad_fn`` afterwards. In a
# graph the backward gets a FakeBackwardCFunction, which reads through to the
# real ctx but keeps writes to itself, and torch's ``call_backward`` drops it
# afterwards. Ours copies every attribute the backward set onto the real ctx.
# Dynamo traces the copy as attribute writes to a graph input and replays them
# after the compiled graph; a backward that writes nothing copies nothing.
_FAKE_OWN_ATTRIBUTES = ("real", "saved_tensors")

# [Note: The ctx a backward sees is a Node]
# In eager, a Function's ctx is its BackwardCFunction, an instance of
# torch.autograd.graph.Node (Node's __subclasshook__ says so), and libraries
# check that (isinstance(ctx, Node), then ctx.name(), ctx.next_functions).
# The FakeBackwardCFunction a graph hands the backward reads those through
# to the real ctx but is no Node subclass; registering it as a virtual one
# makes isinstance answer as in eager, for Dynamo's traced check too. It
# changes no behaviour of torch's own: only isinstance/issubclass answers.
torch.autograd.graph.Node.register(FakeBackwardCFunction)


# [Note: The ctx a backward sees is the real one to the user]
# Beyond reads (FakeBackwardCFunction reads through to the real ctx) and
# writes (above), eager code uses its ctx two more ways in a backward:
# ``del ctx.attr`` of what forward set, and the ctx as a key a forward stored
# (a WeakKeyDictionary filled in forward). The fake deletes such attributes
# from the real ctx, and hashes and compares as the real ctx. Set on torch's
# class, which only compiled autograd uses: torch's own compiled autograd gets
# eager's answer there too, instead of AttributeError and KeyError.
def _ctx_delattr(self: Any, name: str) -> None:
    if name in self.__dict__:
        object.__delattr__(self, name)
    else:
        delattr(self.real, name)


def _ctx_hash(self: Any) -> int:
    return hash(self.real)


def _ctx_eq(self: Any, other: object) -> bool:
    return (
        other is self
        or other is self.real
        or (isinstance(other, FakeBackwardCFunction) and other.real is self.real)
    )


FakeBackwardCFunction.__delattr__ = _ctx_delattr  # type: ignore[method-assign]
FakeBackwardCFunction.__hash__ = _ctx_hash  # type: ignore[method-assign]
FakeBackwardCFunction.__eq__ = _ctx_eq  # type: ignore[method-assign]


# [Note: setattr is None in a trace]
# Python's setattr() returns None, but Dynamo's traced setattr on a tensor
# (torch 2.13, SetAttrBuiltinVariable) returns the value set. A hook written
# ``lambda grad_inputs, grad_outputs: setattr(p, "grad", ...)`` then returns a
# tensor in the graph and None in eager, and the graph's check of hook results
# raised eager's "expected tuple" TypeError for a hook eager accepts. The
# wrapper gives the traced call Python's result; what the call records (the
# side effect on the object) is unchanged.
def _setattr_returns_none() -> None:
    from torch._dynamo.variables.builtin import SetAttrBuiltinVariable
    from torch._dynamo.variables.constant import ConstantVariable

    traced = SetAttrBuiltinVariable.call_function
    if getattr(traced, "_ca_returns_none", False):
        return

    @functools.wraps(traced)
    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        traced(self, tx, args, kwargs)
        return ConstantVariable.create(None)

    call_function._ca_returns_none = True  # type: ignore[attr-defined]
    SetAttrBuiltinVariable.call_function = call_function  # type: ignore[method-assign]


_setattr_returns_none()


def call_backward(
    ctx: torch.autograd.function.BackwardCFunction, saved_tensors: list[torch.Tensor | None], *grads: Any
) -> tuple[Any, ...]:
    """3. Runs ``ctx``'s Function backward on ``saved_tensors``; see [Note: ctx writes in a backward]."""
    # A tuple, as eager's ctx.saved_tensors: functorch's generated vmap rule
    # (generate_vmap_rule=True) matches it against a tuple of batch dims.
    fake = FakeBackwardCFunction(ctx, tuple(saved_tensors))  # type: ignore[arg-type]
    # A Function defining vjp (backward's alias) is not called here: it runs
    # behind a graph break (_capture.py's _FUNCTIONS_RUN_EAGERLY).
    try:
        result = fake._forward_cls.backward(fake, *grads)
    finally:
        # What it wrote before raising stays written, as in eager.
        for name, value in fake.__dict__.items():
            if name not in _FAKE_OWN_ATTRIBUTES:
                setattr(ctx, name, value)
    return result if isinstance(result, tuple) else (result,)


def set_locals_to_steal(gm: torch.fx.GraphModule, names: list[str]) -> None:
    """5. Marks the graph's list arguments ``names`` as Dynamo may steal them (free items as it consumes them)."""
    from torch._dynamo.utils import set_locals_to_steal as mark

    _flatten_stolen_list_without_pytree()
    mark(gm, names)


# [Note: A stolen list flattened without pytree]
# Dynamo hands a backend the graph's stolen ``inputs`` list as one list
# argument (it frees the items as the graph consumes them), so Inductor and
# AOTAutograd wrap the compiled graph in ``flatten_graph_inputs``. Outside
# torch's own compiled autograd, whose graphs it recognises by a global flag,
# that wrapper flattens every call's arguments with pytree: about four
# Python calls per tensor, 0.15-0.25 ms of each hit of the bench's LSTM
# backward (441 inputs; bench/LOG.md). For a graph whose first argument is
# the one stolen list and whose every other argument, and every item of the
# list, is a pytree leaf (a tensor, a SymInt/SymFloat/SymBool, an int,
# float or bool), the flat arguments are the list's items followed by the
# rest, which is what the replacement computes, with a list concatenation
# (as torch does for its own graphs). Anything else, any caller's, goes to
# torch's function unchanged. Installed the first time a graph's inputs are
# marked stolen, in both modules that imported the function by name, and
# kept: it changes no result, only how the same flat list is made.
_PYTREE_LEAVES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _first_is_stolen_list_of_leaves(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> bool:
    stolen = [
        i for i, node in enumerate(gm.graph.find_nodes(op="placeholder")) if node.meta.get("steal_arg", False)
    ]
    return (
        stolen == [0]
        and len(inputs) > 0
        and type(inputs[0]) is list
        and all(isinstance(x, _PYTREE_LEAVES) for x in inputs[0])
        and all(isinstance(x, _PYTREE_LEAVES) for x in inputs[1:])
    )


def _flatten_stolen_list_without_pytree() -> None:
    """5. Installs the ``flatten_graph_inputs`` of [Note: A stolen list flattened without pytree] (idempotent)."""
    import torch._dynamo.backends.common as aot_backends
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.compile_fx as inductor_compile

    torch_flatten: Callable[..., Any] = dynamo_utils.flatten_graph_inputs
    if getattr(inductor_compile.flatten_graph_inputs, "_ca_flattens", False):
        return

    @functools.wraps(torch_flatten)
    def flatten_graph_inputs(
        gm: torch.fx.GraphModule, inputs: Sequence[Any], compile_gm: Callable[[Any, Any], Any]
    ) -> Callable[..., Any]:
        if not _first_is_stolen_list_of_leaves(gm, inputs):
            return torch_flatten(gm, inputs, compile_gm)
        count = len(inputs[0])

        def unflatten(flat: list[Any]) -> tuple[Any, ...]:
            return (flat[:count], *flat[count:])

        compiled = compile_gm(dynamo_utils.GmWrapper(gm, unflatten), inputs[0] + list(inputs[1:]))

        def call_flat(*args: Any) -> Any:
            flat = args[0] + list(args[1:])
            args[0].clear()  # the items are the graph's to free now
            return compiled(flat)

        return call_flat

    flatten_graph_inputs._ca_flattens = True  # type: ignore[attr-defined]
    inductor_compile.flatten_graph_inputs = flatten_graph_inputs
    aot_backends.flatten_graph_inputs = flatten_graph_inputs


# [Note: Warnings while Dynamo traces]
# Dynamo and AOTAutograd trace our graph by running every op of it on fake
# tensors, hooks and Function backwards included, so a warning an op raises
# (a C++ TORCH_WARN or torch's Python `warnings.warn`) would be raised once
# per trace and then again when the graph runs: eager raises it once. While
# Dynamo compiles during a first run, an "ignore" filter heads
# ``warnings.filters``. It is inserted and removed in place, without
# ``catch_warnings``: that would bump the filters' version and so reset every
# module's record of the warnings it has shown, and an ignored warning is not
# recorded, so a "default"-filtered warning still shows once when the graph
# runs, and not again. Only the first run of our own graph is covered: the
# user's own torch.compile calls outside it keep their warnings, and so does
# a rare Dynamo recompile during a cache hit. A compile the user's code starts
# inside that first run (a torch.compile'd function called from a hook), and
# another thread's warnings while Dynamo compiles, are ignored too.
@contextlib.contextmanager
def warnings_ignored_while_dynamo_compiles() -> Iterator[None]:
    """7. Inside: warnings raised while Dynamo compiles are dropped; see [Note: Warnings while Dynamo traces]."""
    # A fresh tuple, removed by identity: a user's own equal filter stays.
    ignore_all = ("ignore", None, Warning, None, 0)

    def start(args: Any) -> None:
        filters: list[Any] = warnings.filters  # type: ignore[assignment]
        filters.insert(0, ignore_all)

    def end(args: Any) -> None:
        filters: list[Any] = warnings.filters  # type: ignore[assignment]
        for i, entry in enumerate(filters):
            if entry is ignore_all:
                del filters[i]
                return

    _callback_handler.register_start_callback(start)
    _callback_handler.register_end_callback(end)
    try:
        yield
    finally:
        _callback_handler.remove_start_callback(start)
        _callback_handler.remove_end_callback(end)
        end(None)


class _SuppressedCompileErrors(logging.Filter):
    """18. Takes Dynamo's log record of each suppressed compile error off the log, keeping the error."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__()
        self.errors = errors

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.exc_info is not None:
            error = record.exc_info[1]
            self.errors.append(error if error is not None else RuntimeError(record.getMessage()))
            return False
        return True


#: 18. Whether compiles on this thread infer no dynamic stride; see _is_stride_dynamic_here.
_STATIC_STRIDES: contextvars.ContextVar[bool] = contextvars.ContextVar("ca_static_strides", default=False)
#: torch's own FrameStateSizeEntry.is_stride_dynamic.
_TORCH_IS_STRIDE_DYNAMIC: Callable[[Any, int], bool] = FrameStateSizeEntry.is_stride_dynamic


def _is_stride_dynamic_here(self: Any, dim: int) -> bool:
    """18. ``FrameStateSizeEntry.is_stride_dynamic`` once installed: torch's answer, or False where _STATIC_STRIDES is set.

    Installed on the class the first time a later frame compiles and left
    there: a flag per thread (context variable, as Dynamo's own config), not
    a class attribute swapped for a call, which two threads' calls
    overlapping would leave swapped for good. See [Note: Later frames keep
    static strides] in _dynamo_direct.py.
    """
    if _STATIC_STRIDES.get():
        return False
    return _TORCH_IS_STRIDE_DYNAMIC(self, dim)


def is_generated_vmap_rule(forward_cls: type) -> bool:
    """20. Whether ``forward_cls`` is the Function class ``torch.func.vmap`` generated for ``generate_vmap_rule=True``."""
    forward = getattr(forward_cls, "forward", None)
    return getattr(forward, "__qualname__", "").startswith("vmapify_autograd_function.")


def on_fake_tensors(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether a call with ``tensors`` runs under a fake mode or on fake tensors (item 19)."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    return any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors)


@contextlib.contextmanager
def later_frames_static_and_uncompiled_on_failure(
    own_frame_id: int | None, errors: list[BaseException]
) -> Iterator[None]:
    """18. Inside, on this thread: once Dynamo compiles a frame other than ``own_frame_id``
    (the first frame compiled inside, when None), that compile and later ones
    infer no dynamic stride (sizes go dynamic as Dynamo infers them), and a
    compile that fails runs its frame uncompiled, its error appended to
    ``errors``.

    See [Note: A later frame that fails to compile] and [Note: Later frames
    keep static strides] in _dynamo_direct.py.
    Dynamo reads ``suppress_errors`` after the failed compile's end callbacks
    ran, so it stays set from that compile's start to the context's end.
    """
    # The callback reads nothing through a global torch module: a callback
    # runs as a Python frame, and where Dynamo's frame callback is on (a lazy
    # AOTAutograd backward compiled inside a hook), a frame whose code names
    # torch is compiled, which enters Dynamo's callback lock a second time.
    get_thread = threading.get_ident
    thread = get_thread()
    current_compile_id = torch._guards.CompileContext.current_compile_id
    own = [own_frame_id]
    config: Any = torch._dynamo.config
    logger = logging.getLogger("torch._dynamo.convert_frame")
    frame_state_entry: Any = FrameStateSizeEntry
    is_stride_dynamic_here = _is_stride_dynamic_here
    static_strides = _STATIC_STRIDES
    suppressing: list[tuple[bool, bool, _SuppressedCompileErrors]] = []

    def start(args: Any) -> None:
        if get_thread() != thread or suppressing:
            return
        frame_id = getattr(current_compile_id(), "frame_id", None)
        if own[0] is None:
            own[0] = frame_id
            return
        if frame_id == own[0]:
            return
        log_filter = _SuppressedCompileErrors(errors)
        suppressing.append((config.suppress_errors, static_strides.get(), log_filter))
        config.suppress_errors = True
        # See [Note: Later frames keep static strides].
        if frame_state_entry.is_stride_dynamic is not is_stride_dynamic_here:
            frame_state_entry.is_stride_dynamic = is_stride_dynamic_here
        static_strides.set(True)
        logger.addFilter(log_filter)

    _callback_handler.register_start_callback(start)
    try:
        yield
    finally:
        _callback_handler.remove_start_callback(start)
        for prior_suppress, prior_static_strides, log_filter in suppressing:
            config.suppress_errors = prior_suppress
            static_strides.set(prior_static_strides)
            logger.removeFilter(log_filter)


@torch._dynamo.disable
def _enter_outside_dynamo(
    stack: contextlib.ExitStack, make_context: Callable[[], contextlib.AbstractContextManager[Any]]
) -> None:
    """18. ``make_context()`` entered on ``stack``, with Dynamo's frame callback off; see entered_when_dynamo_compiles."""
    stack.enter_context(make_context())


@contextlib.contextmanager
def entered_when_dynamo_compiles(
    make_context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """18. Inside, on this thread: when Dynamo starts a compile, ``make_context()`` is entered, once, until the end.

    From a compile start callback (item 7), as Dynamo's compile begins and
    before it reads any option; nothing is entered where nothing compiles.
    ``make_context`` runs under ``torch._dynamo.disable``: a start callback
    can run while Dynamo's frame callback is on (see
    later_frames_static_and_uncompiled_on_failure). See [Note: Compiles
    during a hit keep the backward options] in _dynamo_direct.py.
    """
    get_thread = threading.get_ident
    thread = get_thread()
    make_stack = contextlib.ExitStack
    entered: list[contextlib.ExitStack] = []
    enter = _enter_outside_dynamo

    def start(args: Any) -> None:
        if get_thread() != thread or entered:
            return
        entered.append(make_stack())
        enter(entered[0], make_context)

    _callback_handler.register_start_callback(start)
    try:
        yield
    finally:
        _callback_handler.remove_start_callback(start)
        if entered:
            entered[0].close()


def dynamo_skips(hook: object) -> bool:
    """4. Whether Dynamo would skip (not inline) a call of ``hook``, e.g. checkpoint's unpack hook.

    Such a hook is called behind a graph break of ours instead of splitting
    the graph wherever Dynamo meets it; see [Note: Unpack hooks in the graph]
    in ca_core.
    """
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import SkipFunctionVariable

    target: object = hook
    if isinstance(hook, types.MethodType):
        target = hook.__func__
    elif not isinstance(hook, (types.FunctionType, types.BuiltinFunctionType)):
        target = getattr(type(hook), "__call__", hook)  # noqa: B004 - a callable object: Dynamo inlines __call__
    try:
        rule = trace_rules.lookup(target)
    except Exception:  # noqa: BLE001 - a callable Dynamo cannot classify is not inlined either
        return True
    return isinstance(rule, type) and issubclass(rule, SkipFunctionVariable)


#: 8. Code of non-reentrant checkpoint's unpack hooks (plain and with a debug
#: callback), with the index of their ``frame`` closure cell.
_CHECKPOINT_FRAME_CELL: dict[types.CodeType, int] = {
    c: c.co_freevars.index("frame")
    for c in torch.utils.checkpoint._checkpoint_hook.__init__.__code__.co_consts
    if isinstance(c, types.CodeType) and c.co_name.startswith("unpack_hook") and "frame" in c.co_freevars
}


def checkpoint_frame(hook: object) -> tuple[Any, int] | None:
    """8. The region (``_CheckpointFrame``) of a non-reentrant checkpoint unpack hook and its closure cell, else None."""
    cell = _CHECKPOINT_FRAME_CELL.get(getattr(hook, "__code__", None))  # type: ignore[arg-type]
    if cell is None:
        return None
    return hook.__closure__[cell].cell_contents, cell  # type: ignore[attr-defined]


def checkpoint_inputs_have_hooks(frame: Any) -> bool:
    """8. Whether the region's inputs (the frame's ``saved_args``) were packed by saved_tensors_hooks not checkpoint's.

    An enclosing region's own hooks (a nested checkpoint) do not count.
    """
    saved_tensor = torch._C._autograd.SavedTensor
    for arg in getattr(frame, "saved_args", ()):
        unpack = getattr(arg, "unpack_hook", None) if isinstance(arg, saved_tensor) else None
        if unpack is not None and checkpoint_frame(unpack) is None:
            return True
    return False


def checkpoint_saved_index(frame: Any, packed: object) -> int | None:
    """8. Where ``packed`` (a ``_Holder``) is in ``frame.x_metadatas``; None if the frame records no metadata.

    ``x_metadatas`` is one-to-one with ``weak_holders`` when the frame's
    ``metadata_fn`` is checkpoint's default (``determinism_check="default"``).
    """
    if frame.metadata_fn is not torch.utils.checkpoint._allowed_determinism_checks_to_fns["default"]:
        return None
    if len(frame.x_metadatas) != len(frame.weak_holders):
        return None
    for index, weak in enumerate(frame.weak_holders):
        if weak() is packed:
            return index
    return None


def checkpoint_saved_metadata(hook: Any, cell: int, index: int) -> dict[str, Any] | None:
    """8. Shape, dtype and device of saved tensor ``index`` of ``hook``'s region, as recorded at pack time.

    None when the region's checkpoint records nothing (``determinism_check="none"``).

    Plain attribute reads, so that Dynamo inlines them and guards on the
    values (a new shape recompiles); see [Note: Checkpoint regions in the graph].
    """
    metadata: dict[str, Any] | None = hook.__closure__[cell].cell_contents.x_metadatas[index]
    return metadata


# [Note: Sources of our graphs]
# Every GraphModule's recompile() stores its generated source in torch.fx's
# eval cache and registers it with linecache, under a key
# "<eval_with_key>.N", and nothing ever removes it: about 60 KB per capture of
# a 300-node backward (two modules: the captured graph and its fused form),
# which reset() could not give back. The capture notes the keys made while it
# builds and compiles (sources_made) and drops them when the graph module the
# compiled callable runs dies (forget_sources_with): a dict pop each, safe
# from a finalizer. Only tracebacks through a dead graph read those sources.
# A lazy compiler (torch.compile) makes Dynamo's graph modules during the
# graph's first run: those keys are noted there and dropped with the
# compiled callable (with them, those of any FX module another thread or a
# hook's own torch.compile made in that window: their tracebacks show no
# source line then).


@contextlib.contextmanager
def sources_made() -> Iterator[list[str]]:
    """9. The keys of the FX sources generated inside the context (filled in on exit)."""
    loader = torch.fx.graph_module._loader
    first = loader.next_id
    keys: list[str] = []
    try:
        yield keys
    finally:
        made = {f"<eval_with_key>.{n}" for n in range(first, loader.next_id)}
        if made:
            keys.extend(k for k in list(loader.eval_cache) if k.split(" ", 1)[0] in made)


def _forget_sources(keys: list[str]) -> None:
    eval_cache = torch.fx.graph_module._loader.eval_cache
    for key in keys:
        eval_cache.pop(key, None)
        linecache.cache.pop(key, None)


def forget_sources_with(owner: object, keys: list[str]) -> None:
    """9. Drops ``keys`` from FX's eval cache and linecache when ``owner`` dies."""
    if keys:
        with contextlib.suppress(TypeError):  # not weakly referenceable: they stay
            weakref.finalize(owner, _forget_sources, keys).atexit = False


# [Note: What Dynamo keeps of a dropped graph]
# torch.compile of a captured graph leaves state keyed by the graph's forward
# code that neither reset() nor torch._dynamo.reset() frees, about 3 MB a
# capture with backend "eager" (its FakeTensors, ShapeEnv, guard tree and
# output GraphModule): utils.orig_code_map maps the transformed code to the
# graph's code strongly, and the graph's code holds its cache entries, which
# hold the transformed code (a cycle through C++ that gc cannot see); and each
# CheckFunctionManager is kept by a weakref.finalize on every object its
# guards match by id or type, here `list`, `tuple` and a function of
# _graph_ops, which never die. When the callable a capture compiled is let go
# (reset(), a compiler's cache dropped), release_dynamo_state frees that code's
# cache entries, detaches those finalizers and drops its PGO state. Three
# process-wide caches hold the code itself, and with it its constants: the
# lru_caches of cleaned instructions and of frame-local names (the second
# unbounded: every code Dynamo ever guarded, kept even by
# torch._dynamo.reset()), cleared whole; and the weakrefs of
# convert_frame.input_codes/output_codes, which outlive their codes and are
# pruned. Two more are released elsewhere: ShapeEnv.tracked_fakes (see [Note:
# Fakes a finished compile still tracks]) and the stacks of Dynamo's metrics
# (see [Note: Stacks Dynamo's metrics keep]). With all of them, RSS stays flat
# over capture/reset() cycles with backend "eager" (bench/LOG.md).


def _guard_finalizers(managers: list[Any]) -> list[weakref.finalize]:
    from torch._dynamo.guards import CheckFunctionManager

    found = []
    # A copy in one C call: iterating the registry itself allocates, a
    # collection may run other finalizers, and they change it.
    registry = weakref.finalize._registry.copy()  # type: ignore[attr-defined]
    for finalizer, info in registry.items():
        func = info.func
        bound = getattr(func, "func", None)
        if (
            isinstance(func, functools.partial)
            and getattr(bound, "__func__", None) is CheckFunctionManager.invalidate
            and any(getattr(bound.__self__, "guard_manager", None) is m for m in managers)  # type: ignore[union-attr]
        ):
            found.append(finalizer)
    return found


def release_dynamo_state(code: types.CodeType, wrapper: object | None = None) -> None:
    """13. Frees what Dynamo keeps for ``code`` (and ``wrapper``); see [Note: What Dynamo keeps of a dropped graph].

    Run from a finalizer, at any allocation: best effort, it never raises
    (what it cannot free stays as it was).
    """
    # A finalizer must not raise; nothing is lost but memory.
    with contextlib.suppress(Exception):
        _release_dynamo_state(code)
    if wrapper is not None:
        cached = torch._dynamo.eval_frame.cached_backends
        if cached.get(id(wrapper)) is wrapper:
            cached.pop(id(wrapper), None)


def _release_dynamo_state(code: types.CodeType) -> None:
    managers = [entry.guard_manager for entry in _debug_get_cache_entry_list(code)]
    if managers:
        for finalizer in _guard_finalizers(managers):
            finalizer.detach()
        torch._dynamo.eval_frame.remove_from_cache(code)
    pgo = torch._dynamo.pgo
    if pgo._CODE_STATE is not None:
        pgo._CODE_STATE.pop(pgo.CodeId.make(code), None)
    # An lru_cache of 128 codes: no single entry can go, and what the others
    # lose is recomputed at their next compile (a fraction of a Dynamo trace).
    torch._dynamo.bytecode_transformation._cached_cleaned_instructions.cache_clear()
    # An unbounded functools.cache keyed by every code Dynamo built guards
    # for, which keeps each graph's code (and its constants) for the process:
    # cleared whole, as above (a list of local names, recomputed per code).
    torch._dynamo.guards.code_framelocals_names_reversed_cached.cache_clear()
    # Two weakrefs (and their callbacks) per compile that outlive their codes;
    # the ones whose codes died are dropped (this graph's, at the next release).
    convert_frame = torch._dynamo.convert_frame
    for tracker in (convert_frame.input_codes, convert_frame.output_codes):
        tracker.seen[:] = [ref for ref in tracker.seen if ref() is not None]


# [Note: Fakes a finished compile still tracks]
# Each Dynamo compile makes a ShapeEnv whose ``tracked_fakes`` lists the fake
# tensors it made for the graph's inputs; Dynamo reads it once, to build the
# guards, and keeps it (torch only clears it when a compile fails). Fakes of
# tensors that require grad carry an autograd graph that leads back to the
# fake mode, and so to the ShapeEnv: a cycle through C++ that gc cannot see,
# about 1.5 MB a capture with backend "eager" that nothing ever frees (a
# plain torch.compile of a function whose inputs are non-leaves that require
# grad keeps one too). After a captured graph's first run, the ShapeEnvs that
# run made are done with it (their compiles returned), so their lists are
# cleared and the collection that follows frees them. Only when no compile is
# under way anywhere (Dynamo's compile_lock is free: a background compile or
# another thread's torch.compile may still read theirs) and only among the
# objects the run made (see [Note: Dynamo's tracing cycles] in _runtime.py).
def clear_finished_tracked_fakes(objects: list[Any]) -> None:
    """15. Clears ``tracked_fakes`` of the ShapeEnvs among ``objects``; see [Note: Fakes a finished compile still tracks]."""
    from torch._dynamo.convert_frame import compile_lock
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not compile_lock.acquire(blocking=False):
        return
    try:
        for obj in objects:
            if type(obj) is ShapeEnv and obj.tracked_fakes:
                obj.tracked_fakes.clear()
    finally:
        compile_lock.release()


# [Note: Stacks Dynamo's metrics keep]
# Each thread's MetricsContext (torch._dynamo.utils.get_metrics_context())
# records a CapturedTraceback for every metric a compile sets, to name the
# earlier setter when a metric is set twice in one compile. torch never
# clears that list: it starts each compile's metrics afresh but keeps every
# compile's stacks for the life of the thread, and a CapturedTraceback holds
# the code objects of its frames from C++, where gc cannot see them. Among
# them is our graph's forward code (with its constants and names), so about
# 30 KB a capture stayed after reset() with a Dynamo backend. Once no compile
# is in progress on this thread, no later set() can be compared with them:
# they are dropped after each first run. Background compiles run on threads
# of their own, whose contexts die with them.
def forget_metric_stacks() -> None:
    """16. Drops the stacks this thread's finished compiles left; see [Note: Stacks Dynamo's metrics keep]."""
    context = torch._dynamo.utils.get_metrics_context()
    if not context.in_progress():
        context._edits.clear()


def compiled_frame_id(code: types.CodeType) -> int | None:
    """17. Dynamo's frame id of ``code`` (from its newest cache entry), or None if it has none."""
    entries = _debug_get_cache_entry_list(code)
    compile_id = entries[0].compile_id if entries else None
    return getattr(compile_id, "frame_id", None)


def failed_compile_frame_id(error: BaseException) -> int | None:
    """17. The frame id of the Dynamo compile that raised ``error``, or None if Dynamo did not say."""
    return getattr(getattr(error, "compile_id", None), "frame_id", None)


def release_dynamo_state_with(owner: object, code: types.CodeType, compiled: object) -> None:
    """13. ``release_dynamo_state(code)`` when ``owner`` (the compiled callable ca_core holds) dies.

    When ``compiled`` (what the compiler_fn returned) is a ``torch.compile``
    result, its backend wrapper (made anew by each call) stays in
    ``eval_frame.cached_backends`` until ``torch._dynamo.reset()``; it is
    dropped with the rest.
    """
    wrapper = _compile_wrapper_of(compiled)
    with contextlib.suppress(TypeError):  # not weakly referenceable: nothing to hook
        weakref.finalize(owner, release_dynamo_state, code, wrapper).atexit = False


def _compile_wrapper_of(compiled: object) -> object | None:
    """The backend wrapper ``torch.compile`` made for ``compiled`` (one per call), if it is one."""
    found = dynamo_context_backend(getattr(compiled, "dynamo_ctx", compiled))  # an OptimizedModule's context
    wrapper = found[0] if found else None
    wrapper_types = (torch._TorchCompileWrapper, torch._TorchCompileInductorWrapper)
    return wrapper if isinstance(wrapper, wrapper_types) else None


def dynamo_context_backend(obj: object) -> tuple[object, object] | None:
    """10. ``(backend, dynamic)`` of a ``torch.compile``/``torch._dynamo.optimize`` context, else None."""
    eval_frame = torch._dynamo.eval_frame
    if not isinstance(obj, eval_frame._TorchDynamoContext):
        return None
    return eval_frame.innermost_backend(obj.callback), getattr(obj, "_dynamic", None)  # type: ignore[arg-type]


def compiles_with_dynamo_eager(compiled: object) -> bool | None:
    """10. Whether a ``torch.compile`` result compiles with Dynamo's ``"eager"`` backend; None if not one.

    By the backend function ``torch.compile`` resolved (``lookup_backend``),
    so that a backend of the user's own named ``eager`` is not taken for it.
    """
    found = dynamo_context_backend(getattr(compiled, "dynamo_ctx", compiled))
    if found is None:
        return None
    backend = getattr(found[0], "compiler_fn", found[0])  # inside torch.compile's wrapper
    return backend is torch._dynamo.lookup_backend("eager")


@contextlib.contextmanager
def routed_torch_compiled_autograd(
    enable: Callable[[Any], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """11. ``torch._dynamo.compiled_autograd._enable`` routed to ``enable(compiler_fn)`` inside the context.

    torch's own checks stay: an active ``_disable()`` wins where torch's
    caller asks for it (``ignore_active_disable_ctx=False``, as the
    ``config.compiled_autograd`` path does) and the ``"force_eager"`` stance
    runs backwards eagerly. ``dynamic`` is torch's capture option; ca decides
    dynamic sizes itself (see [Note: Dynamic sizes] in ca_core).
    """
    module = torch._dynamo.compiled_autograd
    replaced = module._enable

    @contextlib.contextmanager
    def _enable(
        compiler_fn: Callable[..., Any], dynamic: bool = True, ignore_active_disable_ctx: bool = True
    ) -> Iterator[None]:
        del dynamic
        eager = (not ignore_active_disable_ctx and module.active_disable_ctx) or (
            torch._dynamo.eval_frame._stance.stance == "force_eager"
        )
        with contextlib.nullcontext() if eager else enable(compiler_fn):
            yield

    module._enable = _enable
    try:
        yield
    finally:
        module._enable = replaced


def register_ca_logs() -> tuple[bool, bool]:
    """12. Registers the ``ca`` log with torch; returns whether TORCH_LOGS asks for compiled_autograd(_verbose)."""
    internal = torch._logging._internal
    internal.register_log("ca", "ca_runtime")
    state = internal.log_state
    return state.is_artifact_enabled("compiled_autograd"), state.is_artifact_enabled(
        "compiled_autograd_verbose"
    )


#: 21. The backend ``torch.compile(backend="inductor")`` wraps Inductor in
#: (its ``config``: the options given; its ``name``: the compiled region's);
#: see [Note: Compiling in the background] in _background.py.
TorchCompileInductorWrapper = torch._TorchCompileInductorWrapper


def inductor_compile_fx(
    model: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    inner_compile: Callable[..., Any],
    compile_region_name: str | None,
) -> Any:
    """21. Inductor's ``compile_fx`` of a Dynamo graph, ``inner_compile`` turning each ATen graph into kernels."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(
        model, example_inputs, inner_compile=inner_compile, compile_region_name=compile_region_name
    )


def inductor_compile_fx_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """21. Inductor's ``compile_fx_inner``: one ATen graph to kernels, the function looked up at each call."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def inductor_autotunes_across_ranks() -> bool:
    """21. Whether Inductor's distributed GEMM autotuning is on: it talks to the other ranks while compiling."""
    return bool(getattr(torch._inductor.config, "distributed_max_autotune_gemm", False))


def aot_autograd_bundles_its_cache() -> bool:
    """21. Whether AOTAutograd's cache bundles Inductor's output, which it then needs as soon as compile_fx returns."""
    from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache

    return bool(should_bundle_autograd_cache())


class TorchGlobalState:
    """22. torch's process-global flags (grad mode, deterministic algorithms, TF32, ...) as they are at construction.

    Dynamo's ``GlobalStateGuard``, the check its compiled graphs make of the
    same flags; see [Note: State at capture time] in _background.py.
    """

    __slots__ = ("_guard",)

    def __init__(self) -> None:
        self._guard = torch._C._dynamo.guards.GlobalStateGuard()

    def unchanged(self) -> bool:
        """Whether every flag still has its value of the construction."""
        return bool(self._guard.check())

    def changes(self) -> str:
        """Which flags differ now, in Dynamo's words."""
        return str(self._guard.reason())


class DynamoCompileContexts:
    """22. Dynamo's tracing and compile contexts (``torch._guards``) of the compile under way at construction.

    Re-entered on the background compile thread, as AOTAutograd's lazy
    backward compile re-enters them after ``compile_fx`` returned; see [Note:
    Compiling in the background] in _background.py.
    """

    __slots__ = ("compiling", "tracing")

    def __init__(self) -> None:
        #: The ``TracingContext``, or None outside a trace.
        self.tracing: Any = torch._guards.TracingContext.try_get()
        #: The ``CompileContext``, or None outside a compile.
        self.compiling: Any = torch._guards.CompileContext.try_get()

    @contextlib.contextmanager
    def reentered(self) -> Iterator[None]:
        """Inside: these contexts are this thread's current ones (the compile context first, as Dynamo enters them)."""
        with torch._guards.compile_context(self.compiling), torch._guards.tracing(self.tracing):
            yield


def dynamo_compile_lock() -> contextlib.AbstractContextManager[Any]:
    """22. Dynamo's ``compile_lock``, held by every Dynamo frame compile; see [Note: One Inductor compile at a time]."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def autocast_disabled() -> torch._C._DisableAutocast:
    """22. A context in which autocast is off (its dispatch keys excluded), as in Dynamo's own compiles."""
    return torch._C._DisableAutocast()


def dynamo_cache_entries(code: types.CodeType) -> list[Any]:
    """23. Dynamo's cache entries of ``code``, most recently compiled first, in the order Dynamo's lookup tries them.

    Dynamo's own C++ entry objects, as they are (the cache-hit path makes no
    object per entry): ``backend``, ``guard_manager`` (``.check(frame_locals)``,
    the full guard set as Dynamo's lookup checks it), ``code`` (the
    transformed code) and ``compile_id``. A reset on another thread may free
    an entry: read its fields at once. See [Note: Calling Dynamo's cached
    code directly] in _dynamo_direct.py.
    """
    entries: list[Any] = _debug_get_cache_entry_list(code)
    return entries


def dynamo_recompile_limit() -> int:
    """23. How many cache entries Dynamo compiles for one code before it runs that code without tracing."""
    limit: int = torch._dynamo.config.recompile_limit
    return limit


def optimized_module_backend(compiled: Any) -> object:
    """23. The backend Dynamo stores on the cache entries an ``OptimizedModule`` makes.

    ``innermost_backend`` of its context's callback, as Dynamo's lookup derives it.
    """
    return _eval_frame.innermost_backend(compiled.dynamo_ctx.callback)


def dynamo_wrappers_inert() -> bool:
    """24. Whether Dynamo's wrappers around an ``OptimizedModule`` call would do nothing but look its frame up.

    The compile stance is ``"default"`` with no forced backend, no eval-frame
    callback is active on this thread, no global ``nn.Module`` hook is
    registered, and nothing traces (``torch.jit.trace``, FX symbolic
    tracing, a Dynamo/export tracing context). See [Note: Calling Dynamo's
    cached code directly] in _dynamo_direct.py.
    """
    stance = _eval_frame._stance
    return (
        stance.stance == "default"
        and stance.backend is None
        and get_eval_frame_callback() is None
        and not _has_any_global_hook()
        and not torch._C._is_tracing()
        and not is_fx_symbolic_tracing()
        and torch._guards.TracingContext.try_get() is None
    )


#: 24. Dynamo's per-call enter hooks that matter only to a compile:
#: ``torch.compile``'s ``call_on_enter`` (a one-time patch of
#: ``nn.Module.__init__``, made by the first, normal call, and a bump of
#: ``GenerationTracker.generation``, which the direct call makes too:
#: ``bump_dynamo_generation``) and the config patch of
#: ``dynamic=``/``shapes_spec`` (``change``), by module and name.
_COMPILE_ONLY_HOOKS = {
    ("torch._dynamo.eval_frame", "call_on_enter"),
    ("torch.utils._config_module", "change"),
}


def _only_while_compiling(hook: Any) -> bool:
    return (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) in _COMPILE_ONLY_HOOKS


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or getattr(module, "_forward_hooks_with_kwargs", None)
        or hasattr(module, "_initialize_hook")
    )


def is_plain_torch_compile_of(compiled: Any, gm: torch.nn.Module) -> bool:
    """24. Whether ``compiled`` is ``torch.compile(gm)``, an ``OptimizedModule`` whose calls add nothing to a compile.

    Its context is a plain ``OptimizeContext`` whose per-call enter hooks
    matter only to a compile (``_COMPILE_ONLY_HOOKS``), and neither module
    has hooks of its own. See [Note: Calling Dynamo's cached code directly]
    in _dynamo_direct.py.
    """
    return (
        type(compiled) is _eval_frame.OptimizedModule
        and compiled._orig_mod is gm
        and type(compiled.dynamo_ctx) is _eval_frame.OptimizeContext
        and all(_only_while_compiling(hook) for hook in compiled.dynamo_ctx.enter_exit_hooks)
        and not _has_hooks(compiled)
        and not _has_hooks(gm)
    )


def bump_dynamo_generation() -> None:
    """24. What ``call_on_enter`` does at each call besides its one-time patch; CUDA graph trees read it to tell a new invocation."""
    GenerationTracker.generation += 1


def profiler_enabled() -> bool:
    """24. Whether the autograd profiler records, as Dynamo checks it before its "Torch-Compiled Region" range."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def excluded_dispatch_keys() -> torch._C.DispatchKeySet:
    """25. The dispatch keys this thread excludes now (its TLS local exclude set)."""
    return torch._C._dispatch_tls_local_exclude_set()


def dispatch_keys_excluded_as(excluded: torch._C.DispatchKeySet) -> torch._C._ForceDispatchKeyGuard:
    """25. A guard inside which this thread excludes exactly ``excluded``, its included keys as they are.

    See [Note: Recomputing with autograd on] in _checkpoint.py.
    """
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def privateuse1_device_type() -> str:
    """26. The device type name of the PrivateUse1 backend (``"privateuseone"`` unless a backend renamed it)."""
    return torch._C._get_privateuse1_backend_name()


def tensor_use_count(t: torch.Tensor) -> int:
    """27. References to ``t``'s C++ tensor (its TensorImpl): 1 when its Python object is the only holder."""
    count: int = t._use_count()  # type: ignore[attr-defined]
    return count


def storage_key(storage: torch.UntypedStorage) -> int:
    """27. The address of ``storage``'s C++ StorageImpl: one key for every Python object of the same storage."""
    return storage._cdata


def storage_use_count(key: int) -> int:
    """27. References to the StorageImpl at ``key`` (a ``storage_key``): one from each tensor on it and each Python storage object."""
    return torch._C._storage_Use_Count(key)


def inductor_config() -> Any:
    """28. ``torch._inductor.config``, Inductor's options module (with the methods its config module adds at import)."""
    import torch._inductor.config

    return torch._inductor.config


@dataclasses.dataclass(frozen=True)
class InductorReuseCandidate:
    """31. One buffer reuse Inductor considers: a buffer dead after one node handed to a new one of its size."""

    #: Scheduler node after which the dead buffer is freed (its last reader).
    freed_after: int
    #: Scheduler node whose output would take the dead buffer.
    allocated_at: int
    #: Bytes the reuse holds from the one to the other.
    size: int
    #: Inductor's estimated peak level over scheduler nodes first..last; an input counts up to its last reader.
    estimated_level: Callable[[int, int], int]
    #: Bytes of the graph's inputs whose last reader is at or before a scheduler node (0 before the first).
    input_bytes_freed_by: Callable[[int], int]
    #: The graph's memory plan the reuse is part of (one per generated code): a key for what a rule caches of it.
    plan: object


#: The rule deciding reuses in our graphs and whether it applies now (none or one); see install_inductor_reuse_rule.
_reuse_rule: list[tuple[Callable[[InductorReuseCandidate], bool], Callable[[], bool]]] = []
#: Per peak estimate (one per graph's code generation): sorted last-reader indices of its inputs, cumulative bytes.
_input_last_readers: weakref.WeakKeyDictionary[Any, tuple[list[int], list[int]]] = weakref.WeakKeyDictionary()


def _inputs_freed_by(estimate: Any) -> tuple[list[int], list[int]] | None:
    """Sorted last-reader indices of the graph's freeable inputs with their cumulative bytes, or None if not ours to read."""
    from torch._inductor.memory import get_freeable_input_buf
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    table = _input_last_readers.get(estimate)
    if table is None:
        nodes = V.graph.scheduler.nodes
        if estimate.segmented_tree.n != len(nodes) + 1:  # a level per node and one after the last
            return None  # a subgraph's lines, planned while V.graph is the outer graph
        index = {node: i for i, node in enumerate(nodes)}
        freeable = get_freeable_input_buf(nodes, OrderedSet(V.graph.graph_inputs.keys()))
        last = sorted(
            (max(index[n] for n in buf.mpi_buffer.succ_nodes), buf.mpi_buffer.size_free)
            for buf in freeable.values()
            if buf.mpi_buffer.succ_nodes
        )
        cumulative = [0]
        for _, nbytes in last:
            cumulative.append(cumulative[-1] + nbytes)
        table = ([i for i, _ in last], cumulative)
        _input_last_readers[estimate] = table
    return table


def install_inductor_reuse_rule(
    rule: Callable[[InductorReuseCandidate], bool], applies: Callable[[], bool]
) -> None:
    """31. From now on, Inductor asks ``rule`` whether to reuse a buffer wherever ``applies()``; elsewhere its own check.

    Idempotent: the method is wrapped once per process, and a later call
    replaces the rule. A graph whose levels cannot be read (a subgraph's)
    reuses only a buffer freed right before the allocation, as Inductor
    always does.
    """
    from torch._inductor.codegen.wrapper import AllocateLine

    _reuse_rule[:] = [(rule, applies)]
    if getattr(AllocateLine.should_reuse_buffer, "_ca_rule", False):
        return
    inductors_check = AllocateLine.should_reuse_buffer

    def should_reuse_buffer(self: Any, free_line: Any, size: int) -> bool:
        if not _reuse_rule or not _reuse_rule[0][1]():
            return inductors_check(self, free_line, size)
        rule = _reuse_rule[0][0]
        freed_after, allocated_at = free_line.scheduler_node_index, self.scheduler_node_index
        if allocated_at <= freed_after + 1:
            return True  # no node in between: as Inductor's own check
        estimate = self.wrapper.estimate_peak
        table = _inputs_freed_by(estimate)
        if table is None:
            return False
        positions, cumulative = table
        return rule(
            InductorReuseCandidate(
                freed_after=freed_after,
                allocated_at=allocated_at,
                size=size,
                estimated_level=estimate.segmented_tree.summarize_range,
                input_bytes_freed_by=lambda node: cumulative[bisect.bisect_right(positions, node)],
                plan=estimate,
            )
        )

    should_reuse_buffer._ca_rule = True  # type: ignore[attr-defined]
    should_reuse_buffer.__wrapped__ = inductors_check  # type: ignore[attr-defined]
    AllocateLine.should_reuse_buffer = should_reuse_buffer  # type: ignore[method-assign]


# [Note: Generated vmap rules share a key]
# ``torch.func.vmap(F.apply)`` with ``generate_vmap_rule=True`` makes a new
# Function class on every call (``vmapify_autograd_function``), and each new
# class gets a new ``_autograd_function_id`` from torch's counter. A node's
# compiled-autograd key is that id (``Function._compiled_autograd_key``), so a
# training step that vmaps such a Function in its forward was a new key path
# every step: a capture and a compile per step (about 0.2 s with aot_eager,
# seconds with Inductor) and a cache that grew by one entry a step. What a
# generated class does is fixed by the four arguments it is made from (the
# Function, its in_dims, the batch size and the randomness mode; its methods
# close over nothing else and keep their per-call state on the ctx, keyed by
# the class's own ``id``), so classes made from equal arguments are given
# the id of the first one made from them: the key path repeats and the graph
# is hit. Only the id is shared; each call still gets its own class, so two
# nested levels made from equal arguments keep apart what they store on a
# shared ctx. The node runs behind a graph break in ca's graphs (see
# _capture.py's ``_FUNCTIONS_RUN_EAGERLY``); torch's own compiled autograd,
# which reads the same id, guards on the ctx's class in Dynamo and sees the
# same computation. Arguments that cannot be hashed keep torch's fresh id.

#: (the Function's backward id, in_dims, batch size, randomness) -> the id generated classes share.
_generated_vmap_rule_ids: dict[tuple[object, ...], int] = {}


def stable_generated_vmap_rule_ids() -> None:
    """32. From now on, classes vmap generates from equal arguments share one compiled-autograd id; idempotent."""
    from torch._functorch import autograd_function

    if getattr(autograd_function.vmapify_autograd_function, "_ca_stable_ids", False):
        return
    vmapify = autograd_function.vmapify_autograd_function

    @functools.wraps(vmapify)
    def vmapify_with_a_stable_id(
        function: type[torch.autograd.Function], in_dims: Any, batch_size: int, randomness: str
    ) -> type[torch.autograd.Function]:
        generated = vmapify(function, in_dims, batch_size, randomness)
        backward_cls: Any = getattr(generated, "_backward_cls", None)
        function_id = getattr(getattr(function, "_backward_cls", None), "_autograd_function_id", None)
        if backward_cls is None or function_id is None:
            return generated
        key = (function_id, in_dims, batch_size, randomness)
        try:
            shared = _generated_vmap_rule_ids.setdefault(key, backward_cls._autograd_function_id)
        except TypeError:  # in_dims that cannot be hashed: torch's own id
            return generated
        backward_cls._autograd_function_id = shared
        return generated

    vmapify_with_a_stable_id._ca_stable_ids = True  # type: ignore[attr-defined]
    autograd_function.vmapify_autograd_function = vmapify_with_a_stable_id  # type: ignore[assignment]
