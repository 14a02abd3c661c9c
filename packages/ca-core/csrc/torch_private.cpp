// torch_private.cpp — the implementations behind torch_private.h (every
// private torch dependency, listed there) and the entry points of their
// smoke tests (tests/test_torch_private.py).
#include "torch_private.h"

#include "tensor_caster.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_hook.h>

#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstring>
#include <typeinfo>
#include <utility>

// 2. Exported by libtorch_python; see torch_private.h.
namespace torch::jit {
c10::IValue toIValue(
    pybind11::handle obj,
    const c10::TypePtr& type,
    std::optional<int32_t> N);
pybind11::object toPyObject(c10::IValue ivalue);
} // namespace torch::jit

namespace ca::torch_private {

using torch::autograd::Node;
using torch::dynamo::autograd::SwapSavedVariables;

c10::IValue to_ivalue(nb::handle obj, const c10::TypePtr& type) {
  return torch::jit::toIValue(pybind11::handle(obj.ptr()), type, std::nullopt);
}

nb::object to_py_object(c10::IValue value) {
  return nb::steal(torch::jit::toPyObject(std::move(value)).release().ptr());
}

bool is_py_node(const Node& node) {
  return std::strcmp(typeid(node).name(), "N5torch8autograd6PyNodeE") == 0;
}

bool is_python_pre_hook(const torch::autograd::FunctionPreHook& hook) {
  return std::strcmp(typeid(hook).name(), "N5torch8autograd17PyFunctionPreHookE") == 0;
}

bool is_python_post_hook(const torch::autograd::FunctionPostHook& hook) {
  return std::strcmp(typeid(hook).name(), "N5torch8autograd18PyFunctionPostHookE") == 0;
}

namespace {

/// 12. Folds `value` into `signature` (FNV-1a over 64-bit words).
void fold(uint64_t& signature, uint64_t value) {
  signature = (signature ^ value) * 0x100000001b3ULL;
}

/// 12. The dict's size and its largest key: RemovableHandle gives each
/// registration a new id larger than every earlier one, so an added hook
/// raises the largest key and a removed one lowers the size (a key that is
/// not an int is folded by its hash).
void fold_hook_dict(uint64_t& signature, PyObject* dict) {
  if (dict == nullptr || !PyDict_Check(dict)) {
    fold(signature, 0);
    return;
  }
  fold(signature, static_cast<uint64_t>(PyDict_GET_SIZE(dict)));
  Py_ssize_t pos = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  uint64_t largest = 0;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    uint64_t k = 0;
    if (PyLong_Check(key)) {
      k = PyLong_AsUnsignedLongLongMask(key);
    } else {
      const Py_hash_t hash = PyObject_Hash(key);
      if (hash == -1) {
        PyErr_Clear();
      }
      fold(signature, static_cast<uint64_t>(hash));
      continue;
    }
    largest = std::max(largest, k);
  }
  fold(signature, largest);
}

/// 12. The dict behind each kind of torch's Python hook, or null for any other hook.
PyObject* python_hook_dict(const torch::autograd::FunctionPreHook& hook) {
  if (std::strcmp(typeid(hook).name(), "N5torch8autograd23PyFunctionTensorPreHookE") == 0) {
    return static_cast<const torch::autograd::PyFunctionTensorPreHook&>(hook).dict;
  }
  return is_python_pre_hook(hook) ? static_cast<const torch::autograd::PyFunctionPreHook&>(hook).dict : nullptr;
}
PyObject* python_hook_dict(const torch::autograd::FunctionPostHook& hook) {
  return is_python_post_hook(hook) ? static_cast<const torch::autograd::PyFunctionPostHook&>(hook).dict : nullptr;
}
PyObject* python_hook_dict(const torch::autograd::PostAccumulateGradHook& hook) {
  return std::strcmp(typeid(hook).name(), "N5torch8autograd32PyFunctionTensorPostAccGradHooksE") == 0
      ? static_cast<const torch::autograd::PyFunctionTensorPostAccGradHooks&>(hook).dict
      : nullptr;
}

/// 12. Folds one hook: its Python dict's contents, or a C++ hook's identity.
template <typename Hook>
void fold_hook(uint64_t& signature, const Hook& hook) {
  if (PyObject* dict = python_hook_dict(hook)) {
    fold_hook_dict(signature, dict);
  } else {
    fold(signature, reinterpret_cast<uintptr_t>(&hook));
  }
}

/// 12. Folds a list of hooks: their number, then each.
template <typename Hooks>
void fold_hooks(uint64_t& signature, const Hooks& hooks) {
  fold(signature, hooks.size());
  for (const auto& hook : hooks) {
    fold_hook(signature, *hook);
  }
}

} // namespace

uint64_t hook_registry_signature(const Node& fn) {
  // A const Node's hook vectors are reached through its non-const accessors.
  auto& node = const_cast<Node&>(fn);
  torch::autograd::PostAccumulateGradHook* post_acc = nullptr;
  if (typeid(fn) == typeid(torch::autograd::AccumulateGrad)) {
    const auto& variable = static_cast<const torch::autograd::AccumulateGrad&>(fn).variable;
    if (variable.defined()) {
      post_acc = torch::autograd::impl::post_acc_grad_hooks(variable).get();
    }
  }
  if (node.tensor_pre_hooks().empty() && node.retains_grad_hooks().empty() &&
      node.pre_hooks().empty() && node.post_hooks().empty() && post_acc == nullptr) {
    return 0;
  }
  uint64_t signature = 0xcbf29ce484222325ULL;
  fold_hooks(signature, node.tensor_pre_hooks());
  fold(signature, node.retains_grad_hooks().size());
  fold_hooks(signature, node.pre_hooks());
  fold_hooks(signature, node.post_hooks());
  if (post_acc != nullptr) {
    fold_hook(signature, *post_acc);
  }
  return signature == 0 ? 1 : signature;
}

uint64_t largest_post_hook_id(const Node& fn) {
  auto& node = const_cast<Node&>(fn);
  uint64_t largest = 0;
  auto largest_key = [&largest](PyObject* dict) {
    if (dict == nullptr || !PyDict_Check(dict)) {
      return;
    }
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(dict, &pos, &key, &value)) {
      if (PyLong_Check(key)) {
        largest = std::max(largest, static_cast<uint64_t>(PyLong_AsUnsignedLongLongMask(key)));
      }
    }
  };
  for (const auto& hook : node.post_hooks()) {
    largest_key(python_hook_dict(*hook));
  }
  if (typeid(fn) == typeid(torch::autograd::AccumulateGrad)) {
    const auto& variable = static_cast<const torch::autograd::AccumulateGrad&>(fn).variable;
    if (variable.defined()) {
      if (auto* post_acc = torch::autograd::impl::post_acc_grad_hooks(variable).get()) {
        largest_key(python_hook_dict(*post_acc));
      }
    }
  }
  return largest;
}

bool is_compiled_args_nyi(const c10::NotImplementedError& e) {
  return std::string_view(e.what_without_backtrace()).rfind("compiled_args nyi", 0) == 0;
}

/*
[Note: Restoring a failed swap]
A generated node's apply_with_saved calls SwapSavedVariables::before() on
each saved value, runs its backward, then after() on each: plain calls, not
RAII. When the backward throws in between -- typically while Dynamo runs it
on FakeTensors and an op rejects them, after which Dynamo graph-breaks and
runs it for real -- the node is left holding the swapped-in values
(FakeTensors) for good: a retained graph's next backward, or the eager
fallback, would then compute with them. torch keeps the values to restore in
SwapSavedVariables' private stashes; restore_swap_stashes reaches them
through the one access route C++ leaves to private members (an explicit
template instantiation may name them) and puts every value back.
*/
namespace {

template <typename Tag, auto Member>
struct PrivateMember {
  friend auto member_of(Tag) {
    return Member;
  }
};
/// Names the private member CLASS::MEMBER as `obj.*member_of(TAG{})`.
#define CA_PRIVATE_MEMBER(TAG, CLASS, MEMBER) \
  struct TAG {                                \
    friend auto member_of(TAG);               \
  };                                          \
  template struct PrivateMember<TAG, &CLASS::MEMBER>;
CA_PRIVATE_MEMBER(StashedVariables, SwapSavedVariables, stashed_variables)
CA_PRIVATE_MEMBER(StashedTensors, SwapSavedVariables, stashed_tensors)
CA_PRIVATE_MEMBER(StashedSymInts, SwapSavedVariables, stashed_symints)
CA_PRIVATE_MEMBER(StashedIValues, SwapSavedVariables, stashed_ivalues)

using torch::dynamo::autograd::TensorArg;
using torch::dynamo::autograd::TensorArgs;
CA_PRIVATE_MEMBER(TensorArgsArgs, TensorArgs, _args)
CA_PRIVATE_MEMBER(TensorArgsSavedVariables, TensorArgs, _saved_variables)
CA_PRIVATE_MEMBER(TensorArgsProxies, TensorArgs, _saved_variables_proxies)
CA_PRIVATE_MEMBER(TensorArgsUndefined, TensorArgs, _undefined)
CA_PRIVATE_MEMBER(TensorArgsNextId, TensorArgs, _next_id)

using torch::autograd::utils::DelayWarningHandler;
CA_PRIVATE_MEMBER(HeldWarnings, DelayWarningHandler, warnings_)
CA_PRIVATE_MEMBER(HeldWarningsMutex, DelayWarningHandler, mutex_)
CA_PRIVATE_MEMBER(TaskAutogradState, at::ThreadLocalState, autograd_tls_)
#undef CA_PRIVATE_MEMBER

template <typename Stash>
void put_back(Stash& stash) {
  for (auto& [key, stashed] : stash) {
    using T = std::remove_const_t<std::remove_pointer_t<std::remove_cvref_t<decltype(key)>>>;
    *const_cast<T*>(key) = std::move(stashed.prior_value);
  }
  stash.clear();
}

/// A FunctionPreHook without compiled_args, as a user's C++ hook is.
struct HookWithoutCompiledArgs : torch::autograd::FunctionPreHook {
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    return grads;
  }
};

} // namespace

void restore_swap_stashes(SwapSavedVariables& swap) {
  put_back(swap.*member_of(StashedVariables{}));
  put_back(swap.*member_of(StashedTensors{}));
  put_back(swap.*member_of(StashedSymInts{}));
  put_back(swap.*member_of(StashedIValues{}));
}

std::vector<TensorArg*> tensor_args_by_position(TensorArgs& args, size_t count) {
  std::vector<TensorArg*> out(count, nullptr);
  for (auto& [_, arg] : args.*member_of(TensorArgsArgs{})) {
    if (arg.defined() && arg.index() < count) {
      out[arg.index()] = &arg;
    }
  }
  return out;
}

bool lifted_saved_variables(
    const TensorArgs& args,
    std::vector<std::pair<torch::autograd::SavedVariable*, uint32_t>>& out) {
  out.clear();
  const size_t count = args.inputs.size();
  size_t covered = 0;
  for (const auto& [saved, arg] : args.*member_of(TensorArgsSavedVariables{})) {
    if (!arg->defined()) {
      continue;  // an undefined saved tensor: nothing to put back
    }
    const uint32_t position = arg->index();
    bool first = true;
    for (const auto& [_, seen] : out) {
      first = first && seen != position;
    }
    covered += first ? 1 : 0;
    out.emplace_back(const_cast<torch::autograd::SavedVariable*>(saved), position);
  }
  return covered == count;
}

void reset_lifted_saved_variables(const TensorArgs& args) {
  for (const auto& [saved, _] : args.*member_of(TensorArgsSavedVariables{})) {
    const_cast<torch::autograd::SavedVariable*>(saved)->reset_data();
  }
}

// 10. torch 2.13's layouts: a field added or removed changes a size, and then
// clear_compiler_call must be checked against the header again.
static_assert(sizeof(TensorArgs) == 248, "TensorArgs changed: check clear_compiler_call");
static_assert(
    sizeof(torch::dynamo::autograd::LiftedIValueArgs) == 64,
    "LiftedIValueArgs changed: check clear_compiler_call");
static_assert(
    sizeof(torch::dynamo::autograd::AutogradCompilerCall) == 680,
    "AutogradCompilerCall changed: check clear_compiler_call");

void clear_compiler_call(torch::dynamo::autograd::AutogradCompilerCall& call) {
  TORCH_INTERNAL_ASSERT(call.default_dyn_type == torch::dynamo::autograd::SizeInput::STATIC);
  call.active_node_call_idx.reset();
  TensorArgs& args = call.tensor_args;
  args.inputs.clear();
  args.input_origins.clear();
  (args.*member_of(TensorArgsArgs{})).clear();
  (args.*member_of(TensorArgsSavedVariables{})).clear();
  (args.*member_of(TensorArgsProxies{})).clear();
  args.*member_of(TensorArgsUndefined{}) = TensorArg();
  args.*member_of(TensorArgsNextId{}) = 1;
  call.all_size_inputs.clear();
  call.lifted_ivalue_args.args.clear();
  call.lifted_ivalue_args.next = 0;
  call.lifted_ivalue_args.args_origins.clear();
  call.dyn_size_inputs.clear();
  call.hooks.clear();
  call.cpp_tensor_pre_hooks.clear();
  call.packed_inputs.clear();
  call.node_calls.clear();
  call.size_input_origins.clear();
  call.sv_to_hooks.clear();
  call.pynode_objs.clear();
}

bool grad_mode_of(const at::ThreadLocalState& state) {
  return (state.*member_of(TaskAutogradState{})).get_grad_mode();
}

bool task_grad_mode(const torch::autograd::GraphTask& graph_task) {
  return grad_mode_of(graph_task.thread_locals_);
}

size_t replay_warnings(DelayWarningHandler& handler) {
  std::lock_guard<std::mutex> lock(handler.*member_of(HeldWarningsMutex{}));
  const auto& held = handler.*member_of(HeldWarnings{});
  for (const auto& warning : held) {
    c10::warn(warning);
  }
  return held.size();
}

void add_torch_op(nb::handle ops, const std::string& name, nb::handle fn, bool is_traceable) {
  // OpNamespace.add(name, fn, is_custom_function, is_traceable)
  ops.attr("add")(name, fn, false, is_traceable);
}

void register_torch_private(nb::module_& m) {
  // Smoke tests of torch_private.h, one per dependency; underscored: not API.
  m.def(
      "_private_py_interpreter_roundtrip",
      [](nb::handle obj) {
        c10::SafePyObject safe(obj.inc_ref().ptr(), getPyInterpreter());
        return nb::borrow(safe.ptr(getPyInterpreter()));
      },
      "1. A Python object through c10::SafePyObject and getPyInterpreter().");
  m.def(
      "_private_ivalue_roundtrip",
      [](nb::handle obj, const std::string& kind) {
        c10::TypePtr type = kind == "int" ? c10::TypePtr(c10::IntType::get())
            : kind == "float"             ? c10::TypePtr(c10::FloatType::get())
            : kind == "int_list"          ? c10::TypePtr(c10::ListType::ofInts())
                                          : c10::TypePtr(c10::TensorType::get());
        return to_py_object(to_ivalue(obj, type));
      },
      "2. A value through toIValue and toPyObject ('int', 'float', 'int_list', 'tensor').");
  m.def(
      "_private_is_py_node",
      [](const at::Tensor& t) {
        TORCH_CHECK(t.defined() && t.grad_fn(), "needs a tensor with a grad_fn");
        return is_py_node(*t.grad_fn());
      },
      "3. Whether a tensor's grad_fn is a Python Function's PyNode.");
  m.def(
      "_private_grad_fn_hooks_are_python",
      [](const at::Tensor& t) {
        TORCH_CHECK(t.defined() && t.grad_fn(), "needs a tensor with a grad_fn");
        const auto& fn = *t.grad_fn();
        TORCH_CHECK(!fn.pre_hooks().empty() && !fn.post_hooks().empty(), "needs pre and post hooks");
        for (const auto& h : fn.pre_hooks()) {
          if (!is_python_pre_hook(*h)) {
            return false;
          }
        }
        for (const auto& h : fn.post_hooks()) {
          if (!is_python_post_hook(*h)) {
            return false;
          }
        }
        return true;
      },
      "9. Whether a grad_fn's hooks are all recognised as Python's.");
  m.def(
      "_private_hook_registry_signature",
      [](const at::Tensor& t) {
        TORCH_CHECK(t.defined(), "needs a tensor");
        if (t.grad_fn()) {
          return hook_registry_signature(*t.grad_fn());
        }
        auto accumulator = torch::autograd::impl::grad_accumulator(t);
        TORCH_CHECK(accumulator, "needs a tensor that requires grad");
        return hook_registry_signature(*accumulator);
      },
      "12. The hook fingerprint of a tensor's grad_fn (of its grad accumulator for a leaf).");
  m.def(
      "_private_largest_post_hook_id",
      [](const at::Tensor& t) {
        TORCH_CHECK(t.defined(), "needs a tensor");
        if (t.grad_fn()) {
          return largest_post_hook_id(*t.grad_fn());
        }
        auto accumulator = torch::autograd::impl::grad_accumulator(t);
        TORCH_CHECK(accumulator, "needs a tensor that requires grad");
        return largest_post_hook_id(*accumulator);
      },
      "12. The largest RemovableHandle id of a tensor's grad_fn's Python post hooks (its grad accumulator's for a "
      "leaf, post-accumulate-grad hooks included).");
  m.def(
      "_private_compiled_args_nyi",
      [](const at::Tensor& t) {
        TORCH_CHECK(t.defined() && t.grad_fn(), "needs a tensor with a grad_fn");
        torch::dynamo::autograd::AutogradCompilerCall collected(
            torch::dynamo::autograd::SizeInput::STATIC);
        torch::dynamo::autograd::NodeCall call(0, t.grad_fn());
        torch::dynamo::autograd::CompiledNodeArgs args(collected, call);
        HookWithoutCompiledArgs hook;
        try {
          hook.compiled_args(args);
        } catch (const c10::NotImplementedError& e) {
          return is_compiled_args_nyi(e);
        }
        return false;
      },
      "4. Whether a hook without compiled_args is recognised as such.");
  m.def(
      "_private_restore_swap_stashes",
      [](const at::Tensor& t, const at::Tensor& proxy) {
        TORCH_CHECK(t.defined() && t.grad_fn(), "needs a tensor with a grad_fn");
        torch::dynamo::autograd::AutogradCompilerCall collected(
            torch::dynamo::autograd::SizeInput::STATIC);
        collected.tensor_args.add(t).proxy_tensor = proxy;
        torch::dynamo::autograd::NodeCall call(0, t.grad_fn());
        torch::dynamo::autograd::TraceState trace({}, 0);
        SwapSavedVariables swap(collected, trace, nullptr, call);
        at::Tensor saved = t;
        swap.before(saved);
        const bool swapped = saved.is_same(proxy);
        restore_swap_stashes(swap);
        return swapped && saved.is_same(t);
      },
      "5. A swapped-in value put back from SwapSavedVariables' private stash.");
  m.def(
      "_private_task_grad_mode",
      [](bool create_graph) {
        // As GraphTask's constructor makes its thread_locals_ (a GraphTask
        // itself cannot be made here: its warning handler's vtable is not
        // exported). The ambient mode is the opposite: the state's own is read.
        c10::AutoGradMode ambient(!create_graph);
        at::ThreadLocalState state;
        state.set_grad_mode(create_graph);
        return grad_mode_of(state);
      },
      nb::arg("create_graph"),
      "11. The grad mode read from a ThreadLocalState whose grad mode was set to `create_graph`.");
  m.def(
      "_private_tensor_args",
      [](const at::Tensor& a, const at::Tensor& b) {
        TORCH_CHECK(b.defined() && b.grad_fn(), "needs a tensor with a grad_fn");
        torch::dynamo::autograd::AutogradCompilerCall collected(
            torch::dynamo::autograd::SizeInput::STATIC);
        TensorArgs& args = collected.tensor_args;
        args.add(a);
        torch::autograd::SavedVariable saved(b, false);
        args.add(saved, b.grad_fn());
        const auto by_position = tensor_args_by_position(args, 2);
        const bool found = by_position[0] == &args.lookup(a) && by_position[1] == &args.lookup(b);
        // `a` is a plain tensor, not a SavedVariable's: the list is incomplete.
        std::vector<std::pair<torch::autograd::SavedVariable*, uint32_t>> slots;
        const bool incomplete = !lifted_saved_variables(args, slots);
        const bool listed = slots.size() == 1 && slots[0].first == &saved && slots[0].second == 1;
        reset_lifted_saved_variables(args);
        bool reset = false;
        try {
          reset = !saved.unpack().defined();
        } catch (const c10::Error&) {
          reset = true; // "Trying to backward through the graph a second time"
        }
        return found && incomplete && listed && reset && b.defined();
      },
      "7. TensorArgs' private maps: TensorArgs by position, lifted SavedVariables.");
  m.def(
      "_private_clear_compiler_call",
      [](const at::Tensor& a, const at::Tensor& b) {
        TORCH_CHECK(b.defined() && b.grad_fn(), "needs a tensor with a grad_fn");
        using torch::dynamo::autograd::AutogradCompilerCall;
        AutogradCompilerCall used(torch::dynamo::autograd::SizeInput::STATIC);
        used.set_active_node_call_idx(3);
        used.tensor_args.add(a);
        torch::autograd::SavedVariable saved(b, false);
        used.tensor_args.add(saved, b.grad_fn());
        used.add_size_input(c10::SymInt(5));
        used.dyn_size_inputs.push_back(5);
        used.node_calls.lookup(b.grad_fn());
        used.hooks.emplace_back(nb::none().inc_ref().ptr(), getPyInterpreter());
        clear_compiler_call(used);
        // As a fresh one: nothing held, ids from 1 again, the tensor `a` new.
        const bool empty = !used.active_node_call_idx && used.tensor_args.inputs.empty() &&
            used.all_size_inputs.empty() && used.dyn_size_inputs.empty() && used.hooks.empty() &&
            used.node_calls.empty() && used.lifted_ivalue_args.args.empty() && used.sv_to_hooks.empty() &&
            used.pynode_objs.empty() && tensor_args_by_position(used.tensor_args, 2)[0] == nullptr;
        std::vector<std::pair<torch::autograd::SavedVariable*, uint32_t>> slots;
        const bool no_saved = lifted_saved_variables(used.tensor_args, slots) && slots.empty();
        const bool fresh_ids = used.tensor_args.add(b).id == 1 && used.tensor_args.add(a).id == 2 &&
            used.tensor_args.inputs.size() == 2 && !used.tensor_args.lookup(at::Tensor()).defined();
        return empty && no_saved && fresh_ids;
      },
      "10. A used AutogradCompilerCall emptied to a fresh one's state.");
  m.def(
      "_private_add_torch_op",
      [](nb::handle ops, const std::string& name, nb::handle fn) { add_torch_op(ops, name, fn, true); },
      "6. Adds `fn` to an OpNamespace as torch's compiled autograd does.");
}

} // namespace ca::torch_private
