// tensor_caster.h — converts between torch.Tensor and at::Tensor at the
// nanobind boundary (None <-> undefined tensor) and between Python errors and
// torch's python_error.
#pragma once

#include <nanobind/nanobind.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace ca {

/// Throws the pending Python error as torch's python_error (which the engine's
/// caller restores), or returns `result` when it is not null.
inline PyObject* check_py(PyObject* result) {
  if (C10_UNLIKELY(result == nullptr)) {
    python_error err;
    err.persist();
    throw std::move(err);
  }
  return result;
}

/// Wraps a tensor as a new reference; undefined becomes None.
inline PyObject* wrap_tensor(const at::Tensor& t) {
  if (!t.defined()) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(t);
}

/// Unpacks a torch.Tensor or None; raises TypeError for anything else.
inline at::Tensor unpack_tensor(PyObject* obj, const char* what) {
  if (obj == Py_None) {
    return at::Tensor();
  }
  if (!THPVariable_Check(obj)) {
    throw nanobind::type_error(
        (std::string(what) + " must hold torch.Tensor or None, got " +
         Py_TYPE(obj)->tp_name)
            .c_str());
  }
  return THPVariable_Unpack(obj);
}

} // namespace ca

namespace nanobind::detail {

template <>
struct type_caster<at::Tensor> {
  NB_TYPE_CASTER(at::Tensor, const_name("torch.Tensor | None"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    PyObject* obj = src.ptr();
    if (obj == Py_None) {
      value = at::Tensor();
      return true;
    }
    if (!THPVariable_Check(obj)) {
      return false;
    }
    value = THPVariable_Unpack(obj);
    return true;
  }

  static handle from_cpp(
      const at::Tensor& t,
      rv_policy,
      cleanup_list*) noexcept {
    try {
      return ca::wrap_tensor(t);
    } catch (...) {
      PyErr_SetString(PyExc_RuntimeError, "ca_core: could not wrap a tensor");
      return handle();
    }
  }
};

} // namespace nanobind::detail
