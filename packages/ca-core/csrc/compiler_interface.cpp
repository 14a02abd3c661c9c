// compiler_interface.cpp — ca_core's PyCompilerInterface: receives the
// functional backward each generated node binds, keeps them in a registry,
// and runs them (and CopySlices' prologue/epilogue) on the values given.
#include "ca_core.h"
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
      TORCH_CHECK_NOT_IMPLEMENTED(
          it != r.functionals.end(),
          "ca_core: the functional backward of ",
          fn_name,
          " was never bound in this process (another compiled autograd "
          "received it first)");
      fn = it->second.fn;
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
    // A saved tensor with an unpack hook, met while its node is applied
    // (always eagerly, behind a graph break): run the hook on its packed
    // data, exactly once per unpack as the eager engine does.
    NodeState* ns = applying_node();
    TORCH_INTERNAL_ASSERT(ns != nullptr && ns->collected && hook_id.has_value());
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
