// hit_choice.cpp — the schedule and the decision of HitChoice: when a cache
// entry times its hits both ways and which way wins; see [Note: Eager when it
// is faster]. Plain C++: no torch or Python here.
#include "hit_choice.h"

#include <algorithm>
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

HitChoice::Decision HitChoice::decide(
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

void HitChoice::reset(bool may_run_eagerly) {
  *this = HitChoice();
  eligible = may_run_eagerly;
}

HitChoice::Serve HitChoice::next(bool plain) {
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

bool HitChoice::record(bool eager_run, uint64_t ns) {
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

} // namespace ca
