// hit_choice.cpp — the schedule and the decision of HitChoice: when a cache
// entry times its hits both ways and which way wins; see [Note: Eager when it
// is faster]. Plain C++: no torch or Python here.
#include "hit_choice.h"

#include <algorithm>

namespace ca {

namespace {

/// The median of `ns` (reorders it); its size is kTimedRunsPerWay > 0.
uint64_t median(std::vector<uint64_t>& ns) {
  const std::size_t mid = ns.size() / 2;
  std::nth_element(ns.begin(), ns.begin() + static_cast<std::ptrdiff_t>(mid), ns.end());
  const uint64_t upper = ns[mid];
  if (ns.size() % 2 != 0) {
    return upper;
  }
  const uint64_t lower = *std::max_element(ns.begin(), ns.begin() + static_cast<std::ptrdiff_t>(mid));
  return lower + (upper - lower) / 2;
}

} // namespace

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
  if (eager_turn ? eager_ns.size() < kTimedRunsPerWay : compiled_ns.size() >= kTimedRunsPerWay) {
    return Serve::kTimeEager;
  }
  return Serve::kTimeCompiled;
}

bool HitChoice::record(bool eager_run, uint64_t ns) {
  std::vector<uint64_t>& sink = eager_run ? eager_ns : compiled_ns;
  if (sink.size() >= kTimedRunsPerWay) {
    return false;
  }
  sink.push_back(ns);
  if (compiled_ns.size() < kTimedRunsPerWay || eager_ns.size() < kTimedRunsPerWay) {
    return false;
  }
  compiled_median_ns = median(compiled_ns);
  eager_median_ns = median(eager_ns);
  eager = static_cast<double>(compiled_median_ns) >
      static_cast<double>(eager_median_ns) * (1.0 + kCompiledMargin);
  compiled_ns = std::vector<uint64_t>();
  eager_ns = std::vector<uint64_t>();
  measure_after = runs + (kRemeasureRuns << std::min(measurements, kMaxRemeasureShift));
  ++measurements;
  return true;
}

} // namespace ca
