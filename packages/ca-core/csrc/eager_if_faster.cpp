// eager_if_faster.cpp — the schedule and the decision of EagerIfFaster: when a cache
// entry times its hits both ways and which way wins (see [Note: Eager if
// faster]); and the backwards its choice of eager serves without a walk,
// recognised by their GraphTask's fingerprint (see [Note: Eager without the
// walk]). The engine hook (engine_hook.cpp) acts on both.
#include "eager_if_faster.h"

#include "ca_core.h"
#include "torch_private.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace ca {

namespace {

/// The median of `values` (reorders them); there is at least one.
template <typename T>
T median(std::vector<T>& values) {
  const std::size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  const T upper = values[mid];
  if (values.size() % 2 != 0) {
    return upper;
  }
  const T lower = *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid));
  return lower + (upper - lower) / 2;
}

} // namespace

EagerIfFaster::Decision EagerIfFaster::decide(
    const std::vector<uint64_t>& compiled_ns,
    const std::vector<uint64_t>& eager_ns) {
  // The k-th runs of each way are neighbours in next()'s schedule.
  std::vector<double> ratios(compiled_ns.size());
  for (std::size_t k = 0; k < ratios.size(); ++k) {
    ratios[k] = static_cast<double>(compiled_ns[k]) / static_cast<double>(std::max<uint64_t>(eager_ns[k], 1));
  }
  Decision d;
  d.compiled_over_eager = median(ratios);
  d.eager = !(d.compiled_over_eager < 1.0 - kCompiledMargin);
  d.undecided = ratios.size() < kMaxTimedRunsPerWay &&
      std::abs(d.compiled_over_eager - 1.0) < kUndecidedBand;
  return d;
}

void EagerIfFaster::reset(bool eager_if_faster_allowed) {
  *this = EagerIfFaster();
  eligible = eager_if_faster_allowed;
}

EagerIfFaster::Serve EagerIfFaster::next(bool plain) {
  ++runs;
  if (runs <= measure_after) {
    return eager ? Serve::kEager : Serve::kCompiled;
  }
  if (!plain) {
    return eager ? Serve::kEager : Serve::kCompiled;  // not timed: as the last choice
  }
  // Eager, compiled, compiled, eager, eager, compiled, ...: each pair of
  // neighbours has one of each, and each way goes first half the time.
  const std::size_t n = compiled_ns.size() + eager_ns.size();
  const bool eager_turn = ((n + 1) / 2) % 2 == 0;
  if (eager_turn ? eager_ns.size() < timed_per_way : compiled_ns.size() >= timed_per_way) {
    return Serve::kTimeEager;
  }
  return Serve::kTimeCompiled;
}

bool EagerIfFaster::record(bool eager_run, uint64_t ns) {
  std::vector<uint64_t>& sink = eager_run ? eager_ns : compiled_ns;
  if (sink.size() >= timed_per_way) {
    return false;
  }
  sink.push_back(ns);
  if (compiled_ns.size() < timed_per_way || eager_ns.size() < timed_per_way) {
    return false;
  }
  // Paired before the medians reorder the vectors.
  const Decision decision = decide(compiled_ns, eager_ns);
  if (decision.undecided) {
    timed_per_way += kTimedRunsPerWay;
    return false;
  }
  timed_per_way = kTimedRunsPerWay;
  eager = decision.eager;
  compiled_over_eager = decision.compiled_over_eager;
  compiled_median_ns = median(compiled_ns);
  eager_median_ns = median(eager_ns);
  compiled_ns = std::vector<uint64_t>();
  eager_ns = std::vector<uint64_t>();
  measure_after = runs + (kRemeasureRuns << std::min(measurements, kMaxRemeasureShift));
  ++measurements;
  return true;
}


/*
[Note: Eager without the walk]
An entry that chose the eager engine (see [Note: Eager if faster])
still paid the walk on every backward, only to learn which entry it was:
on the bench's chain of 1000 muls, 3 ms on top of eager's 12. So each
backward served eagerly by choice is remembered by a fingerprint of its
GraphTask that costs nothing to compute (GraphFingerprint: the root's type,
the numbers of nodes, of exec_info entries and of outputs, retain_graph,
create_graph, accumulate-or-return, and the types and input shapes of the
next nodes of the few nodes nearest the root), and a later backward with
the same fingerprint, at an entry that is still alive, still chose eager and has no timing due, runs on
the eager engine at once, counted in eager_if_faster_runs and in the entry's
runs as if it had been walked. Every kWalkEvery-th such backward is walked
anyway, so that a different graph with the same fingerprint (a new hook,
new sizes deeper down) is captured or served as it should be within that
many backwards; eager's results are right for it meanwhile (eager is the
oracle). Forgotten when the walk of its fingerprint ends anywhere but at a
choice of eager, and with the cache (cache_generation).

The fingerprint is only computed where it can serve: before the walk
when some backward under the same cache is remembered (a 4-slot scan
otherwise, so a compiled hit pays nothing for this), and at the choice of
eager when it is remembered (engine_hook.cpp's BackwardRun computes it
once). The walk only reads the GraphTask and the graph, so both give the
same fingerprint.

Since choosing eager now saves the walk too, a timed compiled run counts
from the walk's start; a timed eager run is still the engine's run alone,
after a walk.
*/


/// Nodes whose next edges a fingerprint hashes, nearest the root first.
constexpr size_t kFingerprintNodes = 8;

GraphFingerprint fingerprint_of(
    const torch::autograd::Node& root,
    const torch::autograd::GraphTask& graph_task,
    bool accumulate_grad,
    const std::vector<torch::autograd::Edge>& output_edges) {
  GraphFingerprint f;
  f.root_type = &typeid(root);
  f.nodes = graph_task.dependencies_.size();
  f.exec_nodes = graph_task.exec_info_.size();
  f.outputs = output_edges.size();
  f.keep_graph = graph_task.keep_graph_;
  f.create_graph = torch_private::task_grad_mode(graph_task);
  f.accumulate_grad = accumulate_grad;
  size_t h = 0;
  auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  // Breadth-first from the root, a few levels and nodes deep: the root is
  // usually a GraphRoot and the loss's own node has a scalar input, so the
  // sizes that change with a batch are a level or two further.
  std::array<const torch::autograd::Node*, kFingerprintNodes> queue{};
  size_t queued = 0;
  queue[queued++] = &root;
  for (size_t i = 0; i < queued; ++i) {
    for (const auto& edge : queue[i]->next_edges()) {
      if (!edge.is_valid()) {
        mix(0);
        continue;
      }
      const torch::autograd::Node& next = *edge.function;
      mix(typeid(next).hash_code());
      mix(edge.input_nr);
      const auto& meta = next.input_metadata(edge.input_nr);
      if (meta.is_nested_tensor() || meta.was_default_constructed()) {
        mix(1);
      } else {
        for (const c10::SymInt& size : meta.shape_as_dim_vector()) {
          mix(size.is_heap_allocated() ? 0 : static_cast<size_t>(size.as_int_unchecked()));
        }
      }
      if (queued < queue.size()) {
        queue[queued++] = &next;
      }
    }
  }
  f.next_hash = h;
  return f;
}

namespace {

/// A backward served eagerly by choice, remembered by its fingerprint; see
/// [Note: Eager without the walk].
struct RememberedEager {
  /// The cache root (compiler) it was walked under; null: an empty slot.
  const ShadowNode* cache = nullptr;
  /// Its GraphTask's fingerprint.
  GraphFingerprint fingerprint;
  /// The entry that chose eager, alive while cache_generation(*cache) == generation.
  ShadowNode* entry = nullptr;
  /// The cache's generation when it was remembered.
  uint64_t generation = 0;
  /// Backwards served without a walk since its last walk.
  uint32_t unwalked = 0;
};

/// Walk one in this many backwards of a remembered fingerprint anyway.
constexpr uint32_t kWalkEvery = 16;
/// A few slots: a training loop alternates between few backwards. GIL held.
std::array<RememberedEager, 4> g_remembered_eager;
size_t g_next_remembered = 0;

RememberedEager* remembered_for(const ShadowNode* cache, const GraphFingerprint& f) {
  for (auto& r : g_remembered_eager) {
    if (r.cache == cache && r.fingerprint == f) {
      return &r;
    }
  }
  return nullptr;
}

} // namespace

bool remembers_eager_under(const ShadowNode* cache) {
  for (const auto& r : g_remembered_eager) {
    if (r.cache == cache) {
      return true;
    }
  }
  return false;
}

void remember_eager(const ShadowNode* cache, const GraphFingerprint& f, ShadowNode* entry, uint64_t generation) {
  RememberedEager* r = remembered_for(cache, f);
  if (r == nullptr) {
    r = &g_remembered_eager[g_next_remembered];
    g_next_remembered = (g_next_remembered + 1) % g_remembered_eager.size();
  }
  *r = RememberedEager{cache, f, entry, generation, 0};
}

bool serve_remembered_eager(const ShadowNode* cache, const GraphFingerprint& f, uint64_t generation) {
  RememberedEager* r = remembered_for(cache, f);
  if (r == nullptr) {
    return false;
  }
  bool serve = generation == r->generation && ++r->unwalked < kWalkEvery;
  if (serve) {
    ShadowNode& entry = *r->entry;
    EagerIfFaster& choice = entry.eager_if_faster;
    serve = entry.may_choose() && choice.next_is_chosen_eager();
    if (serve) {
      choice.next(true);  // counts the run; kEager, as checked
      ++choice.eager_runs;
    }
  }
  if (!serve) {
    // Walked: remembered again only if the walk ends at a choice of eager.
    *r = RememberedEager();
  }
  return serve;
}

} // namespace ca
