// compiler_interface.cpp — ca_core's PyCompilerInterface: receives the
// functional backward each generated node binds, keeps them in a registry,
// and runs them (and CopySlices' prologue/epilogue) on the values given.
#include "ca_core.h"
#include "torch_private.h"
#include "tensor_caster.h"

#include <ATen/ATen.h>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>

namespace ca {

using torch::autograd::functional_apply_t;
using torch::autograd::ivalue_list;
using torch::dynamo::autograd::PyCompilerGuard;
using torch::dynamo::autograd::PyCompilerInterface;

/*
[Note: Functional registry]
In torch 2.13 a generated node's apply_with_saved does not compute the grad
itself: the first time per process it hands its functional backward to the
installed PyCompilerInterface (bind_function), and on every call it asks the
interface to run it (call_function(name, grads, packed_args)). The registry
below keeps every functional we were handed, by name. CppNode (C++
torch::autograd::Function) binds on every call, so its entry is refreshed each
time, together with its is_traceable flag.

[Note: Sharing functionals with torch]
A generated node binds its functional only once per process, to whichever
compiled autograd asks first. So that torch's built-in compiled autograd
(torch._dynamo.compiled_autograd) and ours work in one process in either
order, both ways are bridged:
  - when we are handed a functional, we also add it to torch's `ops`
    namespace as a Python callable fn(grads, *packed_args) (the convention of
    torch's own entries), converting the Python args back to IValues with
    the bound schema;
  - when a functional was bound to torch first, call_function finds it in
    torch's `ops` and calls it with the packed args converted to Python.
CppNode functionals are not shared: they bind on every call anyway.
*/

namespace {

/// One functional backward handed to us by bind_function.
struct Functional {
  /// The node's backward as a function of (grads, packed saved values).
  functional_apply_t fn;
  /// Types of the packed saved values.
  std::vector<at::TypePtr> schema;
  /// Bound by a C++ torch::autograd::Function (CppNode).
  bool is_custom_function = false;
  /// False for a CppNode whose T::is_traceable is false.
  bool is_traceable = true;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<std::string, Functional> functionals;
};

Registry& registry() {
  static Registry* r = new Registry(); // leaked: used until process exit
  return *r;
}

/// torch._dynamo.compiled_autograd.ops, or None if it cannot be imported.
nb::object torch_ops() {
  try {
    return nb::module_::import_("torch._dynamo.compiled_autograd").attr("ops");
  } catch (const nb::python_error&) {
    return nb::none();
  }
}

/// Adds one of our functionals to torch's ops; see [Note: Sharing functionals with torch].
void share_with_torch(
    const std::string& name,
    const functional_apply_t& fn,
    const std::vector<at::TypePtr>& schema,
    bool is_traceable) {
  nb::object ops = torch_ops();
  if (ops.is_none() || nb::hasattr(ops, name.c_str())) {
    return;
  }
  nb::object callable = nb::cpp_function(
      [fn, schema](nb::args args) -> variable_list {
        TORCH_CHECK(
            nb::len(args) == schema.size() + 1,
            "ca_core: shared functional expects grads and ",
            schema.size(),
            " packed args, got ",
            nb::len(args));
        variable_list grads;
        for (nb::handle g : nb::borrow<nb::sequence>(args[0])) {
          grads.push_back(unpack_tensor(g.ptr(), "grads"));
        }
        ivalue_list packed;
        packed.reserve(schema.size());
        for (size_t i = 0; i < schema.size(); ++i) {
          packed.push_back(torch_private::to_ivalue(args[i + 1], schema[i]));
        }
        return fn(grads, packed);
      });
  torch_private::add_torch_op(ops, name, callable, is_traceable);
}

/// Runs a functional that was bound to torch's compiled autograd first.
variable_list call_torch_functional(
    const std::string& name,
    const variable_list& inputs,
    const ivalue_list& packed_args) {
  nb::object ops = torch_ops();
  TORCH_CHECK_NOT_IMPLEMENTED(
      !ops.is_none() && nb::hasattr(ops, name.c_str()),
      "ca_core: the functional backward of ",
      name,
      " was never bound in this process");
  nb::list args;
  nb::list grads;
  for (const auto& t : inputs) {
    grads.append(nb::steal(wrap_tensor(t)));
  }
  args.append(grads);
  for (const auto& iv : packed_args) {
    args.append(torch_private::to_py_object(iv));
  }
  nb::object result = ops.attr(name.c_str())(*nb::tuple(args));
  variable_list out;
  for (nb::handle t : nb::borrow<nb::sequence>(result)) {
    out.push_back(unpack_tensor(t.ptr(), "a functional's result"));
  }
  return out;
}

/*
[Note: Unpack hooks in the graph]
A saved tensor with an unpack hook (saved_tensors_hooks, non-reentrant
checkpoint, CPU offload) is not lifted: torch's collection keeps the hook and
its packed data (AutogradCompilerCall::sv_to_hooks, packed_inputs), and
SwapSavedVariables asks call_unpack for the tensor when the node runs. The
graph unpacks instead: the packed data reach it through the `hooks` input
(after each node's own hooks, in packed-input order), ca_runtime's capture
emits `unpack_hook(packed)` where eager unpacks (just before the node), so
Dynamo traces the hook like any other, and passes the results to apply_node
after the node's lifted tensors. While the node runs, NodeState::unpacked
points at them and call_unpack answers from there. A hook Dynamo would skip
(checkpoint's own) is called behind a graph break of its own, the node itself
still traced. Without unpacked values (a node applied whole behind a graph
break, e.g. a Python Function's) call_unpack runs the hook itself, once per
unpack as eager does; the traceability probe never runs one.
*/

class CaCompilerInterface final : public PyCompilerInterface {
 public:
  std::string bind_function(
      PyObject* /*py_compiler*/,
      const std::string& fn_name,
      functional_apply_t fn,
      std::vector<at::TypePtr> packed_args_schema,
      bool is_custom_function,
      bool is_traceable) const override {
    if (TraceabilityProbe* probe = active_probe()) {
      probe->is_traceable = is_traceable;
    }
    if (!is_custom_function) {
      share_with_torch(fn_name, fn, packed_args_schema, is_traceable);
    }
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.functionals.insert_or_assign(
        fn_name,
        Functional{
            std::move(fn),
            std::move(packed_args_schema),
            is_custom_function,
            is_traceable});
    return fn_name;
  }

  variable_list call_function(
      PyObject* /*py_compiler*/,
      const char* /*method_name*/,
      const std::string& fn_name,
      const variable_list& inputs,
      const ivalue_list& packed_args,
      const c10::IValue& /*output_metadata*/) const override {
    if (active_probe() != nullptr) {
      return {};
    }
    functional_apply_t fn;
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      auto it = r.functionals.find(fn_name);
      if (it != r.functionals.end()) {
        fn = it->second.fn;
      }
    }
    if (!fn) {
      // Bound to torch's compiled autograd before we ran; see
      // [Note: Sharing functionals with torch].
      return call_torch_functional(fn_name, inputs, packed_args);
    }
    return fn(inputs, packed_args);
  }

  variable_list call_copy_slices_prologue(
      PyObject* /*py_compiler*/,
      const variable_list& inputs,
      const at::TensorGeometry& base,
      const at::TensorGeometry& view) const override {
    // The grad of the base, with the view's region carved out of a copy.
    const at::Tensor& grad = inputs.at(0);
    at::Tensor result =
        grad.new_empty_strided_symint(base.sym_sizes(), base.sym_strides());
    result.copy_(grad);
    at::Tensor grad_slice = result.as_strided_symint(
        view.sym_sizes(),
        view.sym_strides(),
        view.sym_storage_offset() - base.sym_storage_offset());
    at::Tensor contiguous_slice = grad_slice.clone(at::MemoryFormat::Contiguous);
    return {std::move(result), std::move(grad_slice), std::move(contiguous_slice)};
  }

  variable_list call_copy_slices_epilogue(
      PyObject* /*py_compiler*/,
      const std::vector<bool>& needs_input_grad,
      const at::Tensor& result,
      const variable_list& res,
      const at::Tensor& grad_slice) const override {
    variable_list grad_inputs(needs_input_grad.size());
    for (size_t i = 0; i < needs_input_grad.size(); ++i) {
      if (!needs_input_grad[i] || !res.at(i).defined()) {
        continue;
      }
      if (i == 0) {
        // The view's grad goes back into the base's grad in place.
        at::Tensor slice = grad_slice;
        slice.copy_(res[0]);
        grad_inputs[0] = result;
      } else {
        grad_inputs[i] = res[i];
      }
    }
    return grad_inputs;
  }

  at::Tensor call_unpack(
      PyObject* /*py_compiler*/,
      std::optional<size_t> hook_id,
      size_t hook_input_id) const override {
    // See [Note: Unpack hooks in the graph].
    NodeState* ns = applying_node();
    TORCH_INTERNAL_ASSERT(ns != nullptr && ns->collected && hook_id.has_value());
    if (ns->unpacked != nullptr) {
      return ns->unpacked->at(hook_input_id);
    }
    if (active_probe() != nullptr) {
      // probe_traceable computes nothing: never run a user hook for it.
      return at::Tensor();
    }
    // No unpacked values given (apply_with_saved without them): run the hook
    // on its packed data, once per unpack as the eager engine does.
    const AutogradCompilerCall& collected = *ns->collected;
    PyObject* hook = py_object(collected.hooks.at(*hook_id));
    PyObject* packed = py_object(collected.packed_inputs.at(hook_input_id));
    nb::gil_scoped_acquire gil;
    nb::object result = nb::steal(check_py(PyObject_CallOneArg(hook, packed)));
    return unpack_tensor(result.ptr(), "the result of a saved-tensor unpack hook");
  }

  at::Tensor call_accumulate_grad(
      PyObject* /*py_compiler*/,
      const at::Tensor& /*variable*/,
      const at::Tensor& /*variable_grad*/,
      const at::Tensor& /*grad*/,
      bool /*has_post_hooks*/) const override {
    // AccumulateGrad runs outside the captured graph (engine_hook.cpp).
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "ca_core: AccumulateGrad is applied outside the graph");
  }
};

thread_local TraceabilityProbe* t_probe = nullptr;

} // namespace

TraceabilityProbe::TraceabilityProbe() : prior_(std::exchange(t_probe, this)) {}
TraceabilityProbe::~TraceabilityProbe() {
  t_probe = prior_;
}
TraceabilityProbe* active_probe() {
  return t_probe;
}

/*
[Note: One compiler interface for all threads]
PyCompilerGuard asserts that no interface is installed when it installs one.
A node applied on one thread can run Python (a Function's backward, an unpack
hook) during which another thread applies a node of its own backward, so
per-call guards would collide. Our interface keeps no state of its own (what
varies per call is thread-local: the probe, the applying node), so all scopes
share one installation: the first to open installs it, the last to close
removes it.
*/
namespace {
std::mutex g_interface_mutex;
size_t g_interface_users = 0;
std::unique_ptr<PyCompilerGuard> g_interface_guard;
} // namespace

InterfaceScope::InterfaceScope() {
  std::lock_guard<std::mutex> lock(g_interface_mutex);
  if (g_interface_users == 0) {
    g_interface_guard = std::make_unique<PyCompilerGuard>(
        std::make_unique<CaCompilerInterface>());
  }
  ++g_interface_users;
}

InterfaceScope::~InterfaceScope() {
  std::lock_guard<std::mutex> lock(g_interface_mutex);
  if (--g_interface_users == 0) {
    g_interface_guard.reset();
  }
}

void register_compiler_interface(nb::module_& m) {
  m.def(
      "bound_functionals",
      []() {
        auto& r = registry();
        std::lock_guard<std::mutex> lock(r.mutex);
        std::vector<std::string> names;
        names.reserve(r.functionals.size());
        for (const auto& [name, _] : r.functionals) {
          names.push_back(name);
        }
        std::sort(names.begin(), names.end());
        return names;
      },
      "Names of the functional backwards bound to ca_core in this process.");
}

} // namespace ca
