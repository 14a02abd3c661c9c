// describe.cpp — the seam's data types (NodeInfo, BackwardGraph, ...) and
// describe_backward: what ca_runtime's capture() is told about a walked
// backward, built on a cache miss only.
#include "ca_core.h"
#include "torch_private.h"
#include "tensor_caster.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_function.h>

#include <typeinfo>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace ca {

namespace {

/// How to make the zeros a Python Function's backward sees for an undefined grad.
struct ZerosSpec {
  /// Shape of the forward output.
  std::vector<int64_t> shape;
  /// torch.dtype of the forward output.
  nb::object dtype;
  /// torch.device of the forward output.
  nb::object device;
  /// Index, among the node's size inputs, of the shape's first dimension
  /// (output_info sizes are size inputs; see [Note: Dynamic sizes]).
  uint32_t first_size = 0;
};

/// What capture() needs to call a Python torch.autograd.Function's backward
/// itself (torch::autograd::PyNode); see [Note: Python Functions in the graph].
struct FunctionInfo {
  /// Index in the graph's `hooks` list of the node's ctx object.
  uint32_t ctx_hook = 0;
  /// Per tensor in ctx.saved_tensors: its slot in the graph's `inputs`, or
  /// None for a saved None.
  std::vector<std::optional<uint32_t>> saved_slots;
  /// Per forward input: whether it was a tensor (the backward returns one
  /// value per forward input; only tensors' grads flow on).
  std::vector<bool> is_variable_input;
  /// Per node input: zeros to pass when the grad is undefined, or None to
  /// pass None (ctx.set_materialize_grads(False), non-differentiable or
  /// non-tensor output).
  std::vector<std::optional<ZerosSpec>> materialize;
  /// The ctx object itself (capture reads its Function class, e.g. the AOT
  /// backward graph of a torch.compile'd region; see [Note: AOT backwards]).
  nb::object ctx;
  /// Values of ctx's symints at this walk; they are the node's first size
  /// inputs (dynamic ones are read from the graph's `sizes` instead).
  std::vector<int64_t> symints;
  /// Index in the graph's `hooks` list of ctx's Dynamo BackwardState, or None.
  std::optional<uint32_t> backward_state_hook;
  /// Indices in the graph's `hooks` list of ctx.opaque_objects.
  std::vector<uint32_t> opaque_hooks;
};

/// Which kind of tensor pre-hook; ca_runtime's HOOK_RULES has a row per kind.
enum class TensorPreHookKind {
  /// A Python hook (Tensor.register_hook): traced.
  python,
  /// A C++ hook with compiled_args, called by its id.
  cpp,
  /// The hook retain_grad() installs (a C++ one).
  retains_grad,
  /// A C++ hook without compiled_args, called on all the node's input grads
  /// (call_opaque_tensor_pre_hook).
  opaque,
};

/// One tensor pre-hook as capture() sees it.
struct TensorPreHookInfo {
  /// What kind of hook it is.
  TensorPreHookKind kind = TensorPreHookKind::python;
  /// Python hooks: index in the graph's `hooks` list; C++ hooks: the node's
  /// own C++ hook id (for call_cpp_tensor_pre_hook).
  uint32_t hook = 0;
  /// The node input whose grad the hook sees.
  uint32_t input_nr = 0;
};

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
  /// Autograd's sequence number of the node (eager's ready-queue order).
  uint64_t sequence_nr = 0;
  /// Number of grad_fn pre-hooks (register_prehook). For an AccumulateGrad
  /// with C++ hooks: the number of hook objects, none of them collected
  /// (pre_hooks stays empty); see [Note: Leaf node hooks].
  uint32_t num_grad_fn_pre_hooks = 0;
  /// Number of grad_fn post-hooks (register_hook); as above for AccumulateGrad.
  uint32_t num_grad_fn_post_hooks = 0;
  /// Number of post-accumulate-grad hooks (AccumulateGrad only).
  uint32_t num_post_acc_grad_hooks = 0;
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
  /// Tensor pre-hooks in eager's call order; see [Note: Hook order].
  std::vector<TensorPreHookInfo> tensor_pre_hooks;
  /// grad_fn pre-hooks (register_prehook): indices in the graph's `hooks`.
  std::vector<uint32_t> pre_hooks;
  /// grad_fn post-hooks (register_hook): indices in the graph's `hooks`.
  std::vector<uint32_t> post_hooks;
  /// AccumulateGrad whose variable is lifted (tensor_slots[0]): its
  /// post-accumulate-grad hooks, indices in the graph's `hooks`; see
  /// [Note: Leaves accumulated in the graph].
  std::vector<uint32_t> post_acc_grad_hooks;
  /// Saved tensors whose unpack hook runs when the node is applied.
  uint32_t num_saved_tensor_hooks = 0;
  /// Per saved tensor with an unpack hook, in packed-input order (the order
  /// apply_node takes the unpacked tensors, after the lifted ones): (index in
  /// the graph's `hooks` of the unpack hook, index of its packed data).
  std::vector<std::pair<uint32_t, uint32_t>> unpack_hooks;
  /// The unpack hook objects themselves (same order), so that capture can
  /// decide whether Dynamo may trace each one.
  std::vector<nb::object> unpack_hook_fns;
  /// Their packed data (same order), so that capture can place a checkpoint
  /// region's tensors; see [Note: Checkpoint regions in the graph] in ca_runtime.
  std::vector<nb::object> unpack_packed;
  /// Set for a Python torch.autograd.Function the graph can call directly.
  std::optional<FunctionInfo> function;
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
  /// Grad mode during the backward (create_graph=True).
  bool create_graph = false;
  /// False for torch.autograd.grad.
  bool accumulate_grad = true;
  /// Run inside a vmap or another functorch transform (is_grads_batched=True,
  /// torch.func.vmap, grad, jvp): its graph takes their wrapped tensors. The
  /// walk's reading, the one the root's key holds; see [Note: Backwards inside
  /// a vmap] (graph_walk.cpp).
  bool inside_a_vmap = false;
  /// Per size input (size_offset-based indices): dynamic, i.e. passed in the
  /// graph's `sizes` list (in order) instead of specialised; see
  /// [Note: Dynamic sizes].
  std::vector<bool> dynamic_sizes;
  /// Walk index of the node where this backward left the cached paths, or
  /// None (first capture); see [Note: Explained misses].
  std::optional<uint32_t> miss_node;
  /// Why, in words (empty for a first capture).
  std::string miss_reason;
  /// The cache entry the graph is stored at (an id of cache_tree()).
  uint64_t entry_id = 0;
};

/// The FunctionInfo of a PyNode the graph can call directly, or nullopt.
std::optional<FunctionInfo> describe_function(
    const NodeState& ns,
    uint32_t hook_offset) {
  Node* node = ns.call.node.get();
  if (!torch_private::is_py_node(*node)) {
    return std::nullopt;
  }
  auto* py_node = static_cast<torch::autograd::PyNode*>(node);
  if (!ns.collected || !ns.call.needed ||
      !ns.collected->sv_to_hooks.empty()) {
    return std::nullopt;
  }
  AutogradCompilerCall& collected = *ns.collected;
  auto objs = collected.pynode_objs.find(py_node);
  if (objs == collected.pynode_objs.end()) {
    return std::nullopt;
  }
  auto* f = reinterpret_cast<THPFunction*>(py_node->pyobj());
  FunctionInfo info;
  const auto& [ctx_idx, backward_state_idx, opaque_indices] = objs->second;
  info.ctx_hook = hook_offset + static_cast<uint32_t>(ctx_idx);
  info.ctx = nb::borrow(py_node->pyobj());
  if (backward_state_idx) {
    info.backward_state_hook = hook_offset + static_cast<uint32_t>(*backward_state_idx);
  }
  for (size_t idx : opaque_indices) {
    info.opaque_hooks.push_back(hook_offset + static_cast<uint32_t>(idx));
  }
  for (const auto& s : f->compiled_autograd_symints) {
    info.symints.push_back(s.guard_int(__FILE__, __LINE__));
  }
  for (const auto& sv : f->saved_variables) {
    const auto& arg = collected.tensor_args.lookup(sv);
    if (arg.defined()) {
      info.saved_slots.emplace_back(ns.tensor_slots.at(arg.index()));
    } else {
      info.saved_slots.emplace_back(std::nullopt);
    }
  }
  info.is_variable_input = f->is_variable_input;
  const size_t num_inputs = py_node->num_inputs();
  info.materialize.resize(num_inputs);
  // PyNode::compiled_args visits its symints, then output_info's sizes.
  uint32_t next_size = static_cast<uint32_t>(f->compiled_autograd_symints.size());
  for (size_t i = 0; i < num_inputs && i < f->output_info.size(); ++i) {
    const uint32_t first_size = next_size;
    next_size += static_cast<uint32_t>(f->output_info[i].size.size());
    const auto& out = f->output_info[i];
    // A non-tensor output's VariableInfo is empty: eager's zeros() for it is
    // an undefined tensor, so its backward gets None there too.
    const bool keep_undefined = !f->materialize_grads || out.is_empty ||
        (py_node->input_metadata(i).was_default_constructed() &&
         !f->materialize_non_diff_grads);
    if (keep_undefined) {
      continue;
    }
    ZerosSpec spec;
    for (const auto& s : out.size) {
      spec.shape.push_back(s.guard_int(__FILE__, __LINE__));
    }
    spec.dtype = nb::borrow(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(out.scalar_type)));
    spec.device = nb::steal(check_py(THPDevice_New(out.device)));
    spec.first_size = first_size;
    info.materialize[i] = std::move(spec);
  }
  return info;
}

} // namespace

nb::object describe_backward(const BackwardState& state, uint64_t entry_id) {
  BackwardGraph graph;
  graph.entry_id = entry_id;
  graph.num_outputs = state.num_outputs;
  graph.num_tensors = static_cast<uint32_t>(state.lifted_tensors.size());
  graph.create_graph = state.create_graph;
  graph.accumulate_grad = state.accumulate_grad;
  graph.inside_a_vmap = state.inside_a_vmap;
  graph.dynamic_sizes = state.dynamic_sizes;
  if (state.miss_node >= 0) {
    graph.miss_node = static_cast<uint32_t>(state.miss_node);
  }
  graph.miss_reason = state.miss_reason;
  graph.nodes.reserve(state.nodes.size());
  // Walk index of each visited node, for the next edges (only needed here,
  // on a miss; the walk itself keeps no such map).
  std::unordered_map<const Node*, uint32_t> walk_index;
  walk_index.reserve(state.nodes.size());
  for (size_t i = 0; i < state.nodes.size(); ++i) {
    walk_index.emplace(state.nodes[i].call.node.get(), static_cast<uint32_t>(i));
  }
  uint32_t hook_offset = 0;
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
      auto it = edge.is_valid() ? walk_index.find(edge.function.get())
                                : walk_index.end();
      if (it == walk_index.end()) {
        info.next_edges.emplace_back(std::nullopt);
      } else {
        info.next_edges.emplace_back(std::make_pair(it->second, edge.input_nr));
      }
    }
    info.needed = ns.call.needed;
    info.graph_output = ns.call.graph_output;
    info.is_accumulate_grad = ns.is_accumulate_grad;
    const NodeCall& call = ns.call;
    info.sequence_nr = node.sequence_nr();
    // A leaf's C++ grad_fn hooks are not collected; see [Note: Leaf node hooks].
    const bool hooks_uncollected = ns.is_accumulate_grad && !ns.leaf_hooks_collected;
    info.num_grad_fn_pre_hooks = static_cast<uint32_t>(
        hooks_uncollected ? node.pre_hooks().size() : call.pre_hooks.size());
    info.num_grad_fn_post_hooks = static_cast<uint32_t>(
        hooks_uncollected ? node.post_hooks().size() : call.post_hooks.size());
    info.num_post_acc_grad_hooks = static_cast<uint32_t>(call.post_acc_grad_hooks.size());
    info.size_offset = graph.num_sizes;
    info.scalar_offset = graph.num_scalars;
    if (ns.collected) {
      const auto num_sizes =
          static_cast<uint32_t>(ns.collected->all_size_inputs.size());
      info.num_apply_sizes = ns.num_apply_sizes;
      info.num_validate_sizes = num_sizes - ns.num_apply_sizes;
      graph.num_sizes += num_sizes;
      if (ns.is_accumulate_grad) {
        info.tensor_slots = ns.tensor_slots;
        if (!ns.tensor_slots.empty()) {
          for (int id : call.post_acc_grad_hooks) {
            info.post_acc_grad_hooks.push_back(hook_offset + static_cast<uint32_t>(id));
          }
        }
      } else {
        info.tensor_slots = ns.tensor_slots;
        info.num_scalars = static_cast<uint32_t>(
            ns.collected->lifted_ivalue_args.args.size());
      }
      for (size_t k = 0; k < ns.tensor_pre_hooks.size(); ++k) {
        const TensorPreHook& h = ns.tensor_pre_hooks[k];
        if (h.opaque != nullptr) {
          info.tensor_pre_hooks.push_back(
              TensorPreHookInfo{TensorPreHookKind::opaque, static_cast<uint32_t>(k), 0});
          continue;
        }
        info.tensor_pre_hooks.push_back(TensorPreHookInfo{
            h.retains_grad ? TensorPreHookKind::retains_grad
                           : (h.is_cpp ? TensorPreHookKind::cpp : TensorPreHookKind::python),
            h.is_cpp ? h.hook_id : hook_offset + h.hook_id,
            h.input_nr});
      }
      for (int id : call.pre_hooks) {
        info.pre_hooks.push_back(hook_offset + static_cast<uint32_t>(id));
      }
      for (int id : call.post_hooks) {
        info.post_hooks.push_back(hook_offset + static_cast<uint32_t>(id));
      }
      info.num_saved_tensor_hooks =
          static_cast<uint32_t>(ns.collected->sv_to_hooks.size());
      {
        const auto num_hooks = static_cast<uint32_t>(ns.collected->hooks.size());
        info.unpack_hooks.resize(ns.collected->packed_inputs.size());
        info.unpack_hook_fns.resize(ns.collected->packed_inputs.size());
        info.unpack_packed.resize(ns.collected->packed_inputs.size());
        for (const auto& [sv, ids] : ns.collected->sv_to_hooks) {
          info.unpack_hooks.at(ids.second) = {
              hook_offset + static_cast<uint32_t>(ids.first),
              hook_offset + num_hooks + static_cast<uint32_t>(ids.second)};
          info.unpack_hook_fns.at(ids.second) =
              nb::borrow(py_object(ns.collected->hooks.at(ids.first)));
          info.unpack_packed.at(ids.second) =
              nb::borrow(py_object(ns.collected->packed_inputs.at(ids.second)));
        }
      }
      info.function = describe_function(ns, hook_offset);
      hook_offset += static_cast<uint32_t>(
          ns.collected->hooks.size() + ns.collected->packed_inputs.size());
    }
    graph.num_scalars += info.num_scalars;
  }
  return nb::cast(std::move(graph));
}
void register_describe(nb::module_& m) {
  nb::class_<ZerosSpec>(m, "ZerosSpec", "Zeros a Python Function's backward gets for an undefined grad.")
      .def_ro("shape", &ZerosSpec::shape)
      .def_ro("dtype", &ZerosSpec::dtype)
      .def_ro("device", &ZerosSpec::device)
      .def_ro("first_size", &ZerosSpec::first_size);
  nb::class_<FunctionInfo>(m, "FunctionInfo", "How the graph calls a Python autograd.Function's backward.")
      .def_ro("ctx_hook", &FunctionInfo::ctx_hook)
      .def_ro("saved_slots", &FunctionInfo::saved_slots)
      .def_ro("is_variable_input", &FunctionInfo::is_variable_input)
      .def_ro("materialize", &FunctionInfo::materialize)
      .def_ro("ctx", &FunctionInfo::ctx)
      .def_ro("symints", &FunctionInfo::symints)
      .def_ro("backward_state_hook", &FunctionInfo::backward_state_hook)
      .def_ro("opaque_hooks", &FunctionInfo::opaque_hooks);
  nb::enum_<TensorPreHookKind>(m, "TensorPreHookKind", "Which kind of tensor pre-hook.")
      .value("python", TensorPreHookKind::python, "Tensor.register_hook: traced.")
      .value("cpp", TensorPreHookKind::cpp, "A C++ hook with compiled_args, called by id.")
      .value("retains_grad", TensorPreHookKind::retains_grad, "retain_grad()'s hook.")
      .value("opaque", TensorPreHookKind::opaque, "A C++ hook without compiled_args.");
  nb::class_<TensorPreHookInfo>(m, "TensorPreHookInfo", "One tensor pre-hook of a node.")
      .def_ro("kind", &TensorPreHookInfo::kind)
      .def_ro("hook", &TensorPreHookInfo::hook)
      .def_ro("input_nr", &TensorPreHookInfo::input_nr);
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
      .def_ro("sequence_nr", &NodeInfo::sequence_nr)
      .def_ro("num_grad_fn_pre_hooks", &NodeInfo::num_grad_fn_pre_hooks)
      .def_ro("num_grad_fn_post_hooks", &NodeInfo::num_grad_fn_post_hooks)
      .def_ro("num_post_acc_grad_hooks", &NodeInfo::num_post_acc_grad_hooks)
      .def_ro("tensor_slots", &NodeInfo::tensor_slots)
      .def_ro("size_offset", &NodeInfo::size_offset)
      .def_ro("num_apply_sizes", &NodeInfo::num_apply_sizes)
      .def_ro("num_validate_sizes", &NodeInfo::num_validate_sizes)
      .def_ro("scalar_offset", &NodeInfo::scalar_offset)
      .def_ro("num_scalars", &NodeInfo::num_scalars)
      .def_ro("tensor_pre_hooks", &NodeInfo::tensor_pre_hooks)
      .def_ro("pre_hooks", &NodeInfo::pre_hooks)
      .def_ro("post_hooks", &NodeInfo::post_hooks)
      .def_ro("post_acc_grad_hooks", &NodeInfo::post_acc_grad_hooks)
      .def_ro("num_saved_tensor_hooks", &NodeInfo::num_saved_tensor_hooks)
      .def_ro("unpack_hooks", &NodeInfo::unpack_hooks)
      .def_ro("unpack_hook_fns", &NodeInfo::unpack_hook_fns)
      .def_ro("unpack_packed", &NodeInfo::unpack_packed)
      .def_ro("function", &NodeInfo::function)
      .def("__repr__", [](const NodeInfo& n) {
        return "NodeInfo(" + std::to_string(n.index) + ", " + n.name + ")";
      });
  nb::class_<BackwardGraph>(m, "BackwardGraph", "A walked backward, handed to capture() on a cache miss.")
      .def_ro("nodes", &BackwardGraph::nodes)
      .def_ro("num_outputs", &BackwardGraph::num_outputs)
      .def_ro("num_tensors", &BackwardGraph::num_tensors)
      .def_ro("num_sizes", &BackwardGraph::num_sizes)
      .def_ro("num_scalars", &BackwardGraph::num_scalars)
      .def_ro("create_graph", &BackwardGraph::create_graph)
      .def_ro("accumulate_grad", &BackwardGraph::accumulate_grad)
      .def_ro("inside_a_vmap", &BackwardGraph::inside_a_vmap)
      .def_ro("dynamic_sizes", &BackwardGraph::dynamic_sizes)
      .def_ro("miss_node", &BackwardGraph::miss_node)
      .def_ro("miss_reason", &BackwardGraph::miss_reason)
      .def_ro("entry_id", &BackwardGraph::entry_id);
}

} // namespace ca
