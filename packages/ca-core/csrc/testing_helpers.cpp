// testing_helpers.cpp — C++ autograd Functions and a C++ tensor hook for the
// differential tests (ca_core._C._testing). They are what a user's C++
// extension brings: nothing of ca uses them. Built here, where torch's
// autograd headers are already parsed, instead of by torch.utils.cpp_extension
// in every fresh test environment (about 30 s of a 2-core machine).
#include "ca_core.h"
#include "tensor_caster.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace ca {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// Declared untraceable: its backward writes through data_ptr into the
/// incoming grad, so only an eager call on the real tensor gives eager's
/// result.
struct WritesThroughDataPtr
    : public torch::autograd::Function<WritesThroughDataPtr> {
  static constexpr bool is_traceable = false;
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x) {
    return x;
  }
  static variable_list backward(
      AutogradContext* /*ctx*/,
      variable_list grad_output) {
    *grad_output[0].data_ptr<float>() = 3.14f;
    return grad_output;
  }
};

/// Traceable, but its result depends on the grad's real layout (no guessed
/// metadata may stand in for the real grad).
struct BranchesOnContiguity
    : public torch::autograd::Function<BranchesOnContiguity> {
  static constexpr bool is_traceable = true;
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x) {
    return x;
  }
  static variable_list backward(
      AutogradContext* /*ctx*/,
      variable_list grad_output) {
    if (grad_output[0].is_contiguous()) {
      return {2 * grad_output[0]};
    }
    return {3 * grad_output[0]};
  }
};

/// x * w * scale with saved tensors and a saved double, traceable or not.
template <bool Traceable>
struct ScaledMul : public torch::autograd::Function<ScaledMul<Traceable>> {
  static constexpr bool is_traceable = Traceable;
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& w,
      double scale) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["scale"] = scale;
    return x * w * scale;
  }
  static variable_list backward(
      AutogradContext* ctx,
      variable_list grad_output) {
    auto saved = ctx->get_saved_variables();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto& g = grad_output[0];
    return {g * saved[1] * scale, g * saved[0] * scale, at::Tensor()};
  }
};

/// Calls of the hooks register_doubling_hook installed, process-wide.
std::atomic<int64_t> g_doubling_hook_calls{0};

} // namespace

void register_testing_helpers(nb::module_& m) {
  nb::module_ t = m.def_submodule(
      "_testing",
      "C++ autograd Functions and hooks for ca's own tests (as a user's C++ "
      "extension defines them); nothing of ca uses them.");
  t.def(
      "writes_through_data_ptr",
      [](const at::Tensor& x) { return WritesThroughDataPtr::apply(x); },
      nb::arg("x"));
  t.def(
      "branches_on_contiguity",
      [](const at::Tensor& x) { return BranchesOnContiguity::apply(x); },
      nb::arg("x"));
  t.def(
      "scaled_mul",
      [](const at::Tensor& x, const at::Tensor& w, double scale, bool traceable) {
        return traceable ? ScaledMul<true>::apply(x, w, scale)
                         : ScaledMul<false>::apply(x, w, scale);
      },
      nb::arg("x"),
      nb::arg("w"),
      nb::arg("scale"),
      nb::arg("traceable"));
  t.def(
      "register_doubling_hook",
      [](at::Tensor x) {
        x.register_hook([](const at::Tensor& grad) {
          ++g_doubling_hook_calls;
          return grad * 2;
        });
      },
      nb::arg("x"),
      "A C++ tensor hook on `x` that doubles the grad and counts its calls.");
  t.def("cpp_hook_calls", [] { return g_doubling_hook_calls.load(); });
}

} // namespace ca
