// node_apply.cpp — runs one node of the active backward with explicit saved
// values (apply_with_saved) and checks its outputs (validate_outputs); these
// are the calls a captured FX graph is made of. Also describes a walked
// backward to ca_runtime's capture.
#include "ca_core.h"
#include "tensor_caster.h"

#include <torch/csrc/autograd/engine.h>

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace ca {

using torch::dynamo::autograd::SwapSavedVariables;
using torch::dynamo::autograd::TraceState;

namespace {

/// What capture() needs to know about one node (a plain copy, made on a miss).
struct NodeInfo {
  /// Walk index: position in eager's execution order.
  uint32_t index = 0;
  /// Node::name(), e.g. "MulBackward0".
  std::string name;
  /// Demangled C++ type, e.g. "torch::autograd::generated::MulBackward0".
  std::string type_name;
  /// Number of grads the node takes.
  uint32_t num_inputs = 0;
  /// Number of grads the node returns (one per next edge).
  uint32_t num_outputs = 0;
  /// Per output: (walk index of the next node, its input number), or None
  /// when the edge is invalid or leads to a node that does not run.
  std::vector<std::optional<std::pair<uint32_t, uint32_t>>> next_edges;
  /// False when the node only provides torch.autograd.grad outputs.
  bool needed = true;
  /// (input number, output index) pairs returned to torch.autograd.grad.
  std::vector<std::pair<int, int>> graph_output;
  /// AccumulateGrad: its input grad becomes a graph output.
  bool is_accumulate_grad = false;
  /// Number of hooks per kind on this node, only kinds present:
  /// tensor_pre, cpp_tensor_pre, pre, post, post_acc_grad, saved_tensor.
  std::map<std::string, uint32_t> hooks;
  /// Index in the graph's `inputs` list of each tensor the node lifted, in
  /// the order apply_with_saved takes them.
  std::vector<uint32_t> tensor_slots;
  /// First of this node's sizes in the walk's size list.
  uint32_t size_offset = 0;
  /// Sizes visited by compiled_args (apply_with_saved).
  uint32_t num_apply_sizes = 0;
  /// Sizes visited by the next edges' metadata (validate_outputs).
  uint32_t num_validate_sizes = 0;
  /// First of this node's scalars in the graph's `scalars` list.
  uint32_t scalar_offset = 0;
  /// How many scalars the node lifted.
  uint32_t num_scalars = 0;
};

/// What capture() gets for one backward.
struct BackwardGraph {
  /// Nodes in walk order.
  std::vector<NodeInfo> nodes;
  /// Values returned to the engine (torch.autograd.grad outputs).
  size_t num_outputs = 0;
  /// Length of the graph's `inputs` list.
  uint32_t num_tensors = 0;
  /// Number of sizes the walk lifted.
  uint32_t num_sizes = 0;
  /// Length of the graph's `scalars` list.
  uint32_t num_scalars = 0;
  /// retain_graph / create_graph of the backward.
  bool keep_graph = false;
  /// Grad mode during the backward (create_graph=True).
  bool create_graph = false;
  /// False for torch.autograd.grad.
  bool accumulate_grad = true;
};

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
    if (!item.is_none()) {
      sizes[i] = c10::SymInt(nb::cast<int64_t>(item));
    }
  }
  return sizes;
}

std::function<std::string(const std::string&)> error_prefix(const Node& node) {
  return [name = node.name()](const std::string& msg) {
    return "[ca_core: " + name + "] " + msg;
  };
}

variable_list apply_with_saved(
    uint32_t node_idx,
    nb::handle inputs,
    nb::handle saved_tensors,
    nb::handle saved_sizes,
    nb::handle saved_scalars) {
  BackwardState& state = require_active(node_idx, "apply_with_saved");
  NodeState& ns = state.nodes[node_idx];
  AutogradCompilerCall& collected = *ns.collected;

  variable_list grads = unpack_list(inputs, "inputs");
  variable_list tensors = unpack_list(saved_tensors, "saved_tensors");
  const auto& lifted = collected.tensor_args.inputs;
  if (tensors.size() != lifted.size()) {
    throw nb::value_error(
        ("apply_with_saved: saved_tensors has " + std::to_string(tensors.size()) +
         " tensors, " + ns.call.node->name() + " saved " +
         std::to_string(lifted.size()))
            .c_str());
  }
  auto& scalar_args = collected.lifted_ivalue_args.args;
  nb::sequence scalars = nb::borrow<nb::sequence>(saved_scalars);
  if (nb::len(scalars) != scalar_args.size()) {
    throw nb::value_error(
        ("apply_with_saved: saved_scalars has " +
         std::to_string(nb::len(scalars)) + " values, node has " +
         std::to_string(scalar_args.size()))
            .c_str());
  }

  // [Note: Per-node collection]: the node's own TensorArgs map each of its
  // SavedVariables and tensors to a slot; we point the slots at the values
  // given, let SwapSavedVariables put them in, and clear them afterwards.
  for (size_t i = 0; i < lifted.size(); ++i) {
    collected.tensor_args.lookup(lifted[i]).proxy_tensor = tensors[i];
  }
  for (size_t i = 0; i < scalar_args.size(); ++i) {
    nb::handle value = scalars[i];
    scalar_args[i].proxy = nb::isinstance<nb::float_>(value)
        ? at::IValue(nb::cast<double>(value))
        : at::IValue(nb::cast<int64_t>(value));
  }
  collected.lifted_ivalue_args.next = 0;
  TraceState trace(
      unpack_sizes(saved_sizes, ns.num_apply_sizes, "apply_with_saved"), 0);

  variable_list outputs;
  {
    InterfaceScope interface;
    SwapSavedVariables swap(collected, trace, installed_runtime(), ns.call);
    outputs = ns.call.node->apply_with_saved(grads, swap);
  }
  for (const auto& t : lifted) {
    collected.tensor_args.lookup(t).proxy_tensor = at::Tensor();
  }
  for (auto& arg : scalar_args) {
    arg.proxy = at::IValue::uninitialized();
  }
  return outputs;
}

variable_list validate_outputs(
    uint32_t node_idx,
    nb::handle outputs,
    nb::handle saved_sizes) {
  BackwardState& state = require_active(node_idx, "validate_outputs");
  NodeState& ns = state.nodes[node_idx];
  variable_list grads = unpack_list(outputs, "outputs");
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

} // namespace

BackwardState*& active_backward() {
  thread_local BackwardState* state = nullptr;
  return state;
}

nb::object describe_backward(const BackwardState& state) {
  BackwardGraph graph;
  graph.num_outputs = state.num_outputs;
  graph.num_tensors = static_cast<uint32_t>(state.lifted_tensors.size());
  graph.keep_graph = state.keep_graph;
  graph.create_graph = state.create_graph;
  graph.accumulate_grad = state.accumulate_grad;
  graph.nodes.reserve(state.nodes.size());
  for (size_t i = 0; i < state.nodes.size(); ++i) {
    const NodeState& ns = state.nodes[i];
    const Node& node = *ns.call.node;
    NodeInfo& info = graph.nodes.emplace_back();
    info.index = static_cast<uint32_t>(i);
    info.name = node.name();
    info.type_name = node_type_name(node);
    info.num_inputs = static_cast<uint32_t>(node.num_inputs());
    info.num_outputs = static_cast<uint32_t>(node.num_outputs());
    for (const auto& edge : node.next_edges()) {
      auto it = edge.is_valid() ? state.walk_index.find(edge.function.get())
                                : state.walk_index.end();
      if (it == state.walk_index.end()) {
        info.next_edges.emplace_back(std::nullopt);
      } else {
        info.next_edges.emplace_back(std::make_pair(it->second, edge.input_nr));
      }
    }
    info.needed = ns.call.needed;
    info.graph_output = ns.call.graph_output;
    info.is_accumulate_grad = ns.is_accumulate_grad;
    const NodeCall& call = ns.call;
    for (const auto& [kind, count] :
         {std::pair{"tensor_pre", call.tensor_pre_hooks.size()},
          std::pair{"cpp_tensor_pre", call.cpp_tensor_pre_hooks.size()},
          std::pair{"pre", call.pre_hooks.size()},
          std::pair{"post", call.post_hooks.size()},
          std::pair{"post_acc_grad", call.post_acc_grad_hooks.size()},
          std::pair{
              "saved_tensor",
              ns.collected ? ns.collected->sv_to_hooks.size() : size_t{0}}}) {
      if (count > 0) {
        info.hooks.emplace(kind, static_cast<uint32_t>(count));
      }
    }
    info.size_offset = graph.num_sizes;
    info.scalar_offset = graph.num_scalars;
    if (ns.collected) {
      const auto num_sizes =
          static_cast<uint32_t>(ns.collected->all_size_inputs.size());
      info.num_apply_sizes = ns.num_apply_sizes;
      info.num_validate_sizes = num_sizes - ns.num_apply_sizes;
      graph.num_sizes += num_sizes;
      if (!ns.is_accumulate_grad) {
        info.tensor_slots = ns.tensor_slots;
        info.num_scalars = static_cast<uint32_t>(
            ns.collected->lifted_ivalue_args.args.size());
      }
    }
    graph.num_scalars += info.num_scalars;
  }
  return nb::cast(std::move(graph));
}

void register_node_apply(nb::module_& m) {
  nb::class_<NodeInfo>(m, "NodeInfo", "One node of a walked backward, as capture() sees it.")
      .def_ro("index", &NodeInfo::index)
      .def_ro("name", &NodeInfo::name)
      .def_ro("type_name", &NodeInfo::type_name)
      .def_ro("num_inputs", &NodeInfo::num_inputs)
      .def_ro("num_outputs", &NodeInfo::num_outputs)
      .def_ro("next_edges", &NodeInfo::next_edges)
      .def_ro("needed", &NodeInfo::needed)
      .def_ro("graph_output", &NodeInfo::graph_output)
      .def_ro("is_accumulate_grad", &NodeInfo::is_accumulate_grad)
      .def_ro("hooks", &NodeInfo::hooks)
      .def_ro("tensor_slots", &NodeInfo::tensor_slots)
      .def_ro("size_offset", &NodeInfo::size_offset)
      .def_ro("num_apply_sizes", &NodeInfo::num_apply_sizes)
      .def_ro("num_validate_sizes", &NodeInfo::num_validate_sizes)
      .def_ro("scalar_offset", &NodeInfo::scalar_offset)
      .def_ro("num_scalars", &NodeInfo::num_scalars)
      .def("__repr__", [](const NodeInfo& n) {
        return "NodeInfo(" + std::to_string(n.index) + ", " + n.name + ")";
      });
  nb::class_<BackwardGraph>(m, "BackwardGraph", "A walked backward, handed to capture() on a cache miss.")
      .def_ro("nodes", &BackwardGraph::nodes)
      .def_ro("num_outputs", &BackwardGraph::num_outputs)
      .def_ro("num_tensors", &BackwardGraph::num_tensors)
      .def_ro("num_sizes", &BackwardGraph::num_sizes)
      .def_ro("num_scalars", &BackwardGraph::num_scalars)
      .def_ro("keep_graph", &BackwardGraph::keep_graph)
      .def_ro("create_graph", &BackwardGraph::create_graph)
      .def_ro("accumulate_grad", &BackwardGraph::accumulate_grad);

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
      "validate_outputs",
      &validate_outputs,
      nb::arg("node_idx"),
      nb::arg("outputs"),
      nb::arg("saved_sizes").none(),
      "Checks and casts node `node_idx`'s output grads against the input "
      "metadata of its next edges, as the eager engine does.");
}

} // namespace ca
