// module.cpp — the ca_core._C extension module: registers each component.
#include "ca_core.h"
#include "tensor_caster.h"

NB_MODULE(_C, m) {
  m.doc() = "ca_core: compiled autograd engine hook, graph walk and cache.";
  m.attr("TORCH_VERSION") = CA_TORCH_VERSION;
  nanobind::register_exception_translator(
      [](const std::exception_ptr& p, void*) {
        try {
          std::rethrow_exception(p);
        } catch (python_error& e) {
          e.restore();
        }
      });
  ca::register_shadow_cache(m);
  ca::register_graph_walk(m);
  ca::register_describe(m);
  ca::register_node_apply(m);
  ca::register_compiler_interface(m);
  ca::register_engine_hook(m);
  ca::torch_private::register_torch_private(m);
  ca::register_testing_helpers(m);
}
