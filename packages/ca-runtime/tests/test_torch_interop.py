"""Smoke tests of the private torch APIs ca_runtime uses, one per item of _torch_interop.py's list.

A torch upgrade that moves one of them fails here, by name, before any
behaviour test does.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ca_runtime import _torch_interop


def test_1_disable_is_a_context_manager_we_can_wrap() -> None:
    _torch_interop.keep_hook_across_torch_disable()
    module = torch._dynamo.compiled_autograd
    assert getattr(module._disable, "_ca_rearms", False)
    with module._disable():
        pass
    assert getattr(module.reset, "_ca_rearms", False)


def test_2_torch_compiled_autograd_state_is_readable_and_rearmable() -> None:
    assert _torch_interop.torch_compiled_autograd_enabled() is False
    set_compiler = torch._C._dynamo.compiled_autograd.set_autograd_compiler
    prior = set_compiler(None, False)
    assert isinstance(prior, tuple) and len(prior) == 2
    set_compiler(*prior)
    _torch_interop.rearm_torch_compiled_autograd()


def test_3_fake_ctx_runs_a_functions_backward() -> None:
    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
            return x * 3

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
            ctx.seen = g.numel()
            return g * 3

    y = Triple.apply(torch.ones(2, requires_grad=True))
    ctx = y.grad_fn
    (grad,) = _torch_interop.call_backward(ctx, [], torch.ones(2))
    assert torch.equal(grad, torch.full((2,), 3.0))
    assert ctx.seen == 2  # see [Note: ctx writes in a backward]
    assert list(inspect.signature(_torch_interop.FakeBackwardCFunction).parameters) == [
        "real",
        "saved_tensors",
    ]
    # See [Note: The ctx a backward sees is a Node].
    assert isinstance(_torch_interop.FakeBackwardCFunction(ctx, []), torch.autograd.graph.Node)


def test_4_dynamo_trace_rules_tell_skipped_from_inlined() -> None:
    from torch.utils.checkpoint import checkpoint

    assert not _torch_interop.dynamo_skips(lambda g: g * 2)
    assert _torch_interop.dynamo_skips(checkpoint)


def test_7_dynamo_compile_callbacks_bracket_a_compile() -> None:
    from torch._dynamo.callback import callback_handler

    seen: list[int] = []

    @torch.compile(backend="eager")
    def warns(t: torch.Tensor) -> torch.Tensor:
        seen.append(len(warnings.filters))
        return t + 1

    before = list(warnings.filters)
    callbacks_before = (list(callback_handler.start_callbacks), list(callback_handler.end_callbacks))
    with _torch_interop.warnings_ignored_while_dynamo_compiles():
        warns(torch.ones(1))
    assert seen and seen[0] == len(before) + 1  # the ignore filter heads the list while Dynamo traces
    assert warnings.filters == before
    assert (callback_handler.start_callbacks, callback_handler.end_callbacks) == callbacks_before


def test_6_aot_internals_are_where_aot_py_reads_them() -> None:
    from torch._dynamo.compiled_autograd import extract_bw_module

    model = torch.compile(torch.nn.Linear(2, 2), backend="aot_eager")
    out = model(torch.randn(3, 2))
    cls = out.grad_fn._forward_cls  # type: ignore[union-attr]
    for attribute in ("_aot_id", "_bw_prologue_fn", "metadata", "maybe_subclass_metadata"):
        assert hasattr(cls, attribute), attribute
    assert hasattr(cls.metadata, "is_rng_op_functionalized")
    assert isinstance(extract_bw_module(cls), torch.fx.GraphModule)


def test_5_dynamo_reads_the_locals_to_steal_mark() -> None:
    from torch._dynamo.utils import get_locals_to_steal

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    _torch_interop.set_locals_to_steal(gm, ["inputs"])
    assert get_locals_to_steal(gm) == ["inputs"]


def test_5_a_stolen_list_is_flattened_as_torch_flattens_it() -> None:
    """The flatten_graph_inputs of [Note: A stolen list flattened without pytree] against torch's own."""
    import torch._dynamo.backends.common as aot_backends
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.compile_fx as inductor_compile

    def graph(inputs: list[torch.Tensor], scale: int) -> list[torch.Tensor]:
        return [inputs[0] * scale + inputs[1]]

    gm = torch.fx.symbolic_trace(graph)
    next(iter(gm.graph.find_nodes(op="placeholder"))).meta["steal_arg"] = True
    _torch_interop.set_locals_to_steal(gm, ["inputs"])
    ours = inductor_compile.flatten_graph_inputs
    assert aot_backends.flatten_graph_inputs is ours and dynamo_utils.flatten_graph_inputs is not ours

    for flatten, stolen_list in ((dynamo_utils.flatten_graph_inputs, False), (ours, True)):
        seen: list[list[Any]] = []

        def compile_gm(flat_gm: Any, flat_inputs: list[Any], seen: list[list[Any]] = seen) -> Any:
            seen.append(list(flat_inputs))

            def boxed(args: list[Any]) -> Any:
                seen.append(list(args))
                return flat_gm(*args)

            return boxed

        a, b = torch.ones(2), torch.full((2,), 3.0)
        run = flatten(gm, [[a, b], 2], compile_gm)
        inputs = [a, b]
        (out,) = run(inputs, 2)
        assert torch.equal(out, torch.full((2,), 5.0))
        assert inputs == []  # stolen: cleared before the graph runs
        assert [len(x) for x in seen] == [3, 3] and seen[0][0] is a and seen[1][1] is b and seen[1][2] == 2
        assert getattr(flatten, "_ca_flattens", False) is stolen_list

    # Anything else (a nested list here) takes torch's path through ours.
    nested = torch.fx.symbolic_trace(lambda xs: [xs[0][0] + 1])
    got: list[Any] = []
    ours(nested, [[[torch.ones(1)]]], lambda g, flat: got.append(len(flat)) or (lambda args: g(*args)))
    assert got == [1]


def test_8_checkpoint_frames_record_each_saved_tensors_metadata() -> None:
    checkpoint = torch.utils.checkpoint
    frame = checkpoint._CheckpointFrame(
        None, True, None, checkpoint._allowed_determinism_checks_to_fns["default"]
    )
    hooks = checkpoint._checkpoint_hook(frame)  # what checkpoint(use_reentrant=False) installs
    x = torch.randn(2, 3)
    holders = [hooks.pack_hook(torch.randn(5)), hooks.pack_hook(x)]
    found = _torch_interop.checkpoint_frame(hooks.unpack_hook)
    assert found is not None and found[0] is frame
    cell = found[1]
    assert _torch_interop.checkpoint_saved_index(frame, holders[1]) == 1
    assert _torch_interop.checkpoint_saved_metadata(hooks.unpack_hook, cell, 1) == {
        "shape": x.shape,
        "dtype": x.dtype,
        "device": x.device,
    }
    assert _torch_interop.checkpoint_frame(lambda t: t) is None
    # debug=True installs the unpack hook wrapped with an error callback: found too.
    debug_frame = checkpoint._CheckpointFrame(
        None, True, lambda e: None, checkpoint._allowed_determinism_checks_to_fns["default"]
    )
    debug_hook = checkpoint._checkpoint_hook(debug_frame).unpack_hook
    assert debug_hook.__code__.co_name == "unpack_hook_with_error_cb"
    found = _torch_interop.checkpoint_frame(debug_hook)
    assert found is not None and found[0] is debug_frame
    # determinism_check="none" records nothing to place a tensor by.
    bare = checkpoint._CheckpointFrame(
        None, True, None, checkpoint._allowed_determinism_checks_to_fns["none"]
    )
    holder = checkpoint._checkpoint_hook(bare).pack_hook(x)
    assert _torch_interop.checkpoint_saved_index(bare, holder) is None


def test_inductor_config_tells_a_users_setting_from_the_default() -> None:
    """_is_default, which [Note: Inductor options for backward graphs] reads."""
    config = torch._inductor.config
    assert config._is_default("reorder_for_locality")
    # What `config.reorder_for_locality = True` does, revertibly
    # (config.patch would leave it set when it exits).
    revert = config._make_closure_patcher(reorder_for_locality=True)()
    assert config.reorder_for_locality is True and not config._is_default("reorder_for_locality")
    revert()
    assert config._is_default("reorder_for_locality")


def test_9_fx_keeps_each_generated_source_under_a_numbered_key() -> None:
    with _torch_interop.sources_made() as keys:
        gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert keys and all(k in torch.fx.graph_module._loader.eval_cache for k in keys)
    _torch_interop.forget_sources_with(gm, keys)
    del gm
    import gc

    gc.collect()
    assert not any(k in torch.fx.graph_module._loader.eval_cache for k in keys)


def test_10_a_torch_compile_context_names_its_backend() -> None:
    first, second = torch._dynamo.optimize("eager"), torch._dynamo.optimize("eager")
    backend = _torch_interop.dynamo_context_backend(first)
    assert backend is not None and backend == _torch_interop.dynamo_context_backend(second)
    assert _torch_interop.dynamo_context_backend(lambda gm: gm) is None


def test_10_dynamos_eager_backend_is_told_from_the_others() -> None:
    module = torch.nn.Identity()
    assert _torch_interop.compiles_with_dynamo_eager(torch.compile(module, backend="eager")) is True
    assert _torch_interop.compiles_with_dynamo_eager(torch.compile(module, backend="aot_eager")) is False
    assert _torch_interop.compiles_with_dynamo_eager(torch.compile(module)) is False  # inductor

    def eager(gm: torch.fx.GraphModule, inputs: object) -> torch.fx.GraphModule:  # a user's, named eager
        return gm

    assert _torch_interop.compiles_with_dynamo_eager(torch.compile(module, backend=eager)) is False
    assert _torch_interop.compiles_with_dynamo_eager(module) is None


def test_11_torchs_enable_is_replaced_inside_the_context_and_restored() -> None:
    original = torch._dynamo.compiled_autograd._enable
    entered: list[object] = []

    class Recorder:
        def __init__(self, fn: object) -> None:
            entered.append(fn)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *args: object) -> None:
            return None

    with _torch_interop.routed_torch_compiled_autograd(Recorder):  # type: ignore[arg-type]
        with torch._dynamo.compiled_autograd._enable("compiler"):  # type: ignore[arg-type]
            pass
        assert torch._dynamo.compiled_autograd.active_disable_ctx is False
        assert torch._dynamo.eval_frame._stance.stance == "default"
    assert entered == ["compiler"] and torch._dynamo.compiled_autograd._enable is original


def test_12_torch_logging_registers_the_ca_log_and_reads_artifacts() -> None:
    wanted, verbose = _torch_interop.register_ca_logs()
    assert isinstance(wanted, bool) and isinstance(verbose, bool)
    assert "ca" in torch._logging._internal.log_registry.log_alias_to_log_qnames


def test_13_dynamo_state_of_a_code_is_released() -> None:
    """See [Note: What Dynamo keeps of a dropped graph]."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.guards import code_framelocals_names_reversed_cached

    compiled = torch.compile(fn, backend="eager")
    compiled(torch.ones(2))
    assert len(_debug_get_cache_entry_list(fn.__code__)) == 1
    assert code_framelocals_names_reversed_cached.cache_info().currsize > 0
    dead = weakref.ref(compile("0", "<dead>", "eval"))
    input_codes.seen.append(dead)
    _torch_interop.release_dynamo_state(fn.__code__)
    assert _debug_get_cache_entry_list(fn.__code__) == []
    assert code_framelocals_names_reversed_cached.cache_info().currsize == 0
    assert dead not in input_codes.seen and fn.__code__ in input_codes  # live codes stay tracked
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))  # compiles again


def test_14_a_traced_setattr_is_none() -> None:
    """See [Note: setattr is None in a trace]: the side effect happens, the call's value is Python's."""
    t = torch.zeros(2, requires_grad=True)

    def fn(g: torch.Tensor) -> tuple[object, torch.Tensor]:
        return setattr(t, "grad", g * 2), g + 1  # type: ignore[func-returns-value]

    result, _ = torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
    assert result is None
    assert torch.equal(t.grad, torch.full((2,), 2.0))


def test_15_tracked_fakes_of_a_finished_compile_are_cleared() -> None:
    """See [Note: Fakes a finished compile still tracks]: only ShapeEnvs, only when no compile holds the lock."""
    import threading

    from torch._dynamo.convert_frame import compile_lock
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env, other = ShapeEnv(tracked_fakes=[]), [object()]
    env.tracked_fakes.append(object())  # type: ignore[union-attr]
    held, release = threading.Event(), threading.Event()

    def compiling() -> None:
        with compile_lock:
            held.set()
            release.wait()

    thread = threading.Thread(target=compiling)
    thread.start()
    held.wait()
    _torch_interop.clear_finished_tracked_fakes([env, other])
    assert env.tracked_fakes and other  # another thread's compile is under way
    release.set()
    thread.join()
    _torch_interop.clear_finished_tracked_fakes([env, other])
    assert env.tracked_fakes == [] and other


def test_16_stacks_of_finished_compiles_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """See [Note: Stacks Dynamo's metrics keep]: dropped when no compile is in progress on the thread, kept inside one."""
    from torch._dynamo.utils import get_metrics_context

    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(2))
    context = get_metrics_context()
    assert context._edits  # torch keeps them after the compile
    _torch_interop.forget_metric_stacks()
    assert context._edits == []
    monkeypatch.setattr(context, "_on_exit", lambda *args: None)  # this probe's metrics are not Dynamo's
    with context:
        context.set("ca_probe", 1)
        _torch_interop.forget_metric_stacks()
        assert len(context._edits) == 1
    _torch_interop.forget_metric_stacks()
    assert context._edits == []


def test_17_the_frame_a_failed_compile_was_for() -> None:
    """See [Note: A recompile that fails on a hit]: Dynamo's frame id of a code, and of the compile that failed."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    def other(t: torch.Tensor) -> torch.Tensor:
        return t * 3

    def broken(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
        raise RuntimeError("no")

    assert _torch_interop.compiled_frame_id(fn.__code__) is None
    torch.compile(fn, backend="eager")(torch.ones(2))
    torch.compile(other, backend="eager")(torch.ones(2))
    frame = _torch_interop.compiled_frame_id(fn.__code__)
    assert frame is not None and frame != _torch_interop.compiled_frame_id(other.__code__)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        torch.compile(fn, backend=broken)(torch.ones(2))
    assert _torch_interop.failed_compile_frame_id(failed.value) == frame
    assert _torch_interop.failed_compile_frame_id(RuntimeError("not Dynamo's")) is None


def test_08_checkpoint_inputs_packed_by_user_hooks() -> None:
    """See [Note: Side effects beside a region's recompute]: read from the frame's saved_args."""
    import torch.utils.checkpoint

    def frame_of(out: torch.Tensor) -> object:
        hook = (
            out.grad_fn._raw_saved_self.unpack_hook
        )  # a checkpoint unpack hook, SinBackward0 inside the region
        found = _torch_interop.checkpoint_frame(hook)
        assert found is not None
        return found[0]

    x = torch.ones(3, requires_grad=True)
    plain = torch.utils.checkpoint.checkpoint(lambda a: (a * 2).sin(), x, use_reentrant=False)
    assert not _torch_interop.checkpoint_inputs_have_hooks(frame_of(plain))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        hooked = torch.utils.checkpoint.checkpoint(lambda a: (a * 2).sin(), x, use_reentrant=False)
    assert _torch_interop.checkpoint_inputs_have_hooks(frame_of(hooked))


def test_18_a_later_frame_that_fails_to_compile_runs_uncompiled(caplog: pytest.LogCaptureFixture) -> None:
    """See [Note: A later frame that fails to compile]: the first frame's compile is not suppressed, later ones are."""
    compiled_frames: list[int] = []

    def fails_after_the_first(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        compiled_frames.append(1)
        if len(compiled_frames) >= 2:
            raise RuntimeError("backend broke")
        return gm.forward

    def helper(t: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return t * 3

    def fn(t: torch.Tensor) -> torch.Tensor:
        return helper(t + 1) - 1

    errors: list[BaseException] = []
    prior = torch._dynamo.config.suppress_errors
    with _torch_interop.later_frames_static_and_uncompiled_on_failure(None, errors):
        out = torch.compile(fn, backend=fails_after_the_first)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 5.0))
    assert len(errors) >= 1 and "backend broke" in str(errors[0])
    assert torch._dynamo.config.suppress_errors is prior
    assert not [r for r in caplog.records if r.name == "torch._dynamo.convert_frame" and r.exc_info]
    # Without it, Dynamo raises the later frame's failure.
    torch._dynamo.reset()
    compiled_frames.clear()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="backend broke"):
        torch.compile(fn, backend=fails_after_the_first)(torch.ones(2))
    torch._dynamo.reset()
    # The first frame's own failure is not suppressed.
    compiled_frames.append(1)
    with (
        pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="backend broke"),
        _torch_interop.later_frames_static_and_uncompiled_on_failure(None, errors),
    ):
        torch.compile(fn, backend=fails_after_the_first)(torch.ones(2))
    assert torch._dynamo.config.suppress_errors is prior
    torch._dynamo.reset()


def test_18_later_frames_infer_no_dynamic_stride() -> None:
    """See [Note: Later frames keep static strides]: a later frame (behind a graph break) seeing
    one size in three layouts compiles each static; seeing new sizes, its sizes still go dynamic;
    Dynamo's reading of strides is restored after, and another thread meanwhile gets torch's answer."""
    from torch._dynamo.pgo import FrameStateSizeEntry, auto_dynamic, auto_unset

    wobbling = FrameStateSizeEntry(scalar=auto_unset, size=(2, 2), stride=auto_dynamic)
    seen: list[tuple[bool, bool, bool]] = []  # per compile: later frame, a stride symbolic, a size symbolic
    elsewhere: list[bool] = []  # per later compile: another thread's reading of a wobbling stride

    def records(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        static_here = _torch_interop._STATIC_STRIDES.get()
        if static_here:
            other = threading.Thread(target=lambda: elsewhere.append(wobbling.is_stride_dynamic(0)))
            other.start()
            other.join()
        seen.append((
            static_here,
            any(isinstance(d, torch.SymInt) for x in tensors for d in x.stride()),
            any(isinstance(d, torch.SymInt) for x in tensors for d in x.shape)
            or len(tensors) < len(example_inputs),
        ))  # fmt: skip
        return gm.forward

    def helper(t: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return t * 3

    def fn(t: torch.Tensor) -> torch.Tensor:
        return helper(t) - 1

    compiled = torch.compile(fn, backend=records)
    errors: list[BaseException] = []
    base = torch.ones(8, 12)
    layouts = [base[:2, :2], base[::2, :2][:2], base[::3, :2][:2]]  # one size; row strides 12, 24, 36
    for t in layouts:
        with _torch_interop.later_frames_static_and_uncompiled_on_failure(None, errors):
            assert torch.equal(compiled(t), torch.full((2, 2), 2.0))
        assert not _torch_interop._STATIC_STRIDES.get() and wobbling.is_stride_dynamic(0)
    later = [compile for compile in seen if compile[0]]
    assert len(later) >= 3 and not any(stride for _, stride, _ in later), seen
    assert elsewhere == [True] * len(later)
    assert not errors
    sized_from = len(seen)
    for n in (3, 4, 5):
        with _torch_interop.later_frames_static_and_uncompiled_on_failure(None, errors):
            assert torch.equal(compiled(base[:n, :2]), torch.full((n, 2), 2.0))
    assert any(later and size for later, _, size in seen[sized_from:]), seen
    assert not errors
    torch._dynamo.reset()


def test_18_a_context_is_entered_only_when_dynamo_compiles() -> None:
    """See [Note: Compiles during a hit keep the backward options]: entered once at the first compile
    start inside (two frames compile here), left at the end; a call that compiles nothing enters nothing."""
    events: list[str] = []

    @contextlib.contextmanager
    def recorded() -> Iterator[None]:
        events.append("enter")
        yield
        events.append("exit")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        events.append("compile")
        return gm.forward

    def helper(t: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return t * 3

    compiled = torch.compile(lambda t: helper(t + 1) - 1, backend=backend)
    with _torch_interop.entered_when_dynamo_compiles(recorded):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 5.0))
        events.append("returned")
    assert events[0] == "enter" and events.count("enter") == 1 and events.count("compile") >= 2
    assert events[-2:] == ["returned", "exit"]
    events.clear()
    with _torch_interop.entered_when_dynamo_compiles(recorded):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 5.0))
    assert events == []
    torch._dynamo.reset()


def test_19_fake_tensors_and_the_fake_mode_are_recognised() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(2)
    assert not _torch_interop.on_fake_tensors([real, None])
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        assert _torch_interop.on_fake_tensors([])  # the mode alone
    assert _torch_interop.on_fake_tensors([None, fake])  # a fake tensor outside its mode


def test_20_functorchs_generated_vmap_rule_is_recognised() -> None:
    class Exp(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.exp()

        @staticmethod
        def setup_context(ctx: object, inputs: object, output: object) -> None:
            pass

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return grad

    x = torch.ones(2, 3, requires_grad=True)
    generated = torch.func.vmap(Exp.apply)(x).grad_fn
    assert _torch_interop.is_generated_vmap_rule(generated._forward_cls)
    assert not _torch_interop.is_generated_vmap_rule(Exp.apply(x).grad_fn._forward_cls)


def test_21_inductors_compile_entry_points_take_what_the_background_compiler_passes() -> None:
    """See [Note: Compiling in the background]: the wrapper BackgroundInductor subclasses, and compile_fx's arguments."""
    import torch._inductor.compile_fx

    wrapper = _torch_interop.optimized_module_backend(torch.compile(torch.nn.Identity()))  # inductor, not run
    assert isinstance(wrapper, _torch_interop.TorchCompileInductorWrapper)
    assert wrapper.config == {} and wrapper.name is None
    assert {"inner_compile", "compile_region_name"} <= set(
        inspect.signature(torch._inductor.compile_fx.compile_fx).parameters
    )
    assert list(inspect.signature(torch._inductor.compile_fx.compile_fx_inner).parameters)[:2] == [
        "gm",
        "example_inputs",
    ]
    assert hasattr(torch._inductor.config, "distributed_max_autotune_gemm")
    assert _torch_interop.inductor_autotunes_across_ranks() is False
    with torch._inductor.config.patch(distributed_max_autotune_gemm=True):
        assert _torch_interop.inductor_autotunes_across_ranks() is True
    assert _torch_interop.aot_autograd_bundles_its_cache() is False


def test_21_compile_fx_inner_is_looked_up_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests (and torch's own patches) replace compile_fx_inner on its module; the call must reach the replacement."""
    import torch._inductor.compile_fx

    calls: list[object] = []
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", lambda *a, **k: calls.append((a, k)))
    _torch_interop.inductor_compile_fx_inner("gm", ["x"], is_inference=True)  # type: ignore[arg-type]
    assert calls == [(("gm", ["x"]), {"is_inference": True})]


def test_22_the_capture_state_a_compile_thread_takes_over() -> None:
    """See [Note: State at capture time]: torch's global flags, Dynamo's contexts and compile lock, autocast off."""
    state = _torch_interop.TorchGlobalState()
    assert state.unchanged()
    with torch.no_grad():
        assert not state.unchanged() and "grad_mode" in state.changes()
    tracing = torch._guards.TracingContext(None)
    compiling = torch._guards.CompileContext(None)
    with torch._guards.compile_context(compiling), torch._guards.tracing(tracing):
        contexts = _torch_interop.DynamoCompileContexts()
    assert contexts.tracing is tracing and contexts.compiling is compiling
    assert torch._guards.TracingContext.try_get() is None
    with contexts.reentered():
        assert torch._guards.TracingContext.try_get() is tracing
        assert torch._guards.CompileContext.try_get() is compiling
    assert torch._guards.TracingContext.try_get() is None and torch._guards.CompileContext.try_get() is None

    from torch._dynamo.convert_frame import compile_lock

    assert _torch_interop.dynamo_compile_lock() is compile_lock
    a = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with _torch_interop.autocast_disabled():
            assert (a @ a).dtype == torch.float32


def test_23_dynamo_cache_entries_are_read_as_dynamos_lookup_reads_them() -> None:
    """See [Note: Calling Dynamo's cached code directly]: backend, guards, transformed code and compile id."""
    import types

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    compiled = torch.compile(gm, backend="eager", dynamic=False)
    x = torch.ones(3)
    compiled(x)
    entries = _torch_interop.dynamo_cache_entries(type(gm).forward.__code__)
    assert len(entries) == 1
    (entry,) = entries
    assert entry.backend is _torch_interop.optimized_module_backend(compiled)
    assert entry.guard_manager.check({"self": gm, "input": x})
    assert not entry.guard_manager.check({"self": gm, "input": torch.ones(5)})  # another shape
    assert isinstance(entry.code, types.CodeType) and str(entry.compile_id)
    assert _torch_interop.dynamo_cache_entries(torch.nn.Identity.forward.__code__) == []
    torch._dynamo.reset()


def test_24_what_dynamos_call_wrappers_check_is_read() -> None:
    """See [Note: Calling Dynamo's cached code directly]: when the wrappers around a call would do more than look up."""
    from torch._dynamo.mutation_guard import GenerationTracker

    assert _torch_interop.dynamo_wrappers_inert()
    with torch.compiler.set_stance("force_eager"):
        assert not _torch_interop.dynamo_wrappers_inert()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not _torch_interop.dynamo_wrappers_inert()
    finally:
        handle.remove()
    with torch._guards.tracing(torch._guards.TracingContext(None)):
        assert not _torch_interop.dynamo_wrappers_inert()
    assert _torch_interop.dynamo_wrappers_inert()

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert _torch_interop.is_plain_torch_compile_of(torch.compile(gm, backend="eager"), gm)
    assert _torch_interop.is_plain_torch_compile_of(torch.compile(gm, backend="eager", dynamic=True), gm)
    assert not _torch_interop.is_plain_torch_compile_of(torch.compile(gm, backend="eager"), torch.nn.ReLU())
    assert not _torch_interop.is_plain_torch_compile_of(gm, gm)
    hooked = torch.compile(gm, backend="eager")
    hooked.register_forward_hook(lambda *args: None)
    assert not _torch_interop.is_plain_torch_compile_of(hooked, gm)

    before = GenerationTracker.generation
    _torch_interop.bump_dynamo_generation()
    assert GenerationTracker.generation == before + 1
    assert _torch_interop.profiler_enabled() is False
    with torch.autograd.profiler.profile():
        assert _torch_interop.profiler_enabled() is True
    assert _torch_interop.profiler_enabled() is False


def test_25_eagers_excluded_dispatch_keys_are_put_back() -> None:
    """See [Note: Recomputing with autograd on]: inside an AOTAutograd backward autograd's keys are excluded."""
    eager = _torch_interop.excluded_dispatch_keys()
    x = torch.ones(2, requires_grad=True)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)):
        assert not (x * 2).requires_grad and _torch_interop.excluded_dispatch_keys() != eager
        with _torch_interop.dispatch_keys_excluded_as(eager):
            assert (x * 2).requires_grad and _torch_interop.excluded_dispatch_keys() == eager
        assert not (x * 2).requires_grad
    assert _torch_interop.excluded_dispatch_keys() == eager


def test_26_the_privateuse1_backend_names_a_device_type() -> None:
    name = _torch_interop.privateuse1_device_type()
    assert isinstance(name, str) and torch.device(name).type == name


def test_27_cpp_reference_counts_of_a_tensor_and_its_storage() -> None:
    """See [Note: Checkpoint regions in the graph]: what _fresh_and_dense counts to find a tensor nothing else holds."""
    t = torch.ones(3)
    assert _torch_interop.tensor_use_count(t) == 1
    storage = t.untyped_storage()
    key = _torch_interop.storage_key(storage)
    assert _torch_interop.storage_key(t.untyped_storage()) == key  # one key per C++ storage
    assert _torch_interop.storage_use_count(key) == 2  # t and the Python storage object
    alias = t[:2]
    assert _torch_interop.storage_use_count(key) == 3
    del alias
    assert _torch_interop.storage_use_count(key) == 2


def test_28_inductor_config_and_custom_pass_base_are_where_torch_documents_them() -> None:
    config = _torch_interop.inductor_config()
    assert hasattr(config, "reorder_for_locality") and callable(config._is_default)
    assert issubclass(_torch_interop.CustomGraphPass, object) and callable(_torch_interop.get_hash_for_files)


def test_29_maybe_mark_dynamic_marks_a_dimension() -> None:
    t = torch.ones(3, 4)
    _torch_interop.maybe_mark_dynamic(t, 1)
    assert 1 in getattr(t, "_dynamo_weak_dynamic_indices", set())


#: Modules of ca_runtime that may name private torch: the audited place, and
#: what is used in place because it is what the module is about (item 6).
_PRIVATE_TORCH_ALLOWED = {"_torch_interop.py", "_aot.py"}


def _private_torch_names(source: str) -> list[tuple[int, str]]:
    """``torch.X._y`` attribute reads and ``torch._x`` imports in ``source``: (line, dotted name)."""
    import ast

    def dotted(node: ast.AST) -> list[str] | None:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            chain = dotted(node)
            if chain and chain[0] == "torch":
                names.append(".".join(chain))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.split(".")[0] == "torch"]
        for name in names:
            if any(part.startswith("_") and not part.endswith("__") for part in name.split(".")[1:]):
                found.append((node.lineno, name))
    return found


def test_private_torch_names_appear_only_in_the_audited_modules() -> None:
    """Every private torch name ca_runtime uses goes through _torch_interop.py (an AST scan of the sources)."""
    import pathlib

    import ca_runtime

    root = pathlib.Path(ca_runtime.__file__).parent
    outside = {
        f"{path.relative_to(root)}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        if path.name not in _PRIVATE_TORCH_ALLOWED
        for line, name in _private_torch_names(path.read_text())
    }
    assert outside == set(), "private torch outside _torch_interop.py: add an item there and call it"


def test_the_private_torch_scan_sees_attributes_and_imports() -> None:
    source = "import torch\nimport torch._dynamo\nfrom torch._C import _x\nx = torch.fx.graph_module._loader\ny = torch.nn.Linear\n"
    assert sorted(name for _, name in _private_torch_names(source)) == [
        "torch._C._x",
        "torch._dynamo",
        "torch.fx.graph_module._loader",
    ]


def test_31_the_reuse_rule_wraps_inductors_check_once_and_asks_it_only_where_it_applies() -> None:
    from torch._inductor.codegen.segmented_tree import SegmentedTree
    from torch._inductor.codegen.wrapper import AllocateLine, EfficientPeakEstimate, FreeIfNotReusedLine
    from torch._inductor.memory import get_freeable_input_buf

    assert list(inspect.signature(AllocateLine.should_reuse_buffer).parameters) == [
        "self",
        "free_line",
        "size",
    ]
    assert list(inspect.signature(get_freeable_input_buf).parameters) == ["nodes", "graph_inputs"]
    for line in (AllocateLine, FreeIfNotReusedLine):
        assert "self.scheduler_node_index = " in inspect.getsource(line.__post_init__)
    inductors_check = getattr(
        AllocateLine.should_reuse_buffer, "__wrapped__", AllocateLine.should_reuse_buffer
    )
    assert "self.wrapper.estimate_peak" in inspect.getsource(inductors_check)
    assert "segmented_tree" in inspect.getsource(EfficientPeakEstimate.__init__)
    tree = SegmentedTree([3, 1, 4, 1], lambda a, b: a + b, max, 0)
    assert (tree.n, tree.summarize_range(1, 2)) == (4, 4)

    saved = list(_torch_interop._reuse_rule)
    asked: list[Any] = []
    try:
        _torch_interop.install_inductor_reuse_rule(
            lambda candidate: asked.append(candidate) or True, lambda: False
        )
        wrapped = AllocateLine.should_reuse_buffer
        _torch_interop.install_inductor_reuse_rule(lambda candidate: True, lambda: False)
        assert AllocateLine.should_reuse_buffer is wrapped  # wrapped once; the rule replaced

        class Line:  # as much of an AllocateLine as the wrapper reads before it asks the rule
            scheduler_node_index = 4

        # Right after the free: reused without asking, as Inductor's own check does.
        _torch_interop.install_inductor_reuse_rule(
            lambda candidate: asked.append(candidate) or False, lambda: True
        )
        free = type("Free", (), {"scheduler_node_index": 3})()
        assert wrapped(Line(), free, 64) is True and asked == []
    finally:
        _torch_interop._reuse_rule[:] = saved
