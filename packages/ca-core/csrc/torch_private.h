// torch_private.h — every use ca_core makes of torch internals that are not a
// public, stable API, behind one small interface. Checked against torch
// 2.13.0 (the version ca-core pins); each item has a smoke test in
// tests/test_torch_private.py, so a torch upgrade that breaks one fails there,
// by name, before anything else does.
//
// The dependencies, and what breaks if torch changes them:
//   1. getPyInterpreter() (libtorch_python, torch/csrc/PyInterpreter.h):
//      declared by hand because the header pulls in pybind11. Used to read
//      the Python objects torch collects (hooks, ctx, packed saved data).
//   2. torch::jit::toIValue / toPyObject (torch/csrc/jit/python/
//      pybind_utils.h): hand-written prototypes, since the header pulls in
//      much of the JIT. Itanium mangling does not encode return types, so a
//      changed return type would still link: the smoke test round-trips
//      values through both.
//   3. PyNode's mangled type name "N5torch8autograd6PyNodeE": its typeinfo
//      is not exported by libtorch_python, so no dynamic_cast is possible.
//   4. The message of FunctionPreHook's default compiled_args, which starts
//      with "compiled_args nyi": how a C++ hook without compiled_args is told
//      apart from a real failure.
//   5. SwapSavedVariables' private stashes (stashed_variables,
//      stashed_tensors, stashed_symints, stashed_ivalues), reached through
//      an explicit template instantiation; see [Note: Restoring a failed swap].
//   6. torch._dynamo.compiled_autograd.ops.add(name, fn, is_custom_function,
//      is_traceable), called positionally to share functionals with torch's
//      compiled autograd; see [Note: Sharing functionals with torch].
//   7. TensorArgs' private maps (_args: TensorImpl -> TensorArg, and
//      _saved_variables: SavedVariable -> TensorArg), reached like item 5:
//      the TensorArg of each lifted tensor by position, without holding the
//      tensor, and the SavedVariables a node's compiled_args lifted; see
//      [Note: Saved tensors freed early].
//   8. DelayWarningHandler's private warnings_ and mutex_: its
//      replay_warnings() is not exported, and the eager fallback must replay
//      what the engine's threads held back, as Engine::execute does.
//   9. The mangled type names of PyFunctionPreHook and PyFunctionPostHook
//      (torch/csrc/autograd/python_hook.h), as in item 3: a leaf's grad_fn
//      hooks are traced only when all of them are Python's; see [Note: Leaf
//      node hooks].
//  10. Every field of AutogradCompilerCall, TensorArgs (private ones reached
//      like item 5) and LiftedIValueArgs, to empty a used AutogradCompilerCall
//      back to a fresh one's state while keeping its buffers; see [Note:
//      Recycled walk state]. The layouts are checked by static_assert, so a
//      field torch adds fails the build here rather than being left stale.
//  11. at::ThreadLocalState's private autograd_tls_, reached like item 5: the
//      grad mode a GraphTask runs its nodes with (create_graph), which the
//      engine hook sets alone instead of the task's whole thread-local
//      state; see [Note: The hook's grad mode].
//  12. The `dict` field of torch's Python hooks (PyFunctionTensorPreHook,
//      PyFunctionPreHook, PyFunctionPostHook, PyFunctionTensorPostAccGradHooks
//      in torch/csrc/autograd/python_hook.h), told apart by mangled type name
//      as in item 3, and RemovableHandle's ids as the dicts' keys (each
//      registration takes a new, larger id): a fingerprint of a node's hook
//      registries, and the largest id among its post hooks (which a
//      registration grows and a removal never does); see [Note: Hooks
//      changed while a graph runs].
// Internal but public in the headers, and used directly where needed. Every
// torch/csrc header another file of csrc/ includes is named here, with what it
// is included for (tests/test_torch_private.py fails on one that is not):
//   - torch/csrc/autograd/function.h, torch/csrc/autograd/graph_task.h
//     (ca_core.h): Node, and GraphTask's fields (exec_info_, dependencies_,
//     final_callbacks_, keep_graph_, thread_locals_);
//   - torch/csrc/dynamo/compiled_autograd.h (ca_core.h): the
//     compiled-autograd types (AutogradCompilerCall, CompiledNodeArgs,
//     SwapSavedVariables, TensorArgs);
//   - torch/csrc/autograd/engine.h (engine_hook.cpp, node_apply.cpp):
//     Engine::set_compiled_autograd and Engine::execute_with_graph_task;
//   - torch/csrc/autograd/input_buffer.h (engine_hook.cpp): the InputBuffer
//     the eager fallback starts its GraphTask with;
//   - torch/csrc/autograd/anomaly_mode.h (engine_hook.cpp):
//     AnomalyMode::is_enabled;
//   - torch/csrc/autograd/functions/accumulate_grad.h (graph_walk.cpp,
//     shadow_cache.cpp): AccumulateGrad, told apart by typeid;
//   - torch/csrc/autograd/python_function.h (describe.cpp, node_apply.cpp):
//     THPFunction's fields (saved_variables, compiled_autograd_symints,
//     is_variable_input, ...), read from a PyNode's Python object (a PyNode's
//     pyobj() is a THPFunction, reached by reinterpret_cast in describe.cpp);
//   - torch/csrc/Device.h, torch/csrc/DynamicTypes.h (describe.cpp,
//     node_apply.cpp): THPDevice_New and getTHPDtype, a tensor spec's Python
//     device and dtype;
//   - torch/csrc/utils/pybind.h, torch/csrc/utils/python_symnode.h
//     (node_apply.cpp): the pybind11 type casters for c10::SymInt and
//     c10::SymFloat, and torch::is_symint/is_symfloat, which turn the
//     torch.SymInt/SymFloat objects Dynamo passes while it traces into C++
//     values;
//   - torch/csrc/autograd/python_variable.h, torch/csrc/Exceptions.h
//     (tensor_caster.h): THPVariable_Wrap/Check/Unpack and python_error;
//   - torch/csrc/autograd/custom_function.h (testing_helpers.cpp): a C++
//     torch::autograd::Function for the tests.
// The Python side's private uses are listed in ca_runtime/_torch_interop.py.
#pragma once

#include <nanobind/nanobind.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/warnings.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <string>
#include <utility>
#include <vector>

// 1. Exported by libtorch_python; see the list above.
c10::impl::PyInterpreter* getPyInterpreter();

namespace ca::torch_private {

namespace nb = nanobind;

/// 2. A Python value as an IValue of `type` (torch::jit::toIValue).
c10::IValue to_ivalue(nb::handle obj, const c10::TypePtr& type);
/// 2. An IValue as a new Python object (torch::jit::toPyObject).
nb::object to_py_object(c10::IValue value);

/// 3. Whether `node` is a Python autograd.Function's node (PyNode).
bool is_py_node(const torch::autograd::Node& node);

/// 9. Whether `hook` is a Python grad_fn pre-hook (Node.register_prehook).
bool is_python_pre_hook(const torch::autograd::FunctionPreHook& hook);
/// 9. Whether `hook` is a Python grad_fn post-hook (Node.register_hook).
bool is_python_post_hook(const torch::autograd::FunctionPostHook& hook);

/// 4. Whether `e` is FunctionPreHook's "not implemented" compiled_args.
bool is_compiled_args_nyi(const c10::NotImplementedError& e);

/// 5. Puts back every value `swap` swapped in and did not restore; see
/// [Note: Restoring a failed swap].
void restore_swap_stashes(torch::dynamo::autograd::SwapSavedVariables& swap);

/// 7. The TensorArg of each tensor `args` lifted, by position (TensorArg::id
/// - 1, the index into args.inputs), found without reading args.inputs.
std::vector<torch::dynamo::autograd::TensorArg*> tensor_args_by_position(
    torch::dynamo::autograd::TensorArgs& args,
    size_t count);
/// 7. Each SavedVariable `args` lifted (those without unpack hooks) with the
/// position of its tensor in args.inputs, into `out`; false, with `out`
/// incomplete, if some lifted tensor is not a SavedVariable's.
bool lifted_saved_variables(
    const torch::dynamo::autograd::TensorArgs& args,
    std::vector<std::pair<torch::autograd::SavedVariable*, uint32_t>>& out);
/// 7. Resets the data of every SavedVariable whose tensor `args` lifted
/// (those without unpack hooks); allocates nothing (it runs on cache hits).
void reset_lifted_saved_variables(const torch::dynamo::autograd::TensorArgs& args);

/// 10. Empties `call` to the state of a fresh AutogradCompilerCall(STATIC),
/// keeping its vectors' and maps' storage.
void clear_compiler_call(torch::dynamo::autograd::AutogradCompilerCall& call);

/// 11. The grad mode `state` sets.
bool grad_mode_of(const at::ThreadLocalState& state);
/// 11. The grad mode `graph_task` runs its nodes with: create_graph.
bool task_grad_mode(const torch::autograd::GraphTask& graph_task);

/// 12. A fingerprint of every hook registered on `fn` (tensor pre-hooks,
/// retain_grad hooks, grad_fn pre/post hooks, an AccumulateGrad's
/// post-accumulate-grad hooks): it changes when a hook is registered or
/// removed there. 0 for a node without hooks. Needs the GIL.
uint64_t hook_registry_signature(const torch::autograd::Node& fn);

/// 12. The largest RemovableHandle id among `fn`'s Python post hooks (its
/// grad_fn post hooks, an AccumulateGrad's post-accumulate-grad hooks), or
/// 0: it grows when one is registered there and never when one is removed.
/// Needs the GIL.
uint64_t largest_post_hook_id(const torch::autograd::Node& fn);

/// 8. Re-emits the warnings `handler` held back (DelayWarningHandler::
/// replay_warnings, which libtorch does not export); returns how many.
size_t replay_warnings(torch::autograd::utils::DelayWarningHandler& handler);

/// 6. Adds `fn` to torch._dynamo.compiled_autograd.ops as `name`.
void add_torch_op(nb::handle ops, const std::string& name, nb::handle fn, bool is_traceable);

/// Registers _torch_private_checks(), the smoke tests' entry point.
void register_torch_private(nb::module_& m);

} // namespace ca::torch_private
