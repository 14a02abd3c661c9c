// eager_if_faster.h — whether a cache entry's hits run its compiled graph or the
// eager engine, chosen by timing both (EagerIfFaster), and the backwards served
// eagerly by that choice without a walk (GraphFingerprint); see [Note: Eager
// if faster] and [Note: Eager without the walk] in eager_if_faster.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <typeinfo>
#include <vector>

namespace torch::autograd {
struct Edge;
struct GraphTask;
struct Node;
} // namespace torch::autograd

namespace ca {

struct ShadowNode;

/*
[Note: Eager if faster]
A compiled graph is not always faster than the eager engine: on the
benchmark's small MLP, ours with Inductor's graph ran slower than eager
(figures: bench/LOG.md, 2026-12-01). So each cache entry times both ways and
serves its hits the faster way:
  - after its graph's first run, kWarmupRuns backwards run compiled untimed
    (Dynamo's and the allocator's caches settle);
  - then kTimedRunsPerWay backwards each way are timed, alternating
    eager, compiled, compiled, eager, ... so that drift in the machine's
    speed falls on both alike. Only plain backwards are timed (no
    retain_graph or create_graph); the others run as last chosen
    (compiled at first) meanwhile. A backward whose sizes the graph was
    not captured for is a miss as without this (a capture; the count
    starts again);
    Compiled is timed from the start of the walk to the end of finish(),
    eager as the engine's whole run: a backward served eagerly is mostly
    recognised without a walk (see [Note: Eager without the walk] in
    eager_if_faster.cpp);
  - the entry runs compiled from then on only if compiled is faster by
    more than kCompiledMargin, judged by the median of the paired ratios
    (the k-th timed compiled run over the k-th timed eager run, neighbours
    in the schedule), and eagerly otherwise. Paired ratios cancel the drift
    of a shared machine that two medians taken over 16 backwards keep, and
    a tie goes to eager: a graph that is not measurably faster than the
    eager engine has nothing to gain, and "never slower than eager" is the
    promise (bench/LOG.md, 2026-12-02 "Paired ratios": a graph slower than
    eager was kept compiled under the old rule, compiled unless more than
    1 % slower by medians). A measurement whose
    ratio is within kUndecidedBand of 1 is undecided: it times
    kTimedRunsPerWay more runs each way, up to kMaxTimedRunsPerWay, and
    then decides over all its pairs, so that a difference of 1-3 %, where
    8 pairs on a shared machine often point the wrong way, gets up to three
    times the evidence;
  - the choice is measured again kRemeasureRuns backwards later, the gap
    doubling each time up to kRemeasureRuns << kMaxRemeasureShift, so that a
    choice made while the machine was busy elsewhere does not stand forever.
A backward served eagerly is the eager engine's own run, as for a graph
still compiling (see [Note: Eager while compiling]): nothing is lifted or
freed early, hooks run where eager runs them, and at most the walk is paid
on top. Counted in eager_if_faster_runs, not as a hit. The runtime says per capture
whether its graph may be served so (capture()'s `eager_if_faster_allowed`: not a
graph holding a torch.compile'd region's backward, not one captured in a
multi-rank process group) and, for the enable() installed now, whether any
may (its `eager_if_faster`; under False every graph runs compiled and
nothing is counted). It is told of each choice through the optional
report_eager_if_faster(). A new capture at the entry starts the count again.
Backwards on several threads at one entry time and count in turn under
the GIL; their runs overlap, so their timings are only as good as the
machine is quiet.
Only graphs whose lifted tensors are all on the CPU are timed. On CUDA (and
any device whose kernels run asynchronously) the host clock would measure
how long the kernels take to launch, not to run, and pick the way that
launches faster; such a graph runs compiled on every hit, as under
eager_if_faster=False (engine_hook.cpp's capture(), lifts_only_cpu_tensors).
*/
/// How one cache entry serves its hits; see [Note: Eager if faster].
struct EagerIfFaster {
  /// Backwards run compiled, untimed, before the first measurement.
  static constexpr uint64_t kWarmupRuns = 4;
  /// Timed backwards per way in one measurement, and the step by which an
  /// undecided one grows.
  static constexpr std::size_t kTimedRunsPerWay = 8;
  /// Timed backwards per way at most in one measurement.
  static constexpr std::size_t kMaxTimedRunsPerWay = 24;
  /// A paired ratio within this of 1 is undecided while fewer than
  /// kMaxTimedRunsPerWay pairs are timed.
  static constexpr double kUndecidedBand = 0.03;
  /// Compiled is chosen only if its median paired ratio to eager is below 1 - this.
  static constexpr double kCompiledMargin = 0.01;
  /// Backwards between the first measurement and the second.
  static constexpr uint64_t kRemeasureRuns = 500;
  /// The gap between measurements doubles up to kRemeasureRuns << this.
  static constexpr uint32_t kMaxRemeasureShift = 5;

  /// How the next backward at the entry runs.
  enum class Serve { kCompiled, kEager, kTimeCompiled, kTimeEager };

  /// The capture allowed eager runs (capture()'s `eager_if_faster_allowed`).
  bool eligible = false;
  /// The last measurement chose the eager engine.
  bool eager = false;
  /// Measurements completed.
  uint32_t measurements = 0;
  /// Backwards counted at the entry since its capture (served either way).
  uint64_t runs = 0;
  /// The value of `runs` after which the next measurement starts.
  uint64_t measure_after = kWarmupRuns;
  /// Timed runs per way the current measurement takes (grows while undecided).
  std::size_t timed_per_way = kTimedRunsPerWay;
  /// The current measurement's timed compiled runs, in ns (empty between measurements).
  std::vector<uint64_t> compiled_ns;
  /// The current measurement's timed eager runs, in ns (empty between measurements).
  std::vector<uint64_t> eager_ns;
  /// Median of the last measurement's compiled runs, in ns (0 before the first).
  uint64_t compiled_median_ns = 0;
  /// Median of the last measurement's eager runs, in ns (0 before the first).
  uint64_t eager_median_ns = 0;
  /// Median of the last measurement's paired ratios compiled / eager (0 before the first).
  double compiled_over_eager = 0.0;
  /// Backwards run on the eager engine at this entry by choice or to time it.
  uint64_t eager_runs = 0;

  /// Back to a fresh capture's state; `eager_if_faster_allowed` from capture().
  void reset(bool eager_if_faster_allowed);
  /// Counts one backward at a ready entry and says how it runs; `plain`: it
  /// may be timed (no retain_graph, no create_graph).
  Serve next(bool plain);
  /// Whether next() would answer kEager whatever `plain` is (eager chosen,
  /// no timing due), without counting; see [Note: Eager without the walk].
  bool next_is_chosen_eager() const {
    return eager && runs + 1 <= measure_after;
  }
  /// Records one timed run. True when it completed a measurement, which has
  /// then set `eager` and the medians.
  bool record(bool eager_run, uint64_t ns);

  /// What one measurement decides; see [Note: Eager if faster].
  struct Decision {
    /// Run on the eager engine: compiled is not faster by kCompiledMargin.
    bool eager = true;
    /// Median of the paired ratios compiled_ns[k] / eager_ns[k].
    double compiled_over_eager = 0.0;
    /// Too close to 1 to decide with fewer than kMaxTimedRunsPerWay pairs:
    /// the measurement goes on.
    bool undecided = false;
  };
  /// The decision from timed runs of each way, the k-th of each neighbours in
  /// the schedule; the two are equally long and not empty.
  static Decision decide(const std::vector<uint64_t>& compiled_ns, const std::vector<uint64_t>& eager_ns);
};


/// What a backward's GraphTask looks like, cheaply; see [Note: Eager without the walk].
struct GraphFingerprint {
  /// typeid of the root node (the loss's grad_fn).
  const std::type_info* root_type = nullptr;
  /// graph_task.dependencies_.size(), exec_info_.size(), output edges.
  std::size_t nodes = 0;
  std::size_t exec_nodes = 0;
  std::size_t outputs = 0;
  /// retain_graph, create_graph, and backward (true) or grad (false).
  bool keep_graph = false;
  bool create_graph = false;
  bool accumulate_grad = false;
  /// The types, input numbers and input shapes of the next edges of the
  /// first kFingerprintNodes nodes from the root (breadth first), hashed.
  std::size_t next_hash = 0;

  bool operator==(const GraphFingerprint& o) const {
    return root_type == o.root_type && nodes == o.nodes && exec_nodes == o.exec_nodes &&
        outputs == o.outputs && keep_graph == o.keep_graph && create_graph == o.create_graph &&
        accumulate_grad == o.accumulate_grad && next_hash == o.next_hash;
  }
};

/// The fingerprint of the backward the engine is about to run.
GraphFingerprint fingerprint_of(
    const torch::autograd::Node& root,
    const torch::autograd::GraphTask& graph_task,
    bool accumulate_grad,
    const std::vector<torch::autograd::Edge>& output_edges);

/// Whether any backward walked under the cache root `cache` is remembered:
/// only then is a backward's fingerprint worth computing before its walk.
bool remembers_eager_under(const ShadowNode* cache);

/// Remembers a backward whose walk ended at `entry` (alive while the cache's
/// generation is `generation`), which chose eager.
void remember_eager(const ShadowNode* cache, const GraphFingerprint& f, ShadowNode* entry, uint64_t generation);

/// Whether the backward of fingerprint `f` under `cache` (now at generation
/// `generation`) runs on the eager engine without a walk: its entry still
/// chose eager and no timing or walk is due. Then the run is counted at the
/// entry; otherwise `f` is forgotten until a walk ends at a choice of eager
/// again.
bool serve_remembered_eager(const ShadowNode* cache, const GraphFingerprint& f, uint64_t generation);

} // namespace ca
