// node_apply.cpp — runs one node of the active backward with explicit saved
// values (apply_with_saved) and checks its outputs (validate_outputs); these
// are the calls a captured FX graph is made of. Swapping and applying only:
// what capture() is told about a backward is describe.cpp's.
#include "ca_core.h"

#include <unordered_map>
#include "torch_private.h"
#include "tensor_caster.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/python_symnode.h>

#include <cstring>
#include <memory>
#include <tuple>
#include <typeinfo>

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

namespace ca {

using torch::dynamo::autograd::SwapSavedVariables;
using torch::dynamo::autograd::TraceState;

namespace {

BackwardState& require_active(uint32_t node_idx, const char* fn) {
  BackwardState* state = active_backward();
  if (state == nullptr) {
    throw std::runtime_error(
        std::string(fn) +
        ": no compiled backward is running on this thread (it is only valid "
        "inside a graph captured by ca_runtime)");
  }
  if (node_idx >= state->nodes.size() || !state->nodes[node_idx].collected) {
    throw nb::value_error(
        (std::string(fn) + ": node_idx " + std::to_string(node_idx) +
         " is not a collected node of the running backward")
            .c_str());
  }
  return *state;
}

variable_list unpack_list(nb::handle seq, const char* what) {
  variable_list out;
  if (seq.is_none()) {
    return out;
  }
  nb::sequence items = nb::borrow<nb::sequence>(seq);
  const size_t n = nb::len(items);
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.emplace_back(unpack_tensor(items[i].ptr(), what));
  }
  return out;
}

/// Sizes for SwapSavedVariables: None (or a missing list) keeps the node's own.
std::vector<std::optional<c10::SymInt>> unpack_sizes(
    nb::handle seq,
    size_t expected,
    const char* fn) {
  std::vector<std::optional<c10::SymInt>> sizes(expected);
  if (seq.is_none()) {
    return sizes;
  }
  nb::sequence items = nb::borrow<nb::sequence>(seq);
  if (nb::len(items) != expected) {
    throw nb::value_error((std::string(fn) + ": saved_sizes has " +
                           std::to_string(nb::len(items)) + " entries, node has " +
                           std::to_string(expected))
                              .c_str());
  }
  for (size_t i = 0; i < expected; ++i) {
    nb::handle item = items[i];
    if (item.is_none()) {
      continue;
    }
    if (PyLong_CheckExact(item.ptr())) {
      sizes[i] = c10::SymInt(nb::cast<int64_t>(item));
    } else {
      // A torch.SymInt while Dynamo/AOTAutograd trace the graph.
      sizes[i] = pybind11::cast<c10::SymInt>(pybind11::handle(item.ptr()));
    }
  }
  return sizes;
}

/// A lifted scalar as an IValue: int or float, or torch.SymInt/SymFloat while
/// Dynamo traces the graph (it makes a scalar that changed dynamic).
at::IValue scalar_ivalue(nb::handle value) {
  if (PyFloat_CheckExact(value.ptr())) {
    return at::IValue(nb::cast<double>(value));
  }
  if (PyLong_CheckExact(value.ptr())) {
    return at::IValue(nb::cast<int64_t>(value));
  }
  pybind11::handle obj(value.ptr());
  if (torch::is_symfloat(obj)) {
    return at::IValue(pybind11::cast<c10::SymFloat>(obj));
  }
  if (torch::is_symint(obj)) {
    return at::IValue(pybind11::cast<c10::SymInt>(obj));
  }
  throw nb::type_error(
      (std::string("saved_scalars must hold int or float, got ") +
       Py_TYPE(value.ptr())->tp_name)
          .c_str());
}

std::function<std::string(const std::string&)> error_prefix(const Node& node) {
  return [name = node.name()](const std::string& msg) {
    return "[ca_core: " + name + "] " + msg;
  };
}

/*
[Note: Proxy values]
A node's saved values are replaced, for one apply_with_saved, through its own
AutogradCompilerCall: the TensorArgs slot of each lifted tensor and each
lifted scalar gets a proxy, SwapSavedVariables swaps them in and back out.
ProxyValues sets the proxies for a scope and clears them when it ends, also
when the node throws, so a node never keeps a reference to a graph value.
*/
struct ProxyValues {
  ProxyValues(AutogradCompilerCall& collected, const variable_list& tensors, nb::handle scalars)
      : collected_(collected),
        // By position, not by looking the tensors up: they may have been
        // dropped already; see [Note: Saved tensors freed early].
        slots_(torch_private::tensor_args_by_position(
            collected.tensor_args,
            collected.tensor_args.inputs.size())) {
    auto& scalar_args = collected.lifted_ivalue_args.args;
    for (size_t i = 0; i < slots_.size(); ++i) {
      TORCH_INTERNAL_ASSERT(slots_[i] != nullptr);
      slots_[i]->proxy_tensor = tensors[i];
    }
    if (scalars.is_valid()) {
      nb::sequence values = nb::borrow<nb::sequence>(scalars);
      for (size_t i = 0; i < scalar_args.size(); ++i) {
        scalar_args[i].proxy = scalar_ivalue(values[i]);
      }
    } else {
      for (auto& arg : scalar_args) {
        arg.proxy = *arg.actual_ptr;
      }
    }
    collected.lifted_ivalue_args.next = 0;
  }
  ~ProxyValues() {
    for (auto* slot : slots_) {
      slot->proxy_tensor = at::Tensor();
    }
    for (auto& arg : collected_.lifted_ivalue_args.args) {
      arg.proxy = at::IValue::uninitialized();
    }
  }
  ProxyValues(const ProxyValues&) = delete;
  ProxyValues& operator=(const ProxyValues&) = delete;

 private:
  AutogradCompilerCall& collected_;
  /// The TensorArg of each lifted tensor, by position.
  std::vector<torch::dynamo::autograd::TensorArg*> slots_;
};

/// Runs `ns`'s node on `grads` with its saved tensors replaced by `tensors`,
/// its lifted scalars by `scalars` (an invalid handle keeps its own) and its
/// compiled_args sizes by `sizes`; see [Note: Proxy values].
variable_list run_with_values(
    NodeState& ns,
    variable_list grads,
    const variable_list& tensors,
    nb::handle scalars,
    std::vector<std::optional<c10::SymInt>> sizes) {
  AutogradCompilerCall& collected = *ns.collected;
  ProxyValues proxies(collected, tensors, scalars);
  TraceState trace(std::move(sizes), 0);
  ScopedSlot<NodeState> applying(applying_node(), &ns);
  // Saved tensors the graph unpacked follow the lifted ones; see
  // [Note: Unpack hooks in the graph].
  const size_t num_lifted = collected.tensor_args.inputs.size();
  variable_list unpacked;
  if (tensors.size() > num_lifted) {
    unpacked.assign(tensors.begin() + num_lifted, tensors.end());
  }
  ScopedSlot<const variable_list> unpacked_scope(
      ns.unpacked, unpacked.empty() ? nullptr : &unpacked);
  InterfaceScope interface;
  SwapSavedVariables swap(collected, trace, installed_runtime(), ns.call);
  try {
    return ns.call.node->apply_with_saved(grads, swap);
  } catch (...) {
    torch_private::restore_swap_stashes(swap);
    throw;
  }
}

/// Checks the values of apply_with_saved's argument lists against the node.
void check_saved_values(const NodeState& ns, const variable_list& tensors, nb::handle saved_scalars) {
  // The unpacked saved tensors are optional: without them call_unpack runs
  // the hooks; see [Note: Unpack hooks in the graph].
  const size_t expected_tensors = ns.collected->tensor_args.inputs.size();
  const size_t num_unpacked = ns.collected->packed_inputs.size();
  if (tensors.size() != expected_tensors && tensors.size() != expected_tensors + num_unpacked) {
    throw nb::value_error(
        ("apply_with_saved: saved_tensors has " + std::to_string(tensors.size()) +
         " tensors, " + ns.call.node->name() + " saved " +
         std::to_string(expected_tensors) +
         (num_unpacked ? " (+ " + std::to_string(num_unpacked) + " unpacked)" : std::string()))
            .c_str());
  }
  const size_t expected_scalars = ns.collected->lifted_ivalue_args.args.size();
  const size_t num_scalars = nb::len(nb::borrow<nb::sequence>(saved_scalars));
  if (num_scalars != expected_scalars) {
    throw nb::value_error(
        ("apply_with_saved: saved_scalars has " + std::to_string(num_scalars) +
         " values, node has " + std::to_string(expected_scalars))
            .c_str());
  }
}

/*
[Note: Eager fast path]
Swapping a node's own saved values in for themselves changes nothing, so when
apply_with_saved is handed exactly those values on real tensors -- which is
what happens on every cache hit whenever the graph runs as Python (Dynamo's
eager backend, compiler_fn returning the graph, the eager side of a graph
break) -- the node runs as the eager engine runs it, (*node)(grads), without
SwapSavedVariables, packing or the functional registry. "Exactly" means:
  - no replacement sizes (saved_sizes is None), and no unpacked values of
    saved tensors with hooks given by the graph (see [Note: Unpack hooks in
    the graph]). A node behind a graph break gets none: its own
    SavedVariables then call the unpack hooks, once per unpack, and give the
    result the grad_fn or grad accumulator eager's unpack gives it, which a
    create_graph=True backward differentiates through;
  - each saved tensor is the very tensor the walk lifted (same TensorImpl,
    or the same view of its storage: see [Note: Aliases of a saved output]),
    or a real tensor where the node's was freed early (then it is put back
    for the call; see [Note: Freed saved tensors put back]), and each scalar
    equals the node's own;
  - nothing is being traced: no TorchDispatchMode or TorchFunctionMode is
    active, no tracing dispatch key is in the thread's included set, and no
    grad or saved tensor carries one (FakeTensor, FunctionalTensor and other
    Python subclasses do). This matters for a node with nothing lifted, whose
    identity check holds trivially: while Dynamo or AOTAutograd trace the
    graph, Dynamo's FakeTensorMode or make_fx's proxy mode is active.
Anything else takes the apply_with_saved path, which swaps every value in.
The node's own values are its real ones here because a swap that failed
half-way was undone; see [Note: Restoring a failed swap].
*/
constexpr c10::DispatchKeySet kTracingKeys({
    c10::DispatchKey::Python,
    c10::DispatchKey::PythonTLSSnapshot,
    c10::DispatchKey::PythonDispatcher,
    c10::DispatchKey::Functionalize,
    c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
    c10::DispatchKey::FuncTorchDynamicLayerBackMode,
    c10::DispatchKey::FuncTorchGradWrapper,
    c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::PreDispatch,
});

bool plain(const at::Tensor& t) {
  return !t.defined() || !t.key_set().has_any(kTracingKeys);
}

/// Which eager fast path a node may take; see [Note: Eager fast path].
enum class FastPath {
  /// None: the swap of apply_with_saved.
  kNone,
  /// The node holds exactly the values given: run it as it is.
  kOwn,
  /// Its saved tensors were freed early and real ones are given: put them
  /// back in, run it, free them again; see [Note: Freed saved tensors put back].
  kPutBack,
};

FastPath fast_path(
    const NodeState& ns,
    const variable_list& grads,
    const variable_list& tensors,
    nb::handle saved_sizes,
    nb::handle scalars) {
  const AutogradCompilerCall& collected = *ns.collected;
  // Unpacked values given by the graph replace the hooks' calls; without
  // them the node's own SavedVariables run the hooks, as eager's do.
  const bool graph_unpacked = tensors.size() > collected.tensor_args.inputs.size();
  if (!saved_sizes.is_none() || (!collected.sv_to_hooks.empty() && graph_unpacked) ||
      c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      at::impl::torch_function_mode_enabled() ||
      c10::impl::tls_local_dispatch_key_set().included_.has_any(kTracingKeys)) {
    return FastPath::kNone;
  }
  for (const auto& g : grads) {
    if (!plain(g)) {
      return FastPath::kNone;
    }
  }
  FastPath path = FastPath::kOwn;
  const auto& lifted = collected.tensor_args.inputs;
  for (size_t i = 0; i < lifted.size(); ++i) {
    if (!plain(tensors[i])) {
      return FastPath::kNone;
    }
    if (!lifted[i].defined() && tensors[i].defined()) {
      path = FastPath::kPutBack;  // see [Note: Saved tensors freed early] in engine_hook.cpp
    } else if (
        tensors[i].unsafeGetTensorImpl() != lifted[i].unsafeGetTensorImpl() &&
        !same_tensor_view(tensors[i], lifted[i])) {  // see [Note: Aliases of a saved output]
      return FastPath::kNone;
    }
  }
  const auto& args = collected.lifted_ivalue_args.args;
  if (!args.empty() && !PyList_Check(scalars.ptr())) {
    return FastPath::kNone;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* value = PyList_GET_ITEM(scalars.ptr(), static_cast<Py_ssize_t>(i));
    const at::IValue& own = *args[i].actual_ptr;
    if (own.isInt() && PyLong_CheckExact(value)) {
      int overflow = 0;
      if (PyLong_AsLongLongAndOverflow(value, &overflow) != own.toInt() || overflow != 0) {
        return FastPath::kNone;
      }
    } else if (own.isDouble() && PyFloat_CheckExact(value)) {
      if (PyFloat_AS_DOUBLE(value) != own.toDouble()) {
        return FastPath::kNone;
      }
    } else {
      return FastPath::kNone;
    }
  }
  return path;
}

/*
[Note: Freed saved tensors put back]
On a cache hit the nodes the graph traces have their saved tensors freed
before it runs (see [Note: Saved tensors freed early] in engine_hook.cpp), so
where the graph runs as Python the identity check of [Note: Eager fast path]
fails for every node and each would take the swap of apply_with_saved, which
packs the node's arguments and calls its functional: several times the cost
of the node itself. When the only difference is that the node's lifted
tensors were freed and real tensors are given in their place, the given
tensors go back into the node's SavedVariables (as SwapSavedVariables puts a
proxy in: a SavedVariable of the tensor, pack hooks off), the node runs as
the eager engine runs it, and the freed SavedVariables are moved back. That
needs every lifted tensor to be a SavedVariable's; a node that also lifted a
plain tensor member (freed from its lifted list, not from the node) takes
the swap.
*/
class PutBackSavedTensors {
 public:
  PutBackSavedTensors(const AutogradCompilerCall& collected, const variable_list& tensors) {
    complete_ = torch_private::lifted_saved_variables(collected.tensor_args, slots_);
    if (!complete_) {
      return;
    }
    stash_.reserve(slots_.size());
    const bool prior = at::SavedTensorDefaultHooks::set_tracing(true);
    try {
      for (auto& [saved, position] : slots_) {
        torch::autograd::SavedVariable value(tensors[position], false);
        stash_.push_back(std::move(*saved));
        *saved = std::move(value);
      }
    } catch (...) {
      at::SavedTensorDefaultHooks::set_tracing(prior);
      restore();
      throw;
    }
    at::SavedTensorDefaultHooks::set_tracing(prior);
  }
  ~PutBackSavedTensors() {
    restore();
  }
  PutBackSavedTensors(const PutBackSavedTensors&) = delete;
  PutBackSavedTensors& operator=(const PutBackSavedTensors&) = delete;

  /// Whether every lifted tensor went back (else nothing did).
  bool complete() const {
    return complete_;
  }

 private:
  void restore() {
    for (size_t i = 0; i < stash_.size(); ++i) {
      *slots_[i].first = std::move(stash_[i]);
    }
    stash_.clear();
  }

  /// Each lifted SavedVariable and the position of its tensor.
  std::vector<std::pair<torch::autograd::SavedVariable*, uint32_t>> slots_;
  /// The freed SavedVariables, moved out while the node runs.
  std::vector<torch::autograd::SavedVariable> stash_;
  /// Whether every lifted tensor is a SavedVariable's.
  bool complete_ = false;
};

/*
[Note: Nodes that run for real keep their saved tensors]
A node that a cache hit runs for real (the graph runs as Python: Dynamo's
eager backend, compiler_fn returning the graph) but whose saved tensors were
freed early would have them put back on every hit, a SavedVariable built per
tensor: on a chain of muls that is 0.4 us of the 1-2 us a node costs. So
each hit records which nodes ran for real (NodeState::ran_for_real, here and
on the put-back path), finish() copies that onto the entry
(ShadowNode::ran_for_real, per free_early node), and the next hit leaves
those nodes' saved tensors in place: the node is handed exactly its own
values and runs as it is (the first case of [Note: Eager fast path]). The
record is redone on every hit, so a graph that runs a node for real once
(under torch.compiler.set_stance("force_eager"), say) and traces it again
afterwards holds that node's tensors to the end of one backward, then frees
them early again. Not where lifting detaches the graph's tensors (leaf
hooks in the graph, see [Note: Leaves accumulated in the graph]): the node
would not be handed its own tensors, so it stays freed early.
Without retain_graph a node run as it is releases its saved values right
after it ran, as the eager engine does (release_after_real_run), unless it
has grad_fn post hooks, which eager runs before it releases and which may
read them (`grad_fn._saved_self`); then finish() releases them. A hit has no
eager rerun that could need them (see [Note: Saved tensors freed early]).
*/
void release_after_real_run(NodeState& ns) {
  BackwardState* state = active_backward();
  if (state == nullptr || !state->release_after_apply || !ns.call.node->post_hooks().empty()) {
    return;
  }
  ns.call.node->release_variables();
  for (auto& t : ns.collected->tensor_args.inputs) {
    t = at::Tensor();
  }
}

/*
[Note: ZeroTensors kept out of compiled graphs]
Some derivative formulas return an efficient ZeroTensor (at::_efficientzerotensor:
sgn's, abs's second derivative, linear algebra's), a tensor with the ZeroTensor
dispatch key, its shape and no storage (a null data pointer). Eager's kernels
dispatch on the key and never read it. Inductor lowers _efficientzerotensor to
a fallback that returns one, and its generated kernels read their inputs
through the data pointer: a ZeroTensor that a node returns inside a compiled
graph, one that crosses a graph break into a resumed graph, or a saved
ZeroTensor lifted as a graph input (a grad from autograd.grad kept and used in
a later forward) made Inductor's code read address 0 (a segfault, found by the
fuzzer: a double backward with save_on_cpu). So every node's output grads
(apply_node_values, traced or eager) and every lifted tensor (lift_args) that
is a ZeroTensor become real zeros of the same shape, strides and options:
the same values, which every consumer reads the same way. When traced, the
check sees the fake tensor's key and the zeros are traced as at::zeros, which
Inductor computes. An op on a ZeroTensor often returns one (`zt * y` does),
so a saved non-leaf may be one that requires grad: where autograd records (a
create_graph backward) the zeros are added to it, keeping its place in the
graph. A leaf ZeroTensor that requires grad (only made by hand) stays as it
is: its identity is what accumulates.
*/
} // namespace

at::Tensor materialized_zeros(const at::Tensor& t) {
  if (!t.defined() || !t._is_zerotensor() || (t.requires_grad() && t.is_leaf())) {
    return t;
  }
  at::Tensor zeros = at::empty_strided(t.sizes(), t.strides(), t.options()).zero_();
  // Added to `t` where autograd records: the zeros keep its place in the graph.
  return t.requires_grad() && c10::GradMode::is_enabled() ? zeros.add(t) : zeros;
}

void materialize_zero_tensors(variable_list& tensors) {
  for (auto& t : tensors) {
    if (t.defined() && t._is_zerotensor()) {
      t = materialized_zeros(t);
    }
  }
}

namespace {

/// apply_with_saved on the node `ns` of the running backward (its eager fast
/// path or the swap of the values given), without ZeroTensors; see
/// [Note: ZeroTensors kept out of compiled graphs].
variable_list apply_node_values_as_given(
    NodeState& ns,
    variable_list grads,
    const variable_list& tensors,
    nb::handle saved_sizes,
    nb::handle saved_scalars) {
  check_saved_values(ns, tensors, saved_scalars);
  switch (fast_path(ns, grads, tensors, saved_sizes, saved_scalars)) {
    case FastPath::kOwn: {
      // See [Note: Eager fast path].
      ns.ran_for_real = true;
      variable_list outputs = (*ns.call.node)(std::move(grads));
      release_after_real_run(ns);
      return outputs;
    }
    case FastPath::kPutBack: {
      PutBackSavedTensors put_back(*ns.collected, tensors);
      if (put_back.complete()) {
        count_node_put_back();
        ns.ran_for_real = true;
        return (*ns.call.node)(std::move(grads));
      }
      break;
    }
    case FastPath::kNone:
      break;
  }
  return run_with_values(
      ns,
      std::move(grads),
      tensors,
      saved_scalars,
      unpack_sizes(saved_sizes, ns.num_apply_sizes, "apply_with_saved"));
}

variable_list apply_node_values(
    NodeState& ns,
    variable_list grads,
    const variable_list& tensors,
    nb::handle saved_sizes,
    nb::handle saved_scalars) {
  variable_list outputs =
      apply_node_values_as_given(ns, std::move(grads), tensors, saved_sizes, saved_scalars);
  materialize_zero_tensors(outputs);
  return outputs;
}

variable_list apply_node_with_saved(
    NodeState& ns,
    nb::handle inputs,
    nb::handle saved_tensors,
    nb::handle saved_sizes,
    nb::handle saved_scalars) {
  return apply_node_values(
      ns,
      unpack_list(inputs, "inputs"),
      unpack_list(saved_tensors, "saved_tensors"),
      saved_sizes,
      saved_scalars);
}

variable_list apply_with_saved(
    uint32_t node_idx,
    nb::handle inputs,
    nb::handle saved_tensors,
    nb::handle saved_sizes,
    nb::handle saved_scalars) {
  return apply_node_with_saved(
      require_active(node_idx, "apply_with_saved").nodes[node_idx],
      inputs,
      saved_tensors,
      saved_sizes,
      saved_scalars);
}

/// validate_outputs on `grads` with the next edges' sizes replaced by
/// `saved_sizes` (None keeps them).
variable_list validate_node_outputs(NodeState& ns, variable_list grads, nb::handle saved_sizes) {
  auto& edges = ns.call.node->next_edges();
  if (saved_sizes.is_none()) {
    torch::autograd::validate_outputs(edges, grads, error_prefix(*ns.call.node));
    return grads;
  }
  const size_t num_validate =
      ns.collected->all_size_inputs.size() - ns.num_apply_sizes;
  TraceState trace(
      unpack_sizes(saved_sizes, num_validate, "validate_outputs"), 0);
  SwapSavedVariables swap(*ns.collected, trace, installed_runtime(), ns.call);
  swap.before(edges);
  try {
    torch::autograd::validate_outputs(edges, grads, error_prefix(*ns.call.node));
  } catch (...) {
    swap.after(edges);
    throw;
  }
  swap.after(edges);
  return grads;
}

variable_list validate_outputs(
    uint32_t node_idx,
    nb::handle outputs,
    nb::handle saved_sizes) {
  BackwardState& state = require_active(node_idx, "validate_outputs");
  return validate_node_outputs(
      state.nodes[node_idx], unpack_list(outputs, "outputs"), saved_sizes);
}

/*
[Note: One call per node]
A traced node is apply_with_saved followed by validate_outputs with nothing
in between (grad_fn post-hooks come after both), so the graph makes it one
call, apply_node: on the hit path each node costs one Python call and one
conversion of its grads instead of two.
*/
variable_list apply_node(
    uint32_t node_idx,
    nb::handle inputs,
    nb::handle saved_tensors,
    nb::handle apply_sizes,
    nb::handle saved_scalars,
    nb::handle validate_sizes) {
  NodeState& ns = require_active(node_idx, "apply_node").nodes[node_idx];
  return validate_node_outputs(
      ns,
      apply_node_with_saved(ns, inputs, saved_tensors, apply_sizes, saved_scalars),
      validate_sizes);
}

/*
[Note: Runs of nodes in one call]
Where the graph runs as Python -- Dynamo's eager backend, a compiler_fn that
returns the graph, the eager side of a graph break -- each apply_node call
costs a Python call, its argument lists and a Python object per output grad:
about as much as the eager engine spends on the whole node. ca_runtime's
capture therefore hands compiler_fn a graph in which each run of consecutive
apply_node calls that feed only one another (nothing but getitem between
them) is one apply_nodes call. Its plan (plan_node_run) is fixed at capture:
for each node, where each input grad and saved tensor comes from (a tensor
operand of the call, an output of an earlier node of the run, or None) and
which of the call's other operands are its sizes and scalars. apply_nodes
then runs the nodes in order as apply_node would, keeping the grads between
them as C++ tensors, and drops each as soon as no later node of the run reads
it (the eager engine frees a node's input grads once it has run). Nodes and
errors are the same as with one apply_node per node, so tracing compilers
(AOTAutograd below Dynamo) see the same ATen ops.

Plans live in a registry indexed by the plan id that the graph passes (an
int is what FX and Dynamo carry as a constant), until ca_runtime releases
them when the graph module that holds the calls dies (release_node_run_plans
from a finalizer): kept for the process, they were a leak of a few integers
per node on every capture. Ids are never reused, so a stale id fails with
"no plan" instead of running another graph's plan; the registry is a map, so
releasing one plan leaves the references apply_nodes holds to others valid.
*/
/// Where a value a planned node reads comes from; see [Note: Runs of nodes in one call].
struct RunRef {
  /// None, tensors[index] of the call, or output register `index`.
  enum class Kind : uint8_t { kNone, kOperand, kRegister } kind = Kind::kNone;
  /// The operand or register index.
  uint32_t index = 0;
};

/// One node of a run.
struct RunStep {
  /// The node's index in the walk (as apply_node's node_idx).
  uint32_t node_idx = 0;
  /// Its input grads.
  std::vector<RunRef> grads;
  /// Its saved tensors (lifted, then unpacked), as apply_node's saved_tensors.
  std::vector<RunRef> saved;
  /// Index into the call's `others` of apply_sizes, saved_scalars and
  /// validate_sizes; -1 for None.
  int64_t apply_sizes = -1, scalars = -1, validate_sizes = -1;
  /// Its outputs go to registers first_register .. first_register + num_outputs.
  uint32_t first_register = 0;
  /// How many output grads the graph expects of it.
  uint32_t num_outputs = 0;
  /// Registers no later step reads and the call does not return: dropped
  /// after this step.
  std::vector<uint32_t> release;
};

/// A run of nodes apply_nodes executes in one call.
struct NodeRunPlan {
  /// The nodes, in the graph's order.
  std::vector<RunStep> steps;
  /// How many output registers the steps fill.
  uint32_t num_registers = 0;
  /// The registers the call returns, in order.
  std::vector<uint32_t> results;
};

/// Live plans by id; see [Note: Runs of nodes in one call]. Guarded by the GIL.
std::unordered_map<uint32_t, std::unique_ptr<NodeRunPlan>>& node_run_plans() {
  static std::unordered_map<uint32_t, std::unique_ptr<NodeRunPlan>> plans;
  return plans;
}
/// The next plan's id (never reused).
uint32_t g_next_plan_id = 0;

/// A ref as plan_node_run takes it: >= 0 operand, -1 None, <= -2 register -ref - 2.
RunRef run_ref(int64_t code, uint32_t num_registers) {
  if (code >= 0) {
    return {RunRef::Kind::kOperand, static_cast<uint32_t>(code)};
  }
  if (code == -1) {
    return {};
  }
  const int64_t reg = -code - 2;
  if (reg >= num_registers) {
    throw nb::value_error("plan_node_run: a node reads a register no earlier node fills");
  }
  return {RunRef::Kind::kRegister, static_cast<uint32_t>(reg)};
}

/// One node of a run as ca_runtime describes it to plan_node_run
/// (ca_core.NodeRunStep); see [Note: Runs of nodes in one call].
struct NodeRunStep {
  /// The node's index in the walk (as apply_node's node_idx).
  uint32_t node_idx = 0;
  /// Its input grads as refs (see run_ref).
  std::vector<int64_t> grads;
  /// Its saved tensors as refs (see run_ref).
  std::vector<int64_t> saved;
  /// Indices into the call's `others` of apply_sizes, saved_scalars and
  /// validate_sizes; -1 for None.
  int64_t apply_sizes = -1, scalars = -1, validate_sizes = -1;
  /// How many output grads the graph reads of it (registers it fills).
  uint32_t num_outputs = 0;
};

uint32_t plan_node_run(const std::vector<NodeRunStep>& specs, const std::vector<int64_t>& results) {
  auto plan = std::make_unique<NodeRunPlan>();
  std::vector<int64_t> last_read;  // per register: the last step reading it
  for (const NodeRunStep& spec : specs) {
    const auto& [node_idx, grads, saved, apply_sizes, scalars, validate_sizes, num_outputs] = spec;
    RunStep step;
    step.node_idx = node_idx;
    const auto step_idx = static_cast<int64_t>(plan->steps.size());
    for (auto [codes, refs] : {std::pair{&grads, &step.grads}, std::pair{&saved, &step.saved}}) {
      for (int64_t code : *codes) {
        RunRef ref = run_ref(code, plan->num_registers);
        if (ref.kind == RunRef::Kind::kRegister) {
          last_read[ref.index] = step_idx;
        }
        refs->push_back(ref);
      }
    }
    step.apply_sizes = apply_sizes;
    step.scalars = scalars;
    step.validate_sizes = validate_sizes;
    step.first_register = plan->num_registers;
    step.num_outputs = num_outputs;
    plan->num_registers += num_outputs;
    last_read.resize(plan->num_registers, -1);
    plan->steps.push_back(std::move(step));
  }
  for (int64_t code : results) {
    RunRef ref = run_ref(code, plan->num_registers);
    if (ref.kind != RunRef::Kind::kRegister) {
      throw nb::value_error("plan_node_run: results must be outputs of the run's nodes");
    }
    plan->results.push_back(ref.index);
    last_read[ref.index] = static_cast<int64_t>(plan->steps.size());
  }
  for (uint32_t reg = 0; reg < plan->num_registers; ++reg) {
    if (last_read[reg] >= 0 && last_read[reg] < static_cast<int64_t>(plan->steps.size())) {
      plan->steps[last_read[reg]].release.push_back(reg);
    }
  }
  // Registers nobody reads are dropped right after the step that fills them.
  for (auto& step : plan->steps) {
    for (uint32_t j = 0; j < step.num_outputs; ++j) {
      if (last_read[step.first_register + j] < 0) {
        step.release.push_back(step.first_register + j);
      }
    }
  }
  const uint32_t id = g_next_plan_id++;
  node_run_plans().emplace(id, std::move(plan));
  return id;
}

void release_node_run_plans(const std::vector<uint32_t>& plan_ids) {
  for (uint32_t id : plan_ids) {
    node_run_plans().erase(id);
  }
}

variable_list apply_nodes(uint32_t plan_id, nb::handle tensors, nb::handle others) {
  const auto& plans = node_run_plans();
  const auto found = plans.find(plan_id);
  if (found == plans.end()) {
    throw nb::value_error(("apply_nodes: no plan " + std::to_string(plan_id)).c_str());
  }
  const NodeRunPlan& plan = *found->second;
  if (!PyList_Check(others.ptr())) {
    throw nb::type_error("apply_nodes: others must be a list");
  }
  const variable_list operands = unpack_list(tensors, "tensors");
  const auto num_others = PyList_GET_SIZE(others.ptr());
  auto other = [&](int64_t i) -> nb::handle {
    if (i < 0) {
      return nb::none();
    }
    if (i >= num_others) {
      throw nb::value_error("apply_nodes: others is shorter than the plan");
    }
    return PyList_GET_ITEM(others.ptr(), i);
  };
  // A node without lifted scalars; see check_saved_values.
  const nb::object no_scalars = nb::steal(PyTuple_New(0));
  variable_list registers(plan.num_registers);
  auto value = [&](const RunRef& ref) -> at::Tensor {
    switch (ref.kind) {
      case RunRef::Kind::kOperand:
        if (ref.index >= operands.size()) {
          throw nb::value_error("apply_nodes: tensors is shorter than the plan");
        }
        return operands[ref.index];
      case RunRef::Kind::kRegister:
        return registers[ref.index];
      case RunRef::Kind::kNone:
        break;
    }
    return at::Tensor();
  };
  for (const RunStep& step : plan.steps) {
    NodeState& ns = require_active(step.node_idx, "apply_nodes").nodes[step.node_idx];
    variable_list grads, saved;
    grads.reserve(step.grads.size());
    saved.reserve(step.saved.size());
    for (const RunRef& ref : step.grads) {
      grads.push_back(value(ref));
    }
    for (const RunRef& ref : step.saved) {
      saved.push_back(value(ref));
    }
    variable_list outputs = validate_node_outputs(
        ns,
        apply_node_values(
            ns,
            std::move(grads),
            saved,
            other(step.apply_sizes),
            step.scalars < 0 ? nb::handle(no_scalars) : other(step.scalars)),
        other(step.validate_sizes));
    if (outputs.size() < step.num_outputs) {
      throw std::runtime_error(
          "apply_nodes: " + ns.call.node->name() + " returned " + std::to_string(outputs.size()) +
          " grads, the graph expects " + std::to_string(step.num_outputs));
    }
    for (uint32_t j = 0; j < step.num_outputs; ++j) {
      registers[step.first_register + j] = std::move(outputs[j]);
    }
    for (uint32_t reg : step.release) {
      registers[reg].reset();
    }
  }
  variable_list results;
  results.reserve(plan.results.size());
  for (uint32_t reg : plan.results) {
    results.push_back(registers[reg]);
  }
  return results;
}

bool probe_traceable(uint32_t node_idx) {
  BackwardState& state = require_active(node_idx, "probe_traceable");
  NodeState& ns = state.nodes[node_idx];
  // The node's own values stand in for the graph's: nothing is computed,
  // the probe only lets the node reach bind_function.
  TraceabilityProbe probe;
  run_with_values(
      ns,
      variable_list(ns.call.node->num_inputs()),
      ns.collected->tensor_args.inputs,
      nb::handle(),
      std::vector<std::optional<c10::SymInt>>(ns.num_apply_sizes));
  // A node that never binds computes in C++ on whatever it is given.
  return probe.is_traceable.value_or(true);
}

at::Tensor call_cpp_tensor_pre_hook(
    uint32_t node_idx,
    uint32_t hook_id,
    const at::Tensor& grad) {
  BackwardState& state = require_active(node_idx, "call_cpp_tensor_pre_hook");
  auto& hooks = state.nodes[node_idx].collected->cpp_tensor_pre_hooks;
  if (hook_id >= hooks.size()) {
    throw nb::value_error(
        ("call_cpp_tensor_pre_hook: hook_id " + std::to_string(hook_id) +
         " out of range")
            .c_str());
  }
  // torch's wrapper returns the grad itself when the hook returns nothing.
  return at::Tensor(hooks[hook_id](grad));
}

variable_list call_opaque_tensor_pre_hook(
    uint32_t node_idx,
    uint32_t hook_index,
    nb::handle grads) {
  BackwardState& state =
      require_active(node_idx, "call_opaque_tensor_pre_hook");
  const auto& hooks = state.nodes[node_idx].tensor_pre_hooks;
  if (hook_index >= hooks.size() || hooks[hook_index].opaque == nullptr) {
    throw nb::value_error(
        ("call_opaque_tensor_pre_hook: no opaque hook " +
         std::to_string(hook_index) + " on node " + std::to_string(node_idx))
            .c_str());
  }
  return (*hooks[hook_index].opaque)(unpack_list(grads, "grads"));
}

void accumulate_grad_now(uint32_t node_idx, const at::Tensor& grad) {
  BackwardState& state = require_active(node_idx, "accumulate_grad_now");
  NodeState& ns = state.nodes[node_idx];
  if (!ns.is_accumulate_grad) {
    throw nb::value_error(
        ("accumulate_grad_now: node " + std::to_string(node_idx) + " (" +
         ns.call.node->name() + ") is not an AccumulateGrad node")
            .c_str());
  }
  run_leaf_node(*ns.call.node, grad);
}

} // namespace

BackwardState*& active_backward() {
  thread_local BackwardState* state = nullptr;
  return state;
}

NodeState*& applying_node() {
  thread_local NodeState* ns = nullptr;
  return ns;
}

void register_node_apply(nb::module_& m) {
  m.def(
      "apply_with_saved",
      &apply_with_saved,
      nb::arg("node_idx"),
      nb::arg("inputs"),
      nb::arg("saved_tensors"),
      nb::arg("saved_sizes").none(),
      nb::arg("saved_scalars"),
      "Runs node `node_idx` of the running backward on `inputs` with its "
      "saved tensors, sizes (None keeps the node's own) and scalars replaced "
      "by the values given; returns its output grads (None = undefined).");
  m.def(
      "apply_node",
      &apply_node,
      nb::arg("node_idx"),
      nb::arg("inputs"),
      nb::arg("saved_tensors"),
      nb::arg("apply_sizes").none(),
      nb::arg("saved_scalars"),
      nb::arg("validate_sizes").none(),
      "apply_with_saved then validate_outputs in one call; see "
      "[Note: One call per node].");
  nb::class_<NodeRunStep>(
      m,
      "NodeRunStep",
      "One node of a run for plan_node_run; see [Note: Runs of nodes in one call]. grads and "
      "saved_tensors are refs (>= 0: tensors[ref], -1: None, <= -2: output register -ref - 2, "
      "registers numbered by step then output); apply_sizes, saved_scalars and validate_sizes "
      "are indices into apply_nodes' `others` (-1: None).")
      .def(
          "__init__",
          [](NodeRunStep* self,
             uint32_t node_idx,
             std::vector<int64_t> grads,
             std::vector<int64_t> saved,
             int64_t apply_sizes,
             int64_t scalars,
             int64_t validate_sizes,
             uint32_t num_outputs) {
            new (self) NodeRunStep{
                node_idx, std::move(grads), std::move(saved), apply_sizes, scalars, validate_sizes, num_outputs};
          },
          nb::kw_only(),
          nb::arg("node_idx"),
          nb::arg("grads"),
          nb::arg("saved_tensors"),
          nb::arg("apply_sizes"),
          nb::arg("saved_scalars"),
          nb::arg("validate_sizes"),
          nb::arg("num_outputs"))
      .def_ro("node_idx", &NodeRunStep::node_idx)
      .def_ro("grads", &NodeRunStep::grads)
      .def_ro("saved_tensors", &NodeRunStep::saved)
      .def_ro("apply_sizes", &NodeRunStep::apply_sizes)
      .def_ro("saved_scalars", &NodeRunStep::scalars)
      .def_ro("validate_sizes", &NodeRunStep::validate_sizes)
      .def_ro("num_outputs", &NodeRunStep::num_outputs);
  m.def(
      "plan_node_run",
      &plan_node_run,
      nb::arg("steps"),
      nb::arg("results"),
      "Registers the plan of a run of nodes (NodeRunSteps, in order) for "
      "apply_nodes and returns its id; see [Note: Runs of nodes in one call]. "
      "`results` are the register refs apply_nodes returns.");
  m.def(
      "release_node_run_plans",
      &release_node_run_plans,
      nb::arg("plan_ids"),
      "Frees the plans of a graph that died; see [Note: Runs of nodes in one call].");
  m.def(
      "live_node_run_plans",
      []() { return node_run_plans().size(); },
      "How many plans are registered (tests: none leak).");
  m.def(
      "apply_nodes",
      &apply_nodes,
      nb::arg("plan_id"),
      nb::arg("tensors"),
      nb::arg("others"),
      "Runs the nodes of plan `plan_id` in order, as one apply_node call "
      "each, on these operands; returns the plan's result grads.");
  m.def(
      "probe_traceable",
      &probe_traceable,
      nb::arg("node_idx"),
      "Whether node `node_idx` of the running backward may be traced: False "
      "for a C++ torch::autograd::Function with is_traceable = false. Only "
      "meaningful during capture.");
  m.def(
      "call_cpp_tensor_pre_hook",
      &call_cpp_tensor_pre_hook,
      nb::arg("node_idx"),
      nb::arg("hook_id"),
      nb::arg("grad").none(),
      "Runs C++ tensor pre-hook `hook_id` of node `node_idx` (a C++ "
      "register_hook or retain_grad) on `grad`; returns the grad to use.");
  m.def(
      "call_opaque_tensor_pre_hook",
      &call_opaque_tensor_pre_hook,
      nb::arg("node_idx"),
      nb::arg("hook_index"),
      nb::arg("grads"),
      "Runs tensor pre-hook `hook_index` (a position in the node's hook "
      "order) of node `node_idx`, a C++ hook without compiled_args, on all the "
      "node's input grads; returns them as the hook left them.");
  m.def(
      "accumulate_grad_now",
      &accumulate_grad_now,
      nb::arg("node_idx"),
      nb::arg("grad").none(),
      "Runs AccumulateGrad node `node_idx` of the running backward on `grad` "
      "now (accumulation into .grad and post-accumulate-grad hooks).");
  m.def(
      "validate_outputs",
      &validate_outputs,
      nb::arg("node_idx"),
      nb::arg("outputs"),
      nb::arg("saved_sizes").none(),
      "Checks and casts node `node_idx`'s output grads against the input "
      "metadata of its next edges, as the eager engine does.");
}

} // namespace ca
