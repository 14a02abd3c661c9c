// ca_core.h — the types shared by ca_core's translation units: one backward's
// walked state (BackwardState/NodeState), the shadow-graph cache entry
// (ShadowNode) and each component's register_x() entry point.
#pragma once

#include <nanobind/nanobind.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <typeindex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "eager_if_faster.h"
#include "torch_private.h" // getPyInterpreter(); see its list of private uses

namespace ca {

namespace nb = nanobind;
using torch::autograd::Node;
using torch::autograd::variable_list;
using torch::dynamo::autograd::AutogradCompilerCall;
using torch::dynamo::autograd::CacheKey;
using torch::dynamo::autograd::CacheKeyBuffer;
using torch::dynamo::autograd::NodeCall;
using torch::dynamo::autograd::SizeInput;

/*
[Note: How a backward flows through ca_core]
One backward, file by file (each file registers its Python API with
register_x(); module.cpp only calls them):
  1. engine_hook.cpp: torch's engine calls compiled_backward() instead of
     running the graph itself (see [Note: Engine hook lifetime]), which runs
     the steps below (see [Note: The steps of a backward]).
  2. graph_walk.cpp: walk_graph() visits the nodes in eager's order, collects
     each node's compiled_args into its own AutogradCompilerCall (see
     [Note: Per-node collection]) and follows one child per node key down the
     compiler's cache tree (see [Note: The walk's steps]).
  3. shadow_cache.cpp: the tree (see [Note: Cache key]); the entry the walk
     ends at decides hit or miss with its sizes (see [Note: Dynamic sizes]),
     and a miss is explained (see [Note: Explained misses]).
  4. Miss: describe.cpp turns the walked state into a BackwardGraph and
     ca_runtime's capture() builds and compiles an FX graph (see
     [Note: Capture methods] in ca_runtime, and its map, [Note: How a
     backward flows through ca_runtime]); hit: the stored function.
  5. The graph runs: its apply_node(s)/validate_outputs calls are
     node_apply.cpp (saved values swapped in per call, or the node run as
     eager runs it where the values are its own: see [Note: Eager fast path]
     and [Note: Runs of nodes in one call]), generated nodes' functional
     backwards go through compiler_interface.cpp's registry.
  6. engine_hook.cpp again: leaf grads through the real AccumulateGrad nodes,
     saved variables released, final callbacks run; any failure of ours runs
     the backward on the eager engine (see [Note: Eager fallback]).
Every use of torch internals that are not a stable API goes through
torch_private.{h,cpp}, whose header lists them.

[Note: Per-node collection]
torch's compiled autograd collects every node of a backward into one
AutogradCompilerCall. We give each node its own AutogradCompilerCall instead.
Its tensor_args, all_size_inputs and lifted_ivalue_args then hold exactly the
values *this* node lifted, in the order its compiled_args visited them, which is
the order SwapSavedVariables consumes them in apply_with_saved. That is what
lets apply_with_saved(node, inputs, saved_tensors, saved_sizes, saved_scalars)
take a node's saved values explicitly (a swap per call) without patching
torch's header. The price is that torch's edge ids (node_calls) would be local
to the node, so the walk writes its own graph-wide node ids for every next edge
into the key; see [Note: Cache key].
*/

/// One tensor pre-hook of a node, in the order eager calls them; see
/// [Note: Hook order].
struct TensorPreHook {
  /// A C++ hook (the node's collected->cpp_tensor_pre_hooks) rather than a
  /// Python one (collected->hooks).
  bool is_cpp = false;
  /// Installed by retain_grad() (always C++).
  bool retains_grad = false;
  /// Index into the node's own hook list of that kind.
  uint32_t hook_id = 0;
  /// The node input (grad) the hook sees and may replace.
  uint32_t input_nr = 0;
  /// A C++ hook without compiled_args (e.g. a C++ Tensor::register_hook on
  /// a non-leaf): called as a whole, on all the node's input grads, behind a
  /// graph break. Owned by the node, which the backward keeps alive.
  torch::autograd::FunctionPreHook* opaque = nullptr;
};

/// One visited node of the backward being run, in walk order.
struct NodeState {
  NodeState(uint32_t id, c10::intrusive_ptr<Node> node)
      : call(id, std::move(node)) {}
  /// torch's NodeCall: the node, its hooks and graph outputs, `needed`.
  NodeCall call;
  /// This node's lifted tensors, sizes and scalars; see [Note: Per-node collection].
  std::unique_ptr<AutogradCompilerCall> collected;
  /// How many of collected->all_size_inputs compiled_args visited; the rest
  /// belong to the next edges' input metadata (validate_outputs).
  uint32_t num_apply_sizes = 0;
  /// True for AccumulateGrad: applied after the compiled graph, not traced.
  bool is_accumulate_grad = false;
  /// AccumulateGrad whose grad_fn pre/post hooks are all Python's: collected
  /// like any node's, so the graph can call them; see [Note: Leaf node hooks].
  bool leaf_hooks_collected = false;
  /// Index into BackwardState::lifted_tensors of each of collected's tensors
  /// (for AccumulateGrad: empty, or its variable's slot alone; see [Note:
  /// Leaves accumulated in the graph]); see [Note: Lifted tensor de-duplication].
  std::vector<uint32_t> tensor_slots;
  /// Tensor pre-hooks (Python, C++, retain_grad) in eager's call order.
  std::vector<TensorPreHook> tensor_pre_hooks;
  /// While apply_node runs this node: its saved tensors with unpack hooks,
  /// already unpacked by the graph, by packed-input id (collected->
  /// packed_inputs order); call_unpack hands them to SwapSavedVariables.
  /// See [Note: Unpack hooks in the graph].
  const variable_list* unpacked = nullptr;
  /// It ran for real on this backward with its own saved values (or freed
  /// ones put back); see [Note: Nodes that run for real keep their saved tensors].
  bool ran_for_real = false;
  /// Its hook registries when the walk visited it
  /// (torch_private::hook_registry_signature); see [Note: Hooks changed
  /// while a graph runs].
  uint64_t hook_signature = 0;
};

struct ShadowNode;

/// What a node looked like when its key first led to a cache entry, kept to
/// explain later misses in words; see [Note: Explained misses].
struct NodeSummary {
  /// Node::name().
  std::string name;
  /// Demangled C++ type.
  std::string type;
  /// Hooks by kind: Python tensor pre-hooks, C++ tensor pre-hooks (incl.
  /// retain_grad), grad_fn pre-hooks, grad_fn post-hooks, post-accumulate-grad.
  std::array<uint32_t, 5> hooks{};
  /// Per lifted tensor: "dtype device [requires_grad]".
  std::vector<std::string> tensors;
  /// AccumulateGrad: 1 if the leaf's .grad was defined, 0 if not; else -1.
  int grad_defined = -1;
};

/// Everything the walk of one backward produced; alive for that backward,
/// then recycled; see [Note: Recycled walk state].
struct BackwardState {
  /// Back to the state of a fresh BackwardState, keeping the buffers' capacity.
  void reset();
  /// Visited nodes in eager's execution order.
  std::vector<NodeState> nodes;
  /// The graph's tensor inputs: every traced node's lifted tensors, each
  /// distinct tensor once, in first-use order.
  std::vector<at::Tensor> lifted_tensors;
  /// Number of values the engine expects back (torch.autograd.grad outputs).
  size_t num_outputs = 0;
  /// The cache entry the walk ended at.
  ShadowNode* entry = nullptr;
  /// graph_task.keep_graph_: keep saved variables after the backward.
  bool keep_graph = false;
  /// Whether leaf grads are accumulated (backward) or returned (grad).
  bool accumulate_grad = true;
  /// Grad mode of the backward (create_graph=True).
  bool create_graph = false;
  /// The backward runs inside a vmap or another functorch transform, as the
  /// root's key records; see [Note: Backwards inside a vmap].
  bool inside_a_vmap = false;
  /// Some leaf with post-accumulate-grad hooks lifts its variable (see
  /// [Note: Leaves accumulated in the graph]): its hooks may mutate it, so
  /// without create_graph non-leaf lifted tensors go in detached.
  bool leaf_hooks_in_graph = false;
  /// Per size input of this backward: dynamic in the graph being captured.
  std::vector<bool> dynamic_sizes;
  /// (lifted tensor, dim) pairs whose extent changed since the last capture:
  /// marked dynamic before the graph's first run.
  std::vector<std::pair<uint32_t, uint32_t>> dynamic_dims;
  /// Walk index of the first node with Python objects (hooks, a Function's
  /// ctx, packed saved data), or -1: no user code runs before it; see
  /// [Note: Hooks changed while a graph runs].
  int64_t first_python_node = -1;
  /// torch_private::largest_post_hook_id of that node when the walk reached
  /// it; see [Note: Hooks changed while a graph runs].
  uint64_t first_python_node_post_hook_id = 0;
  /// Walk index of the first node whose key was new to the cache, or -1.
  int64_t miss_node = -1;
  /// Why that key was new, in words; see [Note: Explained misses].
  std::string miss_reason;
  /// A cache hit without retain_graph: a node run with its own saved values
  /// releases them right after, as the eager engine does; see [Note: Nodes
  /// that run for real keep their saved tensors].
  bool release_after_apply = false;
  /// Emptied AutogradCompilerCalls of earlier backwards, for the next walk's
  /// nodes; see [Note: Recycled walk state].
  std::vector<std::unique_ptr<AutogradCompilerCall>> spare_calls;
  /// Emptied NodeState::tensor_slots vectors, kept for their capacity.
  std::vector<std::vector<uint32_t>> spare_slots;
};

/// Alive while a tree of the cache is in use (a backward in the hook, a
/// Python call reading or emptying a tree): what the cache lets go of
/// meanwhile is destroyed only when the last one ends. Needs the GIL. See
/// [Note: What the cache lets go of] (shadow_cache.cpp).
struct CacheUse {
  CacheUse();
  ~CacheUse();
  CacheUse(const CacheUse&) = delete;
  CacheUse& operator=(const CacheUse&) = delete;
};

/// Takes `obj` out of a cache entry (leaving it null) into the graveyard;
/// see [Note: What the cache lets go of].
void release_later(nb::object& obj);

/// A fresh ShadowNode::id.
uint64_t next_shadow_node_id();

/// Lookups that hashed a key since the last reset_keys_hashed(), for
/// ca_core.timings(); see [Note: The child taken last].
uint64_t keys_hashed();
void reset_keys_hashed();

/// A node of the shadow-graph cache: one edge per distinct CacheKey.
struct ShadowNode {
  /// Unique in the process, for the node's life: cache_tree()'s ids and
  /// BackwardGraph.entry_id.
  uint64_t id = next_shadow_node_id();
  /// Children keyed by the next node's key; see [Note: Cache key].
  std::unordered_map<CacheKey, std::unique_ptr<ShadowNode>> next;
  /// Owns the bytes the keys of `next` point to.
  std::vector<CacheKeyBuffer> key_storage;
  /// The child the last lookup() led to, or null; tried before hashing, see
  /// [Note: The child taken last].
  ShadowNode* last_child = nullptr;
  /// Its key, whose bytes live in key_storage.
  CacheKey last_key{typeid(void), nullptr, 0};
  /// Size inputs seen at the last capture; a differing static size is a
  /// miss. See [Note: Dynamic sizes]. Without a graph: those of the last
  /// deferred backward; see [Note: Sightings whose sizes changed].
  std::vector<int64_t> expected_sizes;
  /// Per size input: dynamic (a SymInt input of the graph) since it changed.
  std::vector<bool> dynamic_sizes;
  /// Shapes of the lifted tensors at the last capture (without a graph: at
  /// the last deferred backward), to find the dimensions that changed with a
  /// size.
  std::vector<std::vector<int64_t>> tensor_shapes;
  /// The compiled backward, or null before the first capture.
  nb::object compiled_fn;
  /// Capture or first run failed here: later backwards go eager at once.
  bool failed = false;
  /// Why it failed, in the runtime's words (empty while not failed).
  std::string failure;
  /// A graph with dynamic sizes failed to compile here: sizes stay static
  /// (one capture per new value); see [Note: Static when dynamic fails].
  bool static_sizes = false;
  /// The compiled function has not completed a run yet.
  bool first_run = true;
  /// While the graph's kernels compile on another thread, a callable that
  /// says whether they are ready; null otherwise. See [Note: Eager while compiling].
  nb::object compiling;
  /// Backwards served by compiled_fn.
  uint64_t hits = 0;
  /// Backwards that reached this entry without a graph and ran eagerly because
  /// the runtime deferred their capture; see [Note: Deferred captures].
  uint32_t sightings = 0;
  /// Walk index of each AccumulateGrad node whose grad the graph returns
  /// (after the torch.autograd.grad outputs), in output order; the others
  /// were accumulated inside the graph.
  std::vector<uint32_t> leaf_outputs;
  /// Per leaf output: accumulated by the graph, only its grad_fn post hooks
  /// run after it; see [Note: Leaves accumulated in the graph].
  std::vector<bool> leaf_hooks_only;
  /// Walk index of each node whose saved tensors are dropped before the
  /// graph runs on a hit; see [Note: Saved tensors freed early].
  std::vector<uint32_t> free_early;
  /// Per free_early node: it ran for real on the last hit, so the next hit
  /// keeps its saved tensors; see [Note: Nodes that run for real keep their
  /// saved tensors].
  std::vector<bool> ran_for_real;
  /// Whether its hits run compiled or on the eager engine, and the timings
  /// that chose; see [Note: Eager if faster].
  EagerIfFaster eager_if_faster;

  /// What the node whose key leads here looked like; see [Note: Explained misses].
  std::unique_ptr<NodeSummary> summary;
  /// Types of next nodes whose collection failed after this path: such a
  /// backward goes eager at once, without a new warning.
  std::vector<std::type_index> walk_failures;

  /// An entry whose hits EagerIfFaster may serve either way: its capture allowed
  /// eager runs and its graph has run once, is not failed and is not still
  /// compiling; see [Note: Eager if faster] and [Note: Eager without
  /// the walk].
  bool may_choose() const {
    return eager_if_faster.eligible && !failed && !first_run && !compiling.is_valid() && compiled_fn.is_valid();
  }
  /// The child for `key`, created (with `created` set) if new.
  ShadowNode* lookup(const CacheKey& key, bool& created);
  void clear();
  /// Forgets every failure at or below this node (cache_clear_failed()).
  void clear_failed();
};

/// The cache root of one compiler (`compiler_key`, e.g. "backend:inductor"),
/// created on first use. Guarded by the GIL: see [Note: Cache and the GIL]
/// and [Note: One cache per compiler].
ShadowNode& cache_root(const std::string& compiler_key);
/// Changes when clear_cache() empties every tree or drop_cache_root() empties
/// `root`'s; an in-flight capture that sees it change drops its result. See
/// [Note: Cache and the GIL].
uint64_t cache_generation(const ShadowNode& root);

/// A node's compiled_args failed during the walk; names the node.
struct WalkError : std::runtime_error {
  WalkError(
      std::string node_name,
      const std::string& reason,
      bool remembered,
      ShadowNode* at,
      std::type_index type)
      : std::runtime_error(reason),
        node(std::move(node_name)),
        remembered(remembered),
        at(at),
        type(type) {}
  /// Node::name() of the node whose compiled_args threw.
  std::string node;
  /// The failure was already reported for this path: no new warning.
  bool remembered;
  /// The cache node the walk had reached: where to remember the failure once
  /// the eager engine showed it was ours; see [Note: Whose failure].
  ShadowNode* at;
  /// The failing node's type, for ShadowNode::walk_failures.
  std::type_index type;
};

/// Deleter of a BackwardState: resets it and keeps it for the thread's next
/// backward (or frees it); see [Note: Recycled walk state]. Needs the GIL.
struct RecycleBackwardState {
  void operator()(BackwardState* state) const;
};
using BackwardStatePtr = std::unique_ptr<BackwardState, RecycleBackwardState>;

/// Walks the graph of `graph_task` from `root` in eager's order, computing
/// every node's key and lifted values. Throws WalkError when a node's
/// compiled_args throws.
BackwardStatePtr walk_graph(
    ShadowNode& cache,
    const c10::intrusive_ptr<Node>& root,
    const torch::autograd::GraphTask& graph_task,
    const torch::autograd::edge_list& output_edges);

/// Whether `a` and `b` are the same strided view of one storage (an alias of
/// a saved output); see [Note: Aliases of a saved output] (graph_walk.cpp).
bool same_tensor_view(const at::Tensor& a, const at::Tensor& b);

/// `t`, or real zeros of its shape where it is an efficient ZeroTensor that
/// does not require grad; see [Note: ZeroTensors kept out of compiled graphs]
/// (node_apply.cpp).
at::Tensor materialized_zeros(const at::Tensor& t);

/// materialized_zeros() on each of `tensors`, in place.
void materialize_zero_tensors(variable_list& tensors);

/// Demangled C++ type of a node ("torch::autograd::generated::MulBackward0").
std::string node_type_name(const Node& node);

/// The backward whose compiled graph is running on this thread (or null).
BackwardState*& active_backward();

/// The node whose apply_with_saved is running on this thread (or null); the
/// compiler interface's call_unpack reads its saved-tensor hooks.
NodeState*& applying_node();

/// Sets a thread-local slot (active_backward(), applying_node()) for a
/// scope and puts the prior value back, so nested scopes unwind correctly.
template <typename T>
struct ScopedSlot {
  ScopedSlot(T*& slot, T* value) : slot_(slot), prior_(std::exchange(slot, value)) {}
  ~ScopedSlot() {
    slot_ = prior_;
  }
  ScopedSlot(const ScopedSlot&) = delete;
  ScopedSlot& operator=(const ScopedSlot&) = delete;

 private:
  T*& slot_;
  T* prior_;
};

/// The ca_runtime object while the engine hook is installed (borrowed), else null.
PyObject* installed_runtime();

/// Runs a leaf's real AccumulateGrad node as eager's call_function does: its
/// grad_fn pre-hooks, the node (on a copy of the inputs when it has post
/// hooks, as the engine copies them), then its post hooks (e.g. the C++ DDP
/// Reducer's). Its tensor pre-hooks ran in the graph. See [Note: Leaf node hooks].
void run_leaf_node(Node& fn, at::Tensor grad);

/// Counts a node run through [Note: Freed saved tensors put back] (engine_hook.cpp's counters).
void count_node_put_back();

/// Runs only the grad_fn post hooks of a leaf the graph accumulated (outputs
/// empty, inputs = {grad}), after the graph; see [Note: Leaves accumulated in
/// the graph].
void run_leaf_post_hooks(Node& fn, at::Tensor grad);

/// Installs ca_core's PyCompilerInterface for a scope, so that nodes'
/// apply_with_saved run their functional backward on the values given.
/// torch has one process-wide slot that refuses a second install, so scopes
/// share one installation, counted across threads; see
/// [Note: One compiler interface for all threads].
struct InterfaceScope {
  InterfaceScope();
  ~InterfaceScope();
  InterfaceScope(const InterfaceScope&) = delete;
  InterfaceScope& operator=(const InterfaceScope&) = delete;
};

/// Borrowed pointer to a Python object torch collected (hook, ctx, packed data).
inline PyObject* py_object(const c10::SafePyObject& obj) {
  return obj.ptr(getPyInterpreter());
}

/// While alive on this thread, ca_core's compiler interface records the
/// is_traceable flag a C++ Function (CppNode) binds with and returns from
/// call_function without running the backward. Used to learn, at capture,
/// whether a CppNode may be traced or needs a graph break.
struct TraceabilityProbe {
  TraceabilityProbe();
  ~TraceabilityProbe();
  TraceabilityProbe(const TraceabilityProbe&) = delete;
  TraceabilityProbe& operator=(const TraceabilityProbe&) = delete;
  /// Set by bind_function during the probe.
  std::optional<bool> is_traceable;

 private:
  TraceabilityProbe* prior_;
};
/// The probe active on this thread, or null.
TraceabilityProbe* active_probe();

/// Builds the Python description of a walked backward handed to capture(),
/// to be stored at the cache entry `entry_id` (ShadowNode::id).
nb::object describe_backward(const BackwardState& state, uint64_t entry_id);

// shadow_cache.cpp: miss explanations and the dynamic-size policy of an entry.

/// What a node looks like, kept on the child a new key creates; see [Note: Explained misses].
std::unique_ptr<NodeSummary> summarize(const NodeState& ns, Node* fn);
/// Why `now` (with key `key`) is not the cached sibling; see [Note: Explained misses].
std::string explain_new_key(
    const ShadowNode& parent,
    const ShadowNode* created,
    const NodeSummary& now);
/// Whether a backward's sizes fit an entry: equal, or dynamic there.
bool sizes_match(const ShadowNode& entry, const std::vector<int64_t>& sizes);
/// Whether size input `i` of a backward, `value`, fits the entry (sizes_match per size).
bool size_fits(const ShadowNode& entry, size_t i, int64_t value);
/// The lifted tensors' shapes, remembered by an entry at capture.
std::vector<std::vector<int64_t>> tensor_shapes(const BackwardState& state);
/// On a miss: which sizes and tensor dims the new graph takes as dynamic.
void choose_dynamic(const ShadowNode& entry, const std::vector<int64_t>& sizes, BackwardState& state);
/// Why a backward missed an entry on its sizes alone.
void explain_sizes(const ShadowNode& entry, const std::vector<int64_t>& sizes, BackwardState& state);
/// The graph's `sizes` input; see [Note: Signed dynamic sizes].
nb::list dynamic_size_args(const std::vector<bool>& dynamic, const std::vector<int64_t>& sizes);

// Component registration; module.cpp calls each once.
void register_engine_hook(nb::module_& m);
void register_graph_walk(nb::module_& m);
void register_shadow_cache(nb::module_& m);
void register_node_apply(nb::module_& m);
/// describe.cpp: NodeInfo, BackwardGraph and the other seam types.
void register_describe(nb::module_& m);
void register_compiler_interface(nb::module_& m);
/// testing_helpers.cpp: ca_core._C._testing, C++ Functions and hooks for the tests.
void register_testing_helpers(nb::module_& m);

} // namespace ca
