// shadow_cache.cpp — the shadow-graph cache: a tree per compiler keyed by
// node keys (lookup, clear, failures, entries), the dynamic-size policy of an
// entry (which sizes match, which become dynamic, how they reach the graph)
// and the explanations of misses.
#include "ca_core.h"

#include <unordered_map>
#include "tensor_caster.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <array>
#include <atomic>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace ca {

using torch::autograd::AccumulateGrad;

/*
[Note: Cache key]
The shadow graph is a tree: the root stands for "no node seen yet" and each
visited node of a backward moves one level down, along the child whose
CacheKey equals that node's key. A backward is a hit when the walk ends at a
ShadowNode that holds a compiled function and whose expected sizes match.

A node's key is the node's C++ type plus the bytes torch's CompiledNodeArgs
visitor writes for it:
  - the node's graph-wide id, its graph outputs and the ids of its hooks
    (collect(NodeCall));
  - whether the node is needed (exec_info of .grad / backward(inputs=));
  - what its compiled_args specialises on (scalars, dtypes, flags, and the
    id/device/dtype/requires_grad of each tensor it lifts);
  - for each next edge: validity, the graph-wide id of the node it leads to,
    the input number and the input metadata validate_outputs checks against;
  - for the root alone: the number of outputs (see [Note: Outputs no node
    reaches]) and whether the backward runs inside a vmap (see [Note:
    Backwards inside a vmap]), both in graph_walk.cpp.
The graph-wide ids are ours (discovery order of the walk) because each node
collects into its own AutogradCompilerCall; see [Note: Per-node collection].
Because the walk order is eager's order and ids follow discovery, two
backwards with the same key path have the same graph.

[Note: Dynamic sizes]
Sizes (the SymInts a node's compiled_args visits: saved sizes, the shapes of
its next edges' input metadata) are not part of the key. They are static at
the first capture: the graph is specialised on them and the entry remembers
them. A backward whose sizes differ from a static one is a miss; the sizes
that changed become dynamic for good (ShadowNode::dynamic_sizes), the graph is
captured again with them as inputs and the lifted tensors' dimensions that
changed are marked dynamic before its first run, so a later new value is a
hit and Dynamo does not recompile either. At most one recapture per newly
changed size. A dynamic size reaches the graph as an empty tensor of shape
(0, size) whose dim 1 Dynamo treats as a SymInt (a plain int cannot be marked
dynamic); the graph unwraps it with .size(1). See [Note: Signed dynamic sizes]
for sizes that are not shapes.

[Note: Signed dynamic sizes]
Not every SymInt a node visits is a shape: TrilBackward0's diagonal,
RollBackward0's shifts, SelectBackward0's index and NarrowBackward0's start
are SymInts too and may be negative. A cache hit must be correct for every
value a dynamic size can take, so the encoding has to carry any int64 and the
compiled graph must be guarded on every assumption it made about it:
  - a negative size travels as an empty (0, 0, -size) tensor and unwrap_size
    returns -t.size(2) for a rank-3 tensor. The rank is static to Dynamo, so a
    graph compiled for one sign is guarded on it and Dynamo recompiles (inside
    the same compiled_fn, no recapture) when the sign flips;
  - Dynamo specialises a marked dim whose value is 0 or 1 and guards every
    other symbol as >= 2, so 0 and 1 (and -1) are guarded the same way;
  - everything else a graph assumes about a size (a relation between two of
    them, a bound) is a Dynamo guard on these input tensors' shapes.
A hit therefore never runs a graph outside what it was compiled for: it is
either served by the graph Dynamo compiled for those values or recompiled.
ca_runtime's tests/test_size_guards.py runs the ops above through sequences
of sizes and scalars, 0, 1 and negative ones included.

[Note: Static when dynamic fails]
Some backward formulas cannot be traced with symbolic sizes in torch 2.13
(UpsampleBilinear2DBackward0: aten.upsample_bilinear2d_backward has no
symbolic meta, "Expected IntList but got GenericList"). When the first run
of a graph captured with dynamic sizes or dims fails, the engine hook
captures the same backward again with every size static and runs that
instead, and the entry keeps its sizes static from then on
(ShadowNode::static_sizes): each new value is a recapture (an entry holds
one graph, so sizes alternating between two values recompile each time),
never an eager fallback. Only a failure of the static
graph too is a fallback, and then the entry does not stay static: that
failure was not the dynamic sizes' (a user's error is judged by eager, see
[Note: Whose failure], and must not change what gets compiled next). A static
capture that itself fails (compiler_fn raising) is an ordinary failed
capture: the runtime's one warning, the entry marked failed.

[Note: Explained misses]
When a node's key is new at a level of the tree that already has other
children, the backward took a new path there: the walk records which node
(its position in the walk) and why, by comparing what the node looks like now
(NodeSummary: type, hook counts, lifted tensors' dtype/device/requires_grad,
whether a leaf's .grad is defined) with the sibling that led to the cached
path (same node type preferred), plus the byte range where the two keys
differ. Summaries are made only when a child is created, i.e. on misses; the
hit path never builds one. A miss caused by a changed static size is
explained by the engine hook (which sizes, from what to what).

[Note: One cache per compiler]
A graph compiled with one compiler_fn must not serve a backward run under
another (aot_eager then inductor in one process would otherwise replay the
aot_eager graph). The cache is a tree per compiler: enable() installs the
engine hook with a key naming its compiler ("backend:inductor" for a backend
name, the callable's identity for a compiler_fn, which ca_runtime keeps alive
so the identity cannot be reused), and walks start at that key's root. The
same backend name or the same callable finds its earlier captures.

[Note: Cache and the GIL]
Every read and write of the cache tree happens with the GIL held and without
running Python code in between, so the GIL serialises threads for us. Python
code (capture, compiler_fn, the compiled graph) may release the GIL, so a
ShadowNode pointer is not trusted across such a call: clear_cache() bumps the
generation of every tree, drop_cache_root() that of the one it empties, and
the engine hook re-checks its tree's before storing a result. Per tree: a
callable compiler_fn that dies (and drops its tree) while another compiler's
backward is capturing -- a garbage collection may run anywhere -- must not
throw that capture away.

[Note: What the cache lets go of]
Emptying a tree (clear_cache(), drop_cache_root(), cache_clear_failed(), a
graph replaced at its entry) lets go of Python objects: compiled graphs, and
through them compilers and whatever their closures hold. A decref may run
Python code -- a weakref callback of a compiler that dies (ca_runtime's drops
that compiler's tree), a __del__ -- and that code may empty a tree itself, on
this thread or, once it lets go of the GIL, on another. Destroying what a tree
held while a walk, a lookup or this very clear still points into it was a
use-after-free (a compiler whose graph held the compiler: reset() crashed).
So nothing the cache lets go of is destroyed where it is let go: ShadowNodes
and Python objects move to one graveyard (release_later(), clear()), which
is emptied when the last CacheUse ends. A CacheUse is alive for each backward
in the hook (walk, capture, run, finish) and for each Python-facing call that
reads or changes a tree, so every ShadowNode pointer taken under one stays
valid memory until it ends; generations (above) still say whether it is
still in the tree. Emptying the graveyard counts as a use too, so what its
decrefs let go of waits for the next round instead of being destroyed inside
the destruction.
*/

/// NodeSummary::hooks' kinds, in its order, as miss reasons and the report name them.
constexpr std::array<const char*, 5> kHookKinds = {
    "Python tensor hooks", "C++ tensor hooks / retain_grad", "grad_fn pre-hooks", "grad_fn hooks",
    "post-accumulate-grad hooks"};

namespace {
/// Bumped by clear_cache().
std::atomic<uint64_t> g_generation{0};
/// Per root: how many times drop_cache_root() emptied it (GIL held).
std::unordered_map<const ShadowNode*, uint64_t> g_root_drops;

/// What the cache let go of, destroyed when no CacheUse is alive; see
/// [Note: What the cache lets go of]. Guarded by the GIL.
struct Graveyard {
  /// Subtrees taken out of a tree.
  std::vector<std::unique_ptr<ShadowNode>> nodes;
  /// Python objects an entry held (compiled graphs, readiness callables).
  std::vector<nb::object> objects;
  /// CacheUse objects alive, on any thread.
  int users = 0;
};

Graveyard& graveyard() {
  // Leaked on purpose, as cache_roots(): no Python object dies after the interpreter.
  static auto* g = new Graveyard();
  return *g;
}
} // namespace

CacheUse::CacheUse() {
  ++graveyard().users;
}

CacheUse::~CacheUse() {
  Graveyard& g = graveyard();
  if (--g.users > 0 || (g.nodes.empty() && g.objects.empty())) {
    return;
  }
  // A Python error being raised (a backward unwinding) is kept aside while
  // decrefs run callbacks.
  nb::error_scope keep_error;
  while (!g.nodes.empty() || !g.objects.empty()) {
    auto nodes = std::move(g.nodes);
    auto objects = std::move(g.objects);
    g.nodes.clear();
    g.objects.clear();
    ++g.users;
    nodes.clear();
    objects.clear();
    --g.users;
  }
}

void release_later(nb::object& obj) {
  if (obj.is_valid()) {
    graveyard().objects.push_back(std::move(obj));
    obj = nb::object();
  }
}


/*
[Note: The child taken last]
A training loop walks the same key path on every backward, so each cache
node first compares the key with the one its last lookup found (type, size,
then the bytes, read in order) and hashes only when they differ. The hash
(libstdc++ hashes a type_index by its mangled name) and the bucket array and
list node it leads to were each a memory access to a place the forward had
evicted from the caches: on the bench's LSTM, a fifth of a hit's walk
(bench/LOG.md). The child and its key stay valid while the node lives: a
child is never removed but by clear(), which forgets it too, and the bytes
live in key_storage, owned by the node.
*/
namespace {
std::atomic<uint64_t> g_keys_hashed{0};
} // namespace

uint64_t keys_hashed() {
  return g_keys_hashed.load(std::memory_order_relaxed);
}

void reset_keys_hashed() {
  g_keys_hashed.store(0, std::memory_order_relaxed);
}

ShadowNode* ShadowNode::lookup(const CacheKey& key, bool& created) {
  if (last_child != nullptr && last_key == key) {
    created = false;
    return last_child;
  }
  g_keys_hashed.fetch_add(1, std::memory_order_relaxed);
  auto it = next.find(key);
  created = it == next.end();
  if (created) {
    // The key's bytes live in CompiledNodeArgs' temporary buffer: copy them.
    CacheKeyBuffer buffer(key.key, key.key_size);
    CacheKey stored(key.node_type, buffer.get(), key.key_size);
    it = next.emplace(stored, std::make_unique<ShadowNode>()).first;
    key_storage.emplace_back(std::move(buffer));
  }
  last_child = it->second.get();
  last_key = it->first;
  return last_child;
}

void ShadowNode::clear_failed() {
  if (failed) {
    failed = false;
    failure.clear();
    release_later(compiled_fn);
    first_run = true;
    release_later(compiling);
  }
  walk_failures.clear();
  for (auto& [_, child] : next) {
    child->clear_failed();
  }
}

void ShadowNode::clear() {
  // See [Note: What the cache lets go of]: the children (and the keys'
  // bytes they are found by) go to the graveyard whole.
  auto husk = std::make_unique<ShadowNode>();
  husk->next.swap(next);
  husk->key_storage.swap(key_storage);
  last_child = nullptr;  // see [Note: The child taken last]
  graveyard().nodes.push_back(std::move(husk));
  expected_sizes.clear();
  dynamic_sizes.clear();
  tensor_shapes.clear();
  release_later(compiled_fn);
  failed = false;
  failure.clear();
  static_sizes = false;
  first_run = true;
  release_later(compiling);
  hits = 0;
  sightings = 0;
  eager_if_faster.reset(false);
  leaf_outputs.clear();
  leaf_hooks_only.clear();
  summary.reset();
  walk_failures.clear();
}

std::unique_ptr<NodeSummary> summarize(const NodeState& ns, Node* fn) {
  auto summary = std::make_unique<NodeSummary>();
  summary->name = fn->name();
  summary->type = node_type_name(*fn);
  for (const auto& h : ns.tensor_pre_hooks) {
    ++summary->hooks[h.is_cpp ? 1 : 0];
  }
  summary->hooks[2] = static_cast<uint32_t>(ns.call.pre_hooks.size());
  summary->hooks[3] = static_cast<uint32_t>(ns.call.post_hooks.size());
  summary->hooks[4] = static_cast<uint32_t>(ns.call.post_acc_grad_hooks.size());
  if (ns.collected) {
    for (const auto& t : ns.collected->tensor_args.inputs) {
      std::string desc = std::string(c10::toString(t.scalar_type())) + " " +
          t.device().str() + (t.requires_grad() ? " requires_grad" : "");
      summary->tensors.push_back(std::move(desc));
    }
  }
  if (ns.is_accumulate_grad) {
    summary->grad_defined =
        static_cast<AccumulateGrad*>(fn)->variable.grad().defined() ? 1 : 0;
  }
  return summary;
}

/// Why `now` (with key `key`) is not the cached sibling; see [Note: Explained misses].
std::string explain_new_key(
    const ShadowNode& parent,
    const ShadowNode* created,
    const NodeSummary& now) {
  const NodeSummary* best = nullptr;
  for (const auto& [_, child] : parent.next) {
    if (child.get() == created || !child->summary) {
      continue;
    }
    if (best == nullptr || (child->summary->type == now.type && best->type != now.type)) {
      best = child->summary.get();
    }
  }
  if (best == nullptr) {
    return "a new path in the cache";
  }
  std::vector<std::string> reasons;
  if (best->type != now.type) {
    reasons.push_back(
        "a " + now.name + " node where the cached graph has " + best->name +
        (now.name == best->name ? " (C++ types " + now.type + " and " + best->type + ")" : ""));
  } else {
    for (size_t i = 0; i < now.hooks.size(); ++i) {
      if (now.hooks[i] != best->hooks[i]) {
        reasons.push_back(
            std::string(now.hooks[i] > best->hooks[i] ? "a hook was added" : "a hook was removed") +
            " to its " + kHookKinds[i] + " (" + std::to_string(now.hooks[i]) + " now, " +
            std::to_string(best->hooks[i]) + " in the cached graph)");
      }
    }
    if (now.grad_defined != best->grad_defined && now.grad_defined >= 0) {
      reasons.push_back(now.grad_defined ? "the leaf's .grad became defined" : "the leaf's .grad became None");
    } else if (now.tensors.size() != best->tensors.size()) {
      reasons.push_back(
          "it saves " + std::to_string(now.tensors.size()) + " tensors, the cached graph " +
          std::to_string(best->tensors.size()));
    } else {
      for (size_t i = 0; i < now.tensors.size(); ++i) {
        if (now.tensors[i] != best->tensors[i]) {
          reasons.push_back(
              "saved tensor #" + std::to_string(i) + " is " + now.tensors[i] +
              ", was " + best->tensors[i]);
        }
      }
    }
  }
  if (reasons.empty()) {
    // Nothing a summary shows: a value compiled_args specialises on.
    reasons.push_back(
        "a value its backward is specialised on changed (a scalar argument such as an "
        "exponent or a dim, a flag, or the type of a saved value)");
  }
  std::string out;
  for (const auto& r : reasons) {
    out += (out.empty() ? "" : "; ") + r;
  }
  return out;
}


/// Cache roots by compiler key, in creation order; see [Note: One cache per compiler].
std::vector<std::pair<std::string, std::unique_ptr<ShadowNode>>>& cache_roots() {
  // Leaked on purpose: its Python objects must not be released after the
  // interpreter is gone.
  static auto* roots = new std::vector<std::pair<std::string, std::unique_ptr<ShadowNode>>>();
  return *roots;
}

ShadowNode& cache_root(const std::string& compiler_key) {
  auto& roots = cache_roots();
  for (auto& [key, root] : roots) {
    if (key == compiler_key) {
      return *root;
    }
  }
  return *roots.emplace_back(compiler_key, std::make_unique<ShadowNode>()).second;
}

uint64_t cache_generation(const ShadowNode& root) {
  const auto it = g_root_drops.find(&root);
  return g_generation.load() + (it == g_root_drops.end() ? 0 : it->second);
}

/// Whether size input `i` fits an entry: equal, or dynamic there; see
/// [Note: Dynamic sizes].
bool size_fits(const ShadowNode& entry, size_t i, int64_t value) {
  return i < entry.expected_sizes.size() &&
      (value == entry.expected_sizes[i] || (i < entry.dynamic_sizes.size() && entry.dynamic_sizes[i]));
}

/// Whether a backward's sizes fit an entry: every one, by size_fits().
bool sizes_match(const ShadowNode& entry, const std::vector<int64_t>& sizes) {
  if (sizes.size() != entry.expected_sizes.size()) {
    return false;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!size_fits(entry, i, sizes[i])) {
      return false;
    }
  }
  return true;
}

std::vector<std::vector<int64_t>> tensor_shapes(const BackwardState& state) {
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(state.lifted_tensors.size());
  for (const auto& t : state.lifted_tensors) {
    shapes.emplace_back(t.sizes().begin(), t.sizes().end());
  }
  return shapes;
}

/// On a miss: sizes dynamic at the entry stay so, sizes that changed since its
/// last capture become so, and so do the tensor dims that changed.
void choose_dynamic(
    const ShadowNode& entry,
    const std::vector<int64_t>& sizes,
    BackwardState& state) {
  state.dynamic_sizes.assign(sizes.size(), false);
  state.dynamic_dims.clear();
  const bool comparable = entry.expected_sizes.size() == sizes.size();
  if (!comparable || entry.static_sizes) {
    // See [Note: Static when dynamic fails].
    return;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const bool was_dynamic =
        i < entry.dynamic_sizes.size() && entry.dynamic_sizes[i];
    state.dynamic_sizes[i] =
        was_dynamic || sizes[i] != entry.expected_sizes[i];
  }
  if (entry.tensor_shapes.size() != state.lifted_tensors.size()) {
    return;
  }
  for (size_t i = 0; i < state.lifted_tensors.size(); ++i) {
    const auto now = state.lifted_tensors[i].sizes();
    const auto& before = entry.tensor_shapes[i];
    if (now.size() != before.size()) {
      continue;
    }
    for (size_t d = 0; d < now.size(); ++d) {
      if (now[d] != before[d]) {
        state.dynamic_dims.emplace_back(
            static_cast<uint32_t>(i), static_cast<uint32_t>(d));
      }
    }
  }
}

/// Why a backward missed an entry on its sizes alone; see [Note: Explained misses].
void explain_sizes(
    const ShadowNode& entry,
    const std::vector<int64_t>& sizes,
    BackwardState& state) {
  if (state.miss_node >= 0 || !entry.compiled_fn.is_valid() ||
      entry.expected_sizes.size() != sizes.size()) {
    return;
  }
  std::string reason;
  size_t shown = 0;
  size_t node = 0;
  size_t node_end = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    while (node_end <= i && node < state.nodes.size()) {
      const auto& ns = state.nodes[node++];
      node_end += ns.collected ? ns.collected->all_size_inputs.size() : 0;
    }
    const bool was_dynamic = i < entry.dynamic_sizes.size() && entry.dynamic_sizes[i];
    if (was_dynamic || sizes[i] == entry.expected_sizes[i]) {
      continue;
    }
    if (state.miss_node < 0) {
      state.miss_node = static_cast<int64_t>(node - 1);
    }
    if (shown++ < 3) {
      const auto& owner = state.nodes[node - 1];
      const size_t owned = owner.collected ? owner.collected->all_size_inputs.size() : 0;
      const size_t local = i - (node_end - owned);
      const std::string where = owner.call.node->name() + " (node " + std::to_string(node - 1) + ")";
      // Sizes compiled_args visited come first, then its output grads' shapes
      // (see NodeState::num_apply_sizes).
      const std::string what = local < owner.num_apply_sizes
          ? "a size " + where + " saved in the forward (#" + std::to_string(local) + ")"
          : "a dimension of an output grad of " + where;
      reason += std::string(reason.empty() ? "" : "; ") + what + " changed from " +
          std::to_string(entry.expected_sizes[i]) + " to " +
          std::to_string(sizes[i]) +
          (entry.static_sizes ? " (sizes stay static here: a dynamic graph failed to compile)"
                              : " and is now dynamic");
    }
  }
  if (shown > 3) {
    reason += "; and " + std::to_string(shown - 3) + " more sizes changed";
  }
  state.miss_reason = reason;
}

/// The graph's `sizes` input: each dynamic size as an empty tensor, (0, size)
/// or (0, 0, -size) for a negative one; see [Note: Signed dynamic sizes].
nb::list dynamic_size_args(
    const std::vector<bool>& dynamic,
    const std::vector<int64_t>& sizes) {
  nb::list out;
  for (size_t i = 0; i < dynamic.size(); ++i) {
    if (dynamic[i]) {
      const int64_t s = sizes[i];
      out.append(nb::steal(wrap_tensor(
          s >= 0 ? at::empty({0, s}) : at::empty({0, 0, -s}))));
    }
  }
  return out;
}

uint64_t next_shadow_node_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace {

/// How a cache entry's hits run, as cache_tree() shows it; see [Note: Eager
/// if faster].
enum class EagerIfFasterChoice : uint8_t {
  /// No graph at this node.
  none,
  /// Its compiled graph (the default; also before and while it is timed).
  compiled,
  /// The eager engine: its timing found compiled not measurably faster.
  eager,
};

EagerIfFasterChoice eager_if_faster_choice(const ShadowNode& node) {
  if (!node.compiled_fn.is_valid()) {
    return EagerIfFasterChoice::none;
  }
  return node.eager_if_faster.eager ? EagerIfFasterChoice::eager : EagerIfFasterChoice::compiled;
}

double seconds(uint64_t ns) {
  return static_cast<double>(ns) * 1e-9;
}

/// One node of the cache as cache_tree() shows it (a plain copy).
/// A node summary in words, for the report's cache tree.
std::string describe_summary(const NodeSummary& summary) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < summary.hooks.size(); ++i) {
    if (summary.hooks[i] > 0) {
      parts.push_back(std::to_string(summary.hooks[i]) + " " + kHookKinds[i]);
    }
  }
  if (summary.grad_defined >= 0) {
    parts.push_back(summary.grad_defined ? ".grad defined" : ".grad None");
  }
  if (!summary.tensors.empty()) {
    std::string saved = "saves";
    for (const auto& t : summary.tensors) {
      saved += (saved.size() > 5 ? ", " : " ") + t;
    }
    parts.push_back(saved);
  }
  std::string out;
  for (const auto& part : parts) {
    out += (out.empty() ? "" : "; ") + part;
  }
  return out;
}

struct CacheTreeNode {
  /// ShadowNode::id.
  uint64_t id = 0;
  /// The parent's id, or -1 for a compiler's root.
  int64_t parent = -1;
  /// Nodes on the key path that leads here (0 for a root): the node count of
  /// the backward whose walk ends here.
  uint32_t depth = 0;
  /// The compiler key of the tree ("backend:aot_eager", "callable:ID").
  std::string compiler;
  /// Name of the autograd node whose key leads here ("" for a root).
  std::string node_name;
  /// What that node looked like, in words ("2 Python tensor hooks; .grad
  /// defined; saves Float cpu"): what tells apart siblings of one name.
  std::string node_detail;
  /// Backwards served by this node's graph.
  uint64_t hits = 0;
  /// Holds a compiled graph (the walk of some backward ended here).
  bool has_graph = false;
  /// Capture or first run failed here.
  bool failed = false;
  /// Why it failed, or "".
  std::string failure;
  /// Size inputs of its backward, and how many of them are dynamic.
  uint32_t num_sizes = 0;
  uint32_t num_dynamic_sizes = 0;
  /// Sizes stay static; see [Note: Static when dynamic fails].
  bool static_sizes = false;
  /// What its timing chose; see [Note: Eager if faster].
  EagerIfFasterChoice eager_if_faster_choice = EagerIfFasterChoice::none;
  /// Backwards it ran on the eager engine by choice or to time it.
  uint64_t eager_runs = 0;
  /// Median seconds of a compiled backward in its last timing (0 before one).
  double compiled_median_s = 0;
  /// Median seconds of an eager backward in its last timing (0 before one).
  double eager_median_s = 0;
  /// Median of its last timing's paired ratios compiled / eager, which
  /// decided (0 before one); see [Note: Eager if faster].
  double compiled_over_eager = 0;
};

} // namespace

void register_shadow_cache(nb::module_& m) {
  m.def(
      "eager_if_faster_decision",
      [](const std::vector<uint64_t>& compiled_ns, const std::vector<uint64_t>& eager_ns) {
        if (compiled_ns.empty() || compiled_ns.size() != eager_ns.size()) {
          throw nb::value_error(
              "eager_if_faster_decision: compiled_ns and eager_ns must be equally long and not empty");
        }
        const EagerIfFaster::Decision d = EagerIfFaster::decide(compiled_ns, eager_ns);
        return nb::make_tuple(d.eager, d.compiled_over_eager, d.undecided);
      },
      nb::arg("compiled_ns"),
      nb::arg("eager_ns"),
      "(eager, compiled_over_eager, undecided): what a cache entry decides from timed "
      "runs of each way, the k-th of each neighbours in time (undecided: it would time "
      "more); see [Note: Eager if faster].");
  nb::enum_<EagerIfFasterChoice>(m, "EagerIfFasterChoice", "How a cache entry's hits run (CacheTreeNode.eager_if_faster_choice).")
      .value("none", EagerIfFasterChoice::none, "No graph at this node.")
      .value("compiled", EagerIfFasterChoice::compiled, "Its compiled graph.")
      .value("eager", EagerIfFasterChoice::eager, "The eager engine, chosen by timing (eager_if_faster).");
  nb::class_<CacheTreeNode>(m, "CacheTreeNode", "One node of the shadow-graph cache (cache_tree()).")
      .def_ro("id", &CacheTreeNode::id)
      .def_ro("parent", &CacheTreeNode::parent)
      .def_ro("depth", &CacheTreeNode::depth)
      .def_ro("compiler", &CacheTreeNode::compiler)
      .def_ro("node_name", &CacheTreeNode::node_name)
      .def_ro("node_detail", &CacheTreeNode::node_detail)
      .def_ro("hits", &CacheTreeNode::hits)
      .def_ro("has_graph", &CacheTreeNode::has_graph)
      .def_ro("failed", &CacheTreeNode::failed)
      .def_ro("failure", &CacheTreeNode::failure)
      .def_ro("num_sizes", &CacheTreeNode::num_sizes)
      .def_ro("num_dynamic_sizes", &CacheTreeNode::num_dynamic_sizes)
      .def_ro("static_sizes", &CacheTreeNode::static_sizes)
      .def_ro("eager_if_faster_choice", &CacheTreeNode::eager_if_faster_choice)
      .def_ro("eager_runs", &CacheTreeNode::eager_runs)
      .def_ro("compiled_median_s", &CacheTreeNode::compiled_median_s)
      .def_ro("eager_median_s", &CacheTreeNode::eager_median_s)
      .def_ro("compiled_over_eager", &CacheTreeNode::compiled_over_eager);
  m.def(
      "cache_tree",
      []() {
        CacheUse use;  // see [Note: What the cache lets go of]
        std::vector<CacheTreeNode> out;
        for (const auto& [compiler, root] : cache_roots()) {
          struct Visit {
            const ShadowNode* node;
            int64_t parent;
            uint32_t depth;
          };
          std::vector<Visit> stack{{root.get(), -1, 0}};
          while (!stack.empty()) {
            auto [node, parent, depth] = stack.back();
            stack.pop_back();
            CacheTreeNode& row = out.emplace_back();
            row.id = node->id;
            row.parent = parent;
            row.depth = depth;
            row.compiler = compiler;
            row.node_name = node->summary ? node->summary->name : std::string();
            row.node_detail = node->summary ? describe_summary(*node->summary) : std::string();
            row.hits = node->hits;
            row.has_graph = node->compiled_fn.is_valid();
            row.failed = node->failed;
            row.failure = node->failure;
            row.num_sizes = static_cast<uint32_t>(node->expected_sizes.size());
            for (bool d : node->dynamic_sizes) {
              row.num_dynamic_sizes += d ? 1 : 0;
            }
            row.static_sizes = node->static_sizes;
            row.eager_if_faster_choice = eager_if_faster_choice(*node);
            row.eager_runs = node->eager_if_faster.eager_runs;
            row.compiled_median_s = seconds(node->eager_if_faster.compiled_median_ns);
            row.eager_median_s = seconds(node->eager_if_faster.eager_median_ns);
            row.compiled_over_eager = node->eager_if_faster.compiled_over_eager;
            for (const auto& [_, child] : node->next) {
              stack.push_back({child.get(), static_cast<int64_t>(node->id), depth + 1});
            }
          }
        }
        return out;
      },
      "Every node of the shadow-graph cache, each compiler's tree depth-first "
      "(parents before children).");
  m.def(
      "clear_cache",
      []() {
        CacheUse use;  // see [Note: What the cache lets go of]
        ++g_generation;
        for (auto& [_, root] : cache_roots()) {
          root->clear();
        }
      },
      "Empties the shadow-graph cache (every captured backward, of every compiler).");
  m.def(
      "drop_cache_root",
      [](const std::string& compiler_key) {
        CacheUse use;  // see [Note: What the cache lets go of]
        auto& roots = cache_roots();
        for (auto it = roots.begin(); it != roots.end(); ++it) {
          if (it->first == compiler_key) {
            ++g_root_drops[it->second.get()];
            it->second->clear();  // the root itself stays: a runtime may still point at it
            return;
          }
        }
      },
      nb::arg("compiler_key"),
      "Empties the cache of one compiler (its compiler_fn is gone).");
  m.def(
      "clear_failed",
      []() {
        CacheUse use;  // see [Note: What the cache lets go of]
        for (auto& [_, root] : cache_roots()) {
          root->clear_failed();
        }
      },
      "Forgets every failure in the cache: those key paths are captured again.");
}

} // namespace ca
