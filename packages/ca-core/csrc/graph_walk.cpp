// graph_walk.cpp — walks one backward's autograd graph in eager's order,
// computes each node's cache key and lifted values, and follows those keys
// down the shadow-graph cache (shadow_cache.cpp).
#include "ca_core.h"
#include "torch_private.h"

#include <ATen/LegacyVmapMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <nanobind/stl/string.h>

#include <cxxabi.h>

#include <algorithm>
#include <typeinfo>

namespace ca {

using torch::autograd::AccumulateGrad;
using torch::autograd::GraphTask;
using torch::dynamo::autograd::CompiledNodeArgs;

/*
[Note: Lifted tensor de-duplication]
A tensor saved by several nodes (x * x, a weight used twice) is one graph
input: the walk gives each distinct TensorImpl a slot in first-use order and
every node refers to its tensors by slot. Which slots a node uses is part of
its key (one collect_size per tensor), so a later backward with the same key
path has the same aliasing and the graph built for the first stays valid.
AccumulateGrad's tensors are not graph inputs (the node runs after the graph),
except the variable of a leaf with post-accumulate-grad hooks.

[Note: Aliases of a saved output]
A node saving its own output (LogSoftmaxBackward's result, ExpBackward's)
keeps it without its grad_fn, and every unpack makes a new TensorImpl on the
same storage, so a tensor saved both as an output and by a later node as an
input (log_softmax's result, which NllLossBackward saves too) came to the
graph as two inputs. A compiled graph frees an input after its last use, but
an input it never reads (Inductor's nll_loss_backward ignores its self)
lives until the graph returns, and with it the storage both share: 1 MiB
held through the whole backward of the bench's GPT-style decoder. So the
walk gives a non-leaf tensor the slot of the first one lifted with the same
grad_fn when they are the same view (same_tensor_view: storage, offset,
sizes, strides, dtype, output_nr, conj/neg bits): one input, freed where the
graph last reads it. A node handed the other alias runs as it is (see
[Note: Eager fast path]): the values are the same.

[Note: Leaves accumulated in the graph]
A leaf without C++ grad_fn pre-hooks has its variable lifted (NodeInfo.tensor_slots[0],
unused graph inputs cost nothing once the capture drops them) and its
post-accumulate-grad hooks listed (NodeInfo.post_acc_grad_hooks). The capture
accumulates such a leaf inside the graph, with torch.ops.inductor.accumulate_grad_
at its eager position, when eager order is observable: it has
post-accumulate-grad hooks (DDP's python_reducer all-reduce, an optimizer step
in a hook), traced after it as torch's compiled autograd does, or user code
(a hook, a Function's backward, FSDP2's post-backward) runs after it and may
read its .grad. Its real node does not run then. Every other leaf stays a
graph output, accumulated by its real node after the graph (which can steal
the grad instead of copying it). If it also has grad_fn
post hooks (the C++ DDP Reducer's autograd_hook, registered even with the
python_reducer, where it returns at once), its input grad is still a leaf
output and run_leaf_post_hooks calls just those hooks after the graph, as
before: later than eager when later hooks exist (a known difference; torch's
compiled autograd drops such C++ hooks altogether). The lifted slot is part
of the key as for any other node.

A hook may mutate its parameter in place (an optimizer step), and another
lifted tensor may be a view of it (AddmmBackward saves weight.t()): AOTAutograd
then refuses inputs that alias where some are leaves and some are not
("any_leaf=True != all_leaf=False"; torch 2.13's own compiled autograd fails
so). Without create_graph the saved tensors' autograd history is unused, so
such a backward lifts non-leaf tensors detached (lift_args): every aliasing
input is then a leaf and AOTAutograd's synthetic base handles the mutation.

[Note: Hook order]
The eager engine calls a node's tensor pre-hooks in registration order, Python
and C++ ones interleaved, then its retain_grad hooks, then its grad_fn
pre-hooks, the node, and its post-hooks. torch's NodeCall keeps Python and C++
tensor pre-hooks in two separate lists, which loses the interleaving, so the
walk visits the hooks itself (collect_hooks below) and records each tensor
pre-hook in NodeState::tensor_pre_hooks in the order eager calls it. The hook
objects themselves are not part of the key, only their number and position:
they are passed to the graph on every backward (the graph's `hooks` input), so
a new closure registered at the same place is served by the same graph.
*/

/*
[Note: Recycled walk state]
The walk runs on every backward, so what it allocates per node is the hit
path's cost. Three things keep that down:
  - a BackwardState is not freed after its backward but reset and kept for
    the thread's next one (RecycleBackwardState): its vectors keep their
    capacity, and no large block is freed per backward (freeing one makes
    glibc consolidate every small free chunk, which then slows all the
    small allocations of the next walk);
  - the walk's own bookkeeping (node ids, dependencies left, tensor slots)
    lives in open-addressing PointerMaps kept per thread, which allocate
    nothing per entry;
  - each node's AutogradCompilerCall (torch's type, see [Note: Per-node
    collection]) and tensor_slots vector are emptied by reset() and handed
    to a later walk's nodes, so their vectors and hash-map buckets keep
    their storage. torch_private::clear_compiler_call empties every field
    to a fresh one's state (item 10 of torch_private.h; its layout is
    checked at build time). Making and destroying them per node was about a
    quarter of a cache hit's own cost (bench/LOG.md, 2026-12-02). The spares a
    state keeps are bounded by twice its last backward's node count.
CompiledNodeArgs (torch's, holding a node's key bytes while the walk follows
it) is still made per node.
*/

void BackwardState::reset() {
  // The spares of an earlier, larger graph beyond twice this one's go.
  const size_t keep = 2 * nodes.size();
  for (auto& ns : nodes) {
    if (ns.collected && spare_calls.size() < keep) {
      torch_private::clear_compiler_call(*ns.collected);
      spare_calls.push_back(std::move(ns.collected));
    }
    if (ns.tensor_slots.capacity() > 0 && spare_slots.size() < keep) {
      ns.tensor_slots.clear();
      spare_slots.push_back(std::move(ns.tensor_slots));
    }
  }
  if (spare_calls.size() > keep) {
    spare_calls.resize(keep);
  }
  if (spare_slots.size() > keep) {
    spare_slots.resize(keep);
  }
  nodes.clear();
  lifted_tensors.clear();
  num_outputs = 0;
  entry = nullptr;
  keep_graph = false;
  accumulate_grad = true;
  create_graph = false;
  inside_a_vmap = false;
  first_python_node = -1;
  first_python_node_post_hook_id = 0;
  leaf_hooks_in_graph = false;
  dynamic_sizes.clear();
  dynamic_dims.clear();
  miss_node = -1;
  miss_reason.clear();
  release_after_apply = false;
}

namespace {


/// Reset BackwardStates kept for this thread's next backwards.
thread_local std::vector<std::unique_ptr<BackwardState>> t_spare_states;

BackwardStatePtr new_backward_state() {
  if (t_spare_states.empty()) {
    return BackwardStatePtr(new BackwardState());
  }
  BackwardStatePtr state(t_spare_states.back().release());
  t_spare_states.pop_back();
  return state;
}

/// Map from a pointer to a small value, with linear probing; clear() keeps
/// the storage. See [Note: Recycled walk state].
template <typename V>
class PointerMap {
 public:
  /// Empties the map, sized for about `expected` entries.
  void clear(size_t expected) {
    size_t capacity = 16;
    while (capacity < expected * 2) {
      capacity <<= 1;
    }
    // Shrinks too: after one huge graph, a small one must not clear (and
    // keep) storage sized for the huge one.
    if (slots_.size() < capacity || slots_.size() > capacity * 4) {
      slots_.assign(capacity, Slot{});
      slots_.shrink_to_fit();
    } else {
      std::fill(slots_.begin(), slots_.end(), Slot{});
    }
    size_ = 0;
  }
  /// The value for `key` (value-initialised when new) and whether it is new.
  std::pair<V*, bool> try_emplace(const void* key) {
    if ((size_ + 1) * 2 > slots_.size()) {
      grow();
    }
    const size_t mask = slots_.size() - 1;
    size_t i = hash(key) & mask;
    while (slots_[i].key != nullptr && slots_[i].key != key) {
      i = (i + 1) & mask;
    }
    if (slots_[i].key == key) {
      return {&slots_[i].value, false};
    }
    slots_[i].key = key;
    slots_[i].value = V{};
    ++size_;
    return {&slots_[i].value, true};
  }

 private:
  struct Slot {
    /// The pointer mapped, or null for an empty slot.
    const void* key = nullptr;
    /// Its value.
    V value{};
  };
  static size_t hash(const void* p) {
    auto x = reinterpret_cast<uint64_t>(p);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }
  void grow() {
    std::vector<Slot> old(std::max<size_t>(slots_.size() * 2, 16));
    old.swap(slots_);
    size_ = 0;
    for (const Slot& slot : old) {
      if (slot.key != nullptr) {
        *try_emplace(slot.key).first = slot.value;
      }
    }
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

/// What the walk tracks per node it has seen.
struct NodeMark {
  static constexpr uint32_t kNoId = UINT32_MAX;
  /// Graph-wide id (discovery order), kNoId until one is given.
  uint32_t id = kNoId;
  /// Dependencies not yet visited; valid when `counted`.
  int remaining = 0;
  /// `remaining` was read from the GraphTask's dependency count.
  bool counted = false;
};

/// The walk's per-thread scratch maps; see [Note: Recycled walk state].
struct WalkScratch {
  /// Per node seen: its id and the dependencies it still waits for.
  PointerMap<NodeMark> nodes;
  /// Per distinct lifted TensorImpl: its graph-input slot.
  PointerMap<uint32_t> slots;
  /// Per grad_fn: the slot of the first non-leaf tensor lifted with it; see
  /// [Note: Aliases of a saved output]. Value slot + 1 (0: none yet).
  PointerMap<uint32_t> output_slots;
  /// Heap of nodes ready to visit, highest sequence_nr first.
  std::vector<Node*> ready;
  /// A walk on this thread is using this scratch.
  bool in_use = false;
};
thread_local WalkScratch t_scratch;

/// Orders ready nodes as eager's ReadyQueue does: highest sequence_nr first
/// (AccumulateGrad has the largest).
struct LaterSequenceFirst {
  bool operator()(const Node* a, const Node* b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

/// collect(NodeCall) with the tensor pre-hook order recorded; see [Note: Hook order].
void collect_node_call(CompiledNodeArgs& args, NodeState& ns, Node* fn) {
  NodeCall& call = ns.call;
  args.collect_size(call.id);
  args.collect(call.graph_output);
  auto record_new = [&](size_t py_before, size_t cpp_before, bool retains) {
    for (size_t i = py_before; i < call.tensor_pre_hooks.size(); ++i) {
      const auto& [id, input_nr] = call.tensor_pre_hooks[i];
      ns.tensor_pre_hooks.push_back(TensorPreHook{
          false, false, static_cast<uint32_t>(id), static_cast<uint32_t>(input_nr)});
    }
    for (size_t i = cpp_before; i < call.cpp_tensor_pre_hooks.size(); ++i) {
      const auto& [id, input_nr] = call.cpp_tensor_pre_hooks[i];
      ns.tensor_pre_hooks.push_back(TensorPreHook{
          true, retains, static_cast<uint32_t>(id), static_cast<uint32_t>(input_nr)});
    }
  };
  for (const auto& hook : fn->tensor_pre_hooks()) {
    const size_t py = call.tensor_pre_hooks.size();
    const size_t cpp = call.cpp_tensor_pre_hooks.size();
    try {
      hook->compiled_args(args);
    } catch (const c10::NotImplementedError& e) {
      // FunctionPreHook's default compiled_args throws before collecting
      // anything; such a hook is called whole, eagerly.
      if (!torch_private::is_compiled_args_nyi(e)) {
        throw;
      }
      ns.tensor_pre_hooks.push_back(TensorPreHook{true, false, 0, 0, hook.get()});
      args.collect(std::string(typeid(*hook).name()));
      continue;
    }
    record_new(py, cpp, false);
  }
  for (const auto& [_, hook] : fn->retains_grad_hooks()) {
    const size_t py = call.tensor_pre_hooks.size();
    const size_t cpp = call.cpp_tensor_pre_hooks.size();
    hook->compiled_args(args);
    record_new(py, cpp, true);
  }
  if (ns.is_accumulate_grad) {
    ns.leaf_hooks_collected =
        std::all_of(fn->pre_hooks().begin(), fn->pre_hooks().end(),
                    [](const auto& h) { return torch_private::is_python_pre_hook(*h); }) &&
        std::all_of(fn->post_hooks().begin(), fn->post_hooks().end(),
                    [](const auto& h) { return torch_private::is_python_post_hook(*h); });
    args.collect(ns.leaf_hooks_collected);
  }
  if (ns.is_accumulate_grad && !ns.leaf_hooks_collected) {
    // C++ hooks run around the real node, never traced; see [Note: Leaf node hooks].
    auto collect_types = [&](const auto& hooks) {
      args.collect_size(hooks.size());
      for (const auto& hook : hooks) {
        args.collect(std::string(typeid(*hook).name()));
      }
    };
    collect_types(fn->pre_hooks());
    collect_types(fn->post_hooks());
  } else {
    for (const auto& hook : fn->pre_hooks()) {
      hook->compiled_args(args);
    }
    for (const auto& hook : fn->post_hooks()) {
      hook->compiled_args(args);
    }
  }
  args.collect_size(ns.tensor_pre_hooks.size());
  for (const auto& h : ns.tensor_pre_hooks) {
    args.collect(h.opaque != nullptr);
    args.collect(h.is_cpp);
    args.collect(h.retains_grad);
    args.collect_size(h.input_nr);
  }
  args.collect_size(call.pre_hooks.size());
  args.collect_size(call.post_hooks.size());
}

} // namespace

bool same_tensor_view(const at::Tensor& a, const at::Tensor& b) {
  // See [Note: Aliases of a saved output].
  if (!a.defined() || !b.defined()) {
    return false;
  }
  const c10::TensorImpl& x = *a.unsafeGetTensorImpl();
  const c10::TensorImpl& y = *b.unsafeGetTensorImpl();
  if (x.layout() != c10::kStrided || y.layout() != c10::kStrided || !x.has_storage() ||
      !y.has_storage() || x.is_python_dispatch() || y.is_python_dispatch() ||
      x.has_symbolic_sizes_strides() || y.has_symbolic_sizes_strides()) {
    return false;
  }
  return x.storage().unsafeGetStorageImpl() == y.storage().unsafeGetStorageImpl() &&
      x.storage_offset() == y.storage_offset() && x.dtype() == y.dtype() &&
      x.sizes() == y.sizes() && x.strides() == y.strides() && x.is_conj() == y.is_conj() &&
      x.is_neg() == y.is_neg() && a.output_nr() == b.output_nr();
}

std::string node_type_name(const Node& node) {
  const char* mangled = typeid(node).name();
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(
      abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && demangled ? std::string(demangled.get())
                                  : std::string(mangled);
}

void RecycleBackwardState::operator()(BackwardState* state) const {
  state->reset();
  if (t_spare_states.size() < 2) {
    t_spare_states.emplace_back(state);
  } else {
    delete state;
  }
}

namespace {

/*
[Note: The walk's steps]
GraphWalk visits the nodes of one backward in eager's order (a heap of ready
nodes, highest sequence_nr first). Per node it:
  1. visit: appends its NodeState (graph outputs, whether it is needed);
  2. collect: runs collect_node_call and the node's compiled_args into the
     node's own AutogradCompilerCall (see [Note: Per-node collection]),
     lifting its tensors into graph-wide slots (see [Note: Lifted tensor
     de-duplication]) and keying its next edges;
  3. descend: follows the node's key one level down the cache tree,
     explaining the first new key (see [Note: Explained misses]);
  4. release: counts down its next nodes' dependencies, pushing those now
     ready.
The GraphTask stays untouched (dependencies are counted in the walk's own
scratch), so an eager fallback can still run it.
*/
class GraphWalk {
 public:
  GraphWalk(
      ShadowNode& cache_root,
      const c10::intrusive_ptr<Node>& root,
      const GraphTask& graph_task,
      const torch::autograd::edge_list& output_edges)
      : root_(root),
        graph_task_(graph_task),
        output_edges_(output_edges),
        exec_info_(graph_task.exec_info_),
        check_exec_info_(!exec_info_.empty()),
        // The walk does not run Python or nest, but a private scratch keeps
        // it correct if it ever did.
        scratch_(t_scratch.in_use ? private_scratch_ : t_scratch),
        cache_(&cache_root) {
    scratch_.in_use = true;
    state_ = new_backward_state();
    state_->num_outputs = output_edges.size();
    state_->keep_graph = graph_task.keep_graph_;
    const size_t expected_nodes = check_exec_info_ ? exec_info_.size()
                                                   : graph_task.dependencies_.size() + 1;
    state_->nodes.reserve(expected_nodes);
    scratch_.nodes.clear(expected_nodes);
    scratch_.slots.clear(expected_nodes);
    scratch_.output_slots.clear(expected_nodes);
    scratch_.ready.clear();
  }
  ~GraphWalk() {
    scratch_.in_use = false;
  }
  GraphWalk(const GraphWalk&) = delete;
  GraphWalk& operator=(const GraphWalk&) = delete;

  /// Walks every node; throws WalkError when a node's compiled_args throws.
  BackwardStatePtr run() {
    push_ready(root_.get());
    id_of(root_.get());
    while (!scratch_.ready.empty()) {
      std::pop_heap(scratch_.ready.begin(), scratch_.ready.end(), LaterSequenceFirst{});
      Node* fn = scratch_.ready.back();
      scratch_.ready.pop_back();
      const auto walk_idx = static_cast<uint32_t>(state_->nodes.size());
      NodeState& ns = visit(fn);
      try {
        for (const auto& failed : cache_->walk_failures) {
          if (failed == std::type_index(typeid(*fn))) {
            throw WalkError(fn->name(), "collection failed before on this path", true, cache_, typeid(*fn));
          }
        }
        CompiledNodeArgs args(*ns.collected, ns.call);
        collect(args, ns, fn);
        if (state_->first_python_node < 0 &&
            (!ns.collected->hooks.empty() || !ns.collected->packed_inputs.empty())) {
          state_->first_python_node = walk_idx;
          state_->first_python_node_post_hook_id = torch_private::largest_post_hook_id(*fn);
        }
        descend(args.key(), ns, fn, walk_idx);
      } catch (const WalkError&) {
        throw;
      } catch (const c10::Error& e) {
        // Remembered by the engine hook only if it was ours; see [Note: Whose failure].
        throw WalkError(fn->name(), e.what_without_backtrace(), false, cache_, typeid(*fn));
      } catch (const std::exception& e) {
        throw WalkError(fn->name(), e.what(), false, cache_, typeid(*fn));
      }
      release(fn);
    }
    state_->entry = cache_;
    return std::move(state_);
  }

 private:
  /// The node's graph-wide id (discovery order); see [Note: Cache key].
  uint32_t id_of(Node* fn) {
    NodeMark& mark = *scratch_.nodes.try_emplace(fn).first;
    if (mark.id == NodeMark::kNoId) {
      mark.id = next_id_++;
    }
    return mark.id;
  }

  // [Note: Prefetching the next nodes]
  // On a cache hit the walk's cost is where torch's nodes are in memory, not
  // what it computes: a graph whose forward ran long before (or whose nodes
  // another backward evicted) walks at twice the time per node of one just
  // built. Each node's children are read soon (their input metadata by this
  // node's collection, their own fields when visited), so their first cache
  // lines are asked for before this node's work starts. Eight 64-byte lines
  // cover a node's Node fields, its inline input metadata and the first
  // saved variables; on bench/run.py's LSTM this took the walk from 1,068
  // to 973 µs a backward (fresh) and 1,424 to 1,281 (held), medians of six
  // alternated runs on a slow, noisy day (bench/LOG.md, stop 53).
  static void prefetch_next_nodes(const Node& fn) {
    constexpr int kLines = 8;
    for (const auto& edge : fn.next_edges()) {
      const char* next = reinterpret_cast<const char*>(edge.function.get());
      if (next != nullptr) {
        for (int line = 0; line < kLines; ++line) {
          __builtin_prefetch(next + 64 * line);
        }
      }
    }
  }

  void push_ready(Node* fn) {
    scratch_.ready.push_back(fn);
    std::push_heap(scratch_.ready.begin(), scratch_.ready.end(), LaterSequenceFirst{});
  }

  /// The graph-input slot of `t`, given on first use; see [Note: Lifted tensor de-duplication].
  uint32_t slot_of(const at::Tensor& t) {
    auto [slot, inserted] = scratch_.slots.try_emplace(t.unsafeGetTensorImpl());
    if (inserted) {
      *slot = output_alias_slot(t);
      if (*slot == kNoSlot) {
        *slot = static_cast<uint32_t>(state_->lifted_tensors.size());
        state_->lifted_tensors.push_back(t);
      }
    }
    return *slot;
  }

  static constexpr uint32_t kNoSlot = UINT32_MAX;

  /// The slot of an earlier alias of `t`, else kNoSlot (recording `t` as the
  /// first with its grad_fn); see [Note: Aliases of a saved output].
  uint32_t output_alias_slot(const at::Tensor& t) {
    Node* grad_fn = t.defined() ? torch::autograd::impl::grad_fn_unsafe(t) : nullptr;
    if (grad_fn == nullptr) {
      return kNoSlot;
    }
    auto [first, inserted] = scratch_.output_slots.try_emplace(grad_fn);
    if (inserted) {
      *first = static_cast<uint32_t>(state_->lifted_tensors.size()) + 1;
      return kNoSlot;
    }
    const uint32_t candidate = *first - 1;
    return same_tensor_view(state_->lifted_tensors[candidate], t) ? candidate : kNoSlot;
  }

  /// Step 1.
  NodeState& visit(Node* fn) {
    prefetch_next_nodes(*fn);
    NodeState& ns = state_->nodes.emplace_back(
        id_of(fn), c10::intrusive_ptr<Node>::reclaim_copy(fn));
    NodeCall& call = ns.call;
    if (check_exec_info_ && fn != root_.get()) {
      call.needed = exec_info_.at(fn).needed_;
    }
    for (size_t i = 0; i < output_edges_.size(); ++i) {
      if (output_edges_[i].function.get() == fn) {
        call.mark_output(
            static_cast<int>(output_edges_[i].input_nr), static_cast<int>(i));
      }
    }
    ns.is_accumulate_grad = typeid(*fn) == typeid(AccumulateGrad);
    // Only nodes after the first with Python objects are compared, so a
    // graph without any (the common cache hit) computes none; see [Note:
    // Hooks changed while a graph runs] in engine_hook.cpp.
    if (state_->first_python_node >= 0) {
      ns.hook_signature = torch_private::hook_registry_signature(*fn);
    }
    // See [Note: Recycled walk state].
    if (state_->spare_calls.empty()) {
      ns.collected = std::make_unique<AutogradCompilerCall>(SizeInput::STATIC);
    } else {
      ns.collected = std::move(state_->spare_calls.back());
      state_->spare_calls.pop_back();
    }
    if (!state_->spare_slots.empty()) {
      ns.tensor_slots = std::move(state_->spare_slots.back());
      state_->spare_slots.pop_back();
    }
    return ns;
  }

  // [Note: Backwards inside a vmap]
  // A backward run inside a vmap (autograd.grad(is_grads_batched=True),
  // torch's legacy vmap over the engine; or autograd.grad inside
  // torch.func.vmap or another functorch transform) walks the same nodes
  // with the same metadata as one outside: the batch dim lives in the
  // tensors' BatchedTensorImpl, not in any size the key collects. Its graph
  // takes batched tensors, which Dynamo cannot make fake ones of, so the
  // runtime runs such a graph as the GraphModule it captured (ca_runtime's
  // [Note: Graphs of a backward inside a vmap]); a graph compiled outside a
  // vmap would be handed batched tensors on a hit and make Dynamo try (and
  // fail) to compile again. So whether the backward runs inside a vmap is
  // part of the root's key: the two are separate entries, and capture() is
  // told the same reading (BackwardGraph::inside_a_vmap), so that the key and
  // the runtime's choices never disagree. Two thread-local
  // reads per backward: the legacy vmap's nesting level, and the dispatch
  // key functorch includes in this thread's key set while its transform
  // stack is not empty (setDynamicLayerFrontBackKeysIncluded).
  static bool inside_a_vmap() {
    return at::impl::VmapMode::current_vmap_level() > 0 ||
        c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
  }

  /// Step 2.
  void collect(CompiledNodeArgs& args, NodeState& ns, Node* fn) {
    NodeCall& call = ns.call;
    // [Note: Outputs no node reaches]
    // autograd.grad's inputs are marked on the nodes their edges lead to, so
    // an input the graph does not reach (allow_unused=True) marks nothing.
    // grad(y, [a]) and grad(y, [a, b]) with b unused would then share a key
    // while the graph returns one grad for the first and two for the second:
    // their number is part of the root's key.
    if (fn == root_.get()) {
      args.collect_size(state_->num_outputs);
      state_->inside_a_vmap = inside_a_vmap();
      args.collect_size(static_cast<size_t>(state_->inside_a_vmap));
    }
    collect_node_call(args, ns, fn);
    if (!args.cond(call.needed)) {
      return;
    }
    fn->compiled_args(args);
    // Saved tensors with unpack hooks are not lifted; their number matters.
    args.collect_size(ns.collected->sv_to_hooks.size());
    ns.num_apply_sizes = static_cast<uint32_t>(ns.collected->all_size_inputs.size());
    // A leaf lifts its variable, so that the graph may accumulate it at its
    // eager position, unless it has C++ grad_fn hooks; with C++ post hooks
    // alone it still does when it has post-accumulate-grad hooks. See [Note:
    // Leaves accumulated in the graph].
    const bool lifts_variable = ns.is_accumulate_grad &&
        (ns.leaf_hooks_collected || (fn->pre_hooks().empty() && !call.post_acc_grad_hooks.empty())) &&
        !ns.collected->tensor_args.inputs.empty();
    if (lifts_variable) {
      const uint32_t slot = slot_of(ns.collected->tensor_args.inputs.front());
      ns.tensor_slots.push_back(slot);
      args.collect_size(slot);
      state_->leaf_hooks_in_graph |= !call.post_acc_grad_hooks.empty();
    }
    if (!ns.is_accumulate_grad) {
      const auto& tensors = ns.collected->tensor_args.inputs;
      ns.tensor_slots.reserve(tensors.size());
      for (const auto& t : tensors) {
        const uint32_t slot = slot_of(t);
        ns.tensor_slots.push_back(slot);
        args.collect_size(slot);
      }
    }
    for (const auto& edge : fn->next_edges()) {
      if (args.cond(edge.is_valid())) {
        args.collect_size(id_of(edge.function.get()));
        args.collect_size(edge.input_nr);
        args.collect(edge.function->input_metadata(edge.input_nr));
      }
    }
  }

  /// Step 3.
  void descend(const CacheKey& key, const NodeState& ns, Node* fn, uint32_t walk_idx) {
    bool created = false;
    ShadowNode* parent = cache_;
    cache_ = parent->lookup(key, created);
    if (created) {
      cache_->summary = summarize(ns, fn);
      if (state_->miss_node < 0 && parent->next.size() > 1) {
        state_->miss_node = walk_idx;
        state_->miss_reason = explain_new_key(*parent, cache_, *cache_->summary);
      }
    }
  }

  /// Step 4.
  void release(Node* fn) {
    for (const auto& edge : fn->next_edges()) {
      if (!edge.is_valid()) {
        continue;
      }
      Node* next = edge.function.get();
      if (check_exec_info_) {
        auto it = exec_info_.find(next);
        if (it == exec_info_.end() || !it->second.should_execute()) {
          continue;
        }
      }
      NodeMark& mark = *scratch_.nodes.try_emplace(next).first;
      if (!mark.counted) {
        auto dep = graph_task_.dependencies_.find(next);
        TORCH_INTERNAL_ASSERT(dep != graph_task_.dependencies_.end());
        mark.remaining = dep->second;
        mark.counted = true;
      }
      if (--mark.remaining == 0) {
        push_ready(next);
      }
    }
  }

  const c10::intrusive_ptr<Node>& root_;
  const GraphTask& graph_task_;
  const torch::autograd::edge_list& output_edges_;
  const decltype(GraphTask::exec_info_)& exec_info_;
  /// backward(inputs=) / autograd.grad: only nodes in exec_info run.
  const bool check_exec_info_;
  WalkScratch private_scratch_;
  WalkScratch& scratch_;
  /// The walked state being built.
  BackwardStatePtr state_;
  /// The cache node the walk has reached.
  ShadowNode* cache_;
  uint32_t next_id_ = 0;
};

} // namespace

BackwardStatePtr walk_graph(
    ShadowNode& cache_root,
    const c10::intrusive_ptr<Node>& root,
    const GraphTask& graph_task,
    const torch::autograd::edge_list& output_edges) {
  // See [Note: The walk's steps].
  return GraphWalk(cache_root, root, graph_task, output_edges).run();
}

void register_graph_walk(nb::module_& /*m*/) {
  // The walk has no Python API of its own; the cache's is shadow_cache.cpp's.
}

} // namespace ca
