// functions.cpp — C++ autograd Functions and hooks the differential tests
// build with torch.utils.cpp_extension (see conftest.py's cpp_ext fixture).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/python.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Declared untraceable: its backward writes through data_ptr into the
// incoming grad, so only an eager call on the real tensor gives eager's
// result.
struct WritesThroughDataPtr : public torch::autograd::Function<WritesThroughDataPtr> {
  static constexpr bool is_traceable = false;
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x) {
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    *grad_output[0].data_ptr<float>() = 3.14f;
    return grad_output;
  }
};

// Traceable, but its result depends on the grad's real layout (no guessed
// metadata may stand in for the real grad).
struct BranchesOnContiguity : public torch::autograd::Function<BranchesOnContiguity> {
  static constexpr bool is_traceable = true;
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x) {
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    if (grad_output[0].is_contiguous()) {
      return {2 * grad_output[0]};
    }
    return {3 * grad_output[0]};
  }
};

// x * w with saved tensors and a saved double, traceable or not.
template <bool Traceable>
struct ScaledMul : public torch::autograd::Function<ScaledMul<Traceable>> {
  static constexpr bool is_traceable = Traceable;
  static torch::Tensor forward(
      AutogradContext* ctx,
      const torch::Tensor& x,
      const torch::Tensor& w,
      double scale) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["scale"] = scale;
    return x * w * scale;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_output) {
    auto saved = ctx->get_saved_variables();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto& g = grad_output[0];
    return {g * saved[1] * scale, g * saved[0] * scale, torch::Tensor()};
  }
};

static int64_t g_cpp_hook_calls = 0;

torch::Tensor writes_through_data_ptr(const torch::Tensor& x) {
  return WritesThroughDataPtr::apply(x);
}
torch::Tensor branches_on_contiguity(const torch::Tensor& x) {
  return BranchesOnContiguity::apply(x);
}
torch::Tensor scaled_mul(const torch::Tensor& x, const torch::Tensor& w, double scale, bool traceable) {
  return traceable ? ScaledMul<true>::apply(x, w, scale) : ScaledMul<false>::apply(x, w, scale);
}
// A C++ tensor hook that doubles the grad and counts its calls.
void register_doubling_hook(torch::Tensor t) {
  t.register_hook([](torch::Tensor grad) {
    ++g_cpp_hook_calls;
    return grad * 2;
  });
}
int64_t cpp_hook_calls() {
  return g_cpp_hook_calls;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("writes_through_data_ptr", &writes_through_data_ptr);
  m.def("branches_on_contiguity", &branches_on_contiguity);
  m.def("scaled_mul", &scaled_mul);
  m.def("register_doubling_hook", &register_doubling_hook);
  m.def("cpp_hook_calls", &cpp_hook_calls);
}
