// engine_hook.cpp — the function installed with Engine::set_compiled_autograd:
// walks the graph, serves a cache hit or asks ca_runtime to capture a miss,
// runs the compiled graph, accumulates leaf grads, and falls back to the eager
// engine when anything cannot be compiled.
#include "ca_core.h"
#include "tensor_caster.h"

#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/input_buffer.h>

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <iterator>
#include <optional>
#include <typeinfo>

namespace ca {

using torch::autograd::Engine;
using torch::autograd::GraphTask;
using torch::autograd::InputBuffer;

/*
[Note: Engine hook lifetime]
Engine::set_compiled_autograd only has a setter, so nobody can read back what
is installed. ca_core therefore only ever swaps between "ours" and "nothing";
ca_runtime.enable() remembers what was active before it (ours with another
runtime, torch's built-in compiled autograd, or eager) and restores exactly
that on exit, re-arming torch's hook through its own Python API if needed.
The runtime object is a strong reference held here while installed, and
each backward in flight holds one of its own (BackwardRun::runtime): a
context exit on another thread (uninstall_engine_hook) while a hook sleeps or
a compiler_fn compiles must not free the runtime that backward still calls.

[Note: Final callbacks]
Engine::execute holds a GraphTaskGuard on the backward's GraphTask while it
calls our hook, so Engine::queue_callback (DDP's and FSDP's end-of-backward
work, or a user's Variable._execution_engine.queue_callback from a hook)
appends to graph_task.final_callbacks_ during the compiled backward. The
eager engine runs them in exec_post_processing, which the compiled path never
reaches, so the hook runs them itself after the leaf grads are accumulated:
in order, including callbacks queued by callbacks, the lock released around
each call. The eager fallback (execute_with_graph_task) runs them itself and
must not run them twice.

[Note: Leaf node hooks]
grad_fn pre/post hooks on an AccumulateGrad node come in two kinds. When all
are Python's (grad_acc.register_prehook / register_hook, as Megatron and
DeepSpeed register per parameter), the walk collects them like any node's
(NodeState::leaf_hooks_collected), so the graph can call them at the leaf's
eager position around its in-graph accumulation. When any is C++ (the DDP
Reducer's autograd_hook, whose compiled_args refuses compiled autograd), none
is traced: the walk keys on their number and C++ types only, and
run_leaf_node calls them around the real node, after the graph, as eager's
call_function would; a leaf whose C++ hooks must run before later user code
is accumulated behind a graph break instead (see [Note: Leaf accumulation
order] in ca_runtime). A leaf that stays a graph output is run by
run_leaf_node either way, with its real hooks.

[Note: Whose failure]
A node whose compiled_args throws during the walk may be the user's mistake
(a second backward through freed buffers, a saved tensor modified in place)
or ours. The walk runs no user code, so the hook can ask the eager engine,
the oracle: it runs the backward eagerly first. If eager raises, the error was
the user's: it propagates exactly as eager raised it, with no warning, and
nothing is remembered, so the next backward captures or hits as if it had not
happened. Only if eager succeeds is the failure ours: it is then reported
(one EagerFallbackWarning) and remembered on that key path. A compiled
graph's first run that fails (run_first returns None) is judged the same way,
except for exceptions the runtime can already tell came from user code, which
propagate at once (the graph ran part of the user's hooks: running them again
eagerly would repeat their side effects).

[Note: Anomaly mode]
Under torch.autograd.detect_anomaly() / set_detect_anomaly(True) the eager
engine checks every node's outputs for NaN, names the node and output in its
error and prints the forward traceback of the failing node. A compiled graph
has no per-node boundary to check at, so such a backward runs on the eager
engine, silently (anomaly mode is a debugging mode; speed does not matter
there): it is counted in eager_fallbacks, and no warning is given.

[Note: Eager fallback]
A backward that cannot be compiled runs on the eager engine from inside the
hook: execute_with_graph_task on the same GraphTask, which the walk left
untouched (it counts dependencies in a map of its own), then waits on the
task's future. The GIL is released meanwhile because eager nodes (PyNode,
hooks) take it themselves and device threads may need it.
*/

namespace {

/// Counters kept in C++ so that the hit path allocates nothing in Python.
struct Counters {
  std::atomic<uint64_t> captures{0};
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> eager_fallbacks{0};
  std::atomic<uint64_t> eager_while_compiling{0};
  std::atomic<uint64_t> eager_if_faster_runs{0};
  /// Of eager_if_faster_runs: served without a walk; see [Note: Eager without the walk].
  std::atomic<uint64_t> eager_if_faster_without_walk{0};
  std::atomic<uint64_t> nodes_put_back{0};
  /// Backwards run eagerly because the runtime deferred their capture; see
  /// [Note: Deferred captures].
  std::atomic<uint64_t> deferred_captures{0};
};
Counters g_counters;

/// One field of Counters, as counters() names it.
struct CounterField {
  /// Its key in counters()'s dict.
  const char* name;
  /// The field.
  std::atomic<uint64_t> Counters::* field;
};

/// Every counter: the one table counters() and reset_counters() read, in
/// counters()'s order. A field of Counters missing here is a build error
/// below (the static_assert counts them).
constexpr CounterField kCounterFields[] = {
    {"captures", &Counters::captures},
    {"cache_hits", &Counters::cache_hits},
    {"eager_fallbacks", &Counters::eager_fallbacks},
    {"eager_while_compiling", &Counters::eager_while_compiling},
    {"eager_if_faster_runs", &Counters::eager_if_faster_runs},
    {"eager_if_faster_without_walk", &Counters::eager_if_faster_without_walk},
    {"nodes_put_back", &Counters::nodes_put_back},
    {"deferred_captures", &Counters::deferred_captures},
};
static_assert(
    sizeof(Counters) == std::size(kCounterFields) * sizeof(std::atomic<uint64_t>),
    "every field of Counters has its row in kCounterFields");

/// The ca_runtime object (capture, run_first, report_fallback), or null.
PyObject* g_runtime = nullptr;
/// The cache root of the installed runtime's compiler; see [Note: One cache per compiler].
ShadowNode* g_cache = nullptr;
/// The installed runtime's `eager_if_faster`: entries may choose the eager
/// engine; see [Note: Eager if faster].
bool g_eager_if_faster = false;

/// Depth of our hook on this thread; > 0 means a backward inside a backward.
thread_local int t_hook_depth = 0;
struct DepthGuard {
  DepthGuard() {
    ++t_hook_depth;
  }
  ~DepthGuard() {
    --t_hook_depth;
  }
};

/*
[Note: Dynamo's callback during a compiled backward]
A backward called inside a torch.compile'd function (a compiled training step
whose loss.backward() breaks Dynamo's graph) runs with Dynamo's eval-frame
callback set on this thread, so Dynamo would intercept every Python frame our
hook enters: it would trace ca_runtime's capture and run_first and the cache
hit's graph call as user code. The compiled backward therefore runs with the
callback cleared and puts the prior one back when it returns or throws. Our
graph's own torch.compile sets its callback for its call as always, and the
nodes that run eagerly behind graph breaks are Dynamo-disabled anyway.
Without a callback (the usual case) this costs one Python call.
*/
class DynamoCallbackOff {
 public:
  DynamoCallbackOff() {
    static PyObject* set_eval_frame = [] {
      try {
        nb::object fn =
            nb::module_::import_("torch._C._dynamo.eval_frame").attr("set_eval_frame");
        return fn.release().ptr(); // leaked: used until process exit
      } catch (const nb::python_error&) {
        return static_cast<PyObject*>(nullptr);
      }
    }();
    set_eval_frame_ = set_eval_frame;
    if (set_eval_frame_ != nullptr) {
      prior_ = nb::steal(
          check_py(PyObject_CallOneArg(set_eval_frame_, Py_None)));
    }
  }
  ~DynamoCallbackOff() {
    if (prior_.is_valid() && !prior_.is_none()) {
      // Restored even while an exception is pending (a user hook's).
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      PyObject* ignored = PyObject_CallOneArg(set_eval_frame_, prior_.ptr());
      Py_XDECREF(ignored);
      PyErr_Restore(type, value, traceback);
    }
  }
  DynamoCallbackOff(const DynamoCallbackOff&) = delete;
  DynamoCallbackOff& operator=(const DynamoCallbackOff&) = delete;

 private:
  /// torch._C._dynamo.eval_frame.set_eval_frame, or null without Dynamo.
  PyObject* set_eval_frame_ = nullptr;
  /// The callback that was set when the backward began.
  nb::object prior_;
};

/// Runs the whole backward on the eager engine; see [Note: Eager fallback].
variable_list run_eager(
    const c10::intrusive_ptr<Node>& root,
    const GraphTask& graph_task) {
  auto task = const_cast<GraphTask&>(graph_task).shared_from_this();
  nb::gil_scoped_release no_gil;
  auto future = Engine::get_default_engine().execute_with_graph_task(
      task, root, InputBuffer(variable_list()));
  future->wait();
  // Warnings nodes raised on the engine's threads (anomaly mode's forward
  // traceback among them) were held by the task; Engine::execute replays
  // them after the wait, which the compiled-autograd path skips.
  torch_private::replay_warnings(task->warning_handler_);
  return future->value().toTensorVector();
}

/// Tells the backward's runtime (which it holds; see [Note: Engine hook
/// lifetime]) why this backward runs eagerly (it warns and counts).
void report_fallback(nb::handle runtime, const std::string& node, const std::string& reason) {
  ++g_counters.eager_fallbacks;
  runtime.attr("report_fallback")(node, reason);
}

/// Marks a cache entry failed, with the reason the runtime just warned about
/// (its `last_failure` attribute).
void mark_failed(ShadowNode& entry, nb::handle runtime) {
  entry.failed = true;
  if (nb::hasattr(runtime, "last_failure")) {
    entry.failure = nb::cast<std::string>(nb::str(runtime.attr("last_failure")));
  }
}

/// The graph's inputs: the de-duplicated lifted tensors, every
/// non-AccumulateGrad node's sizes and scalars in walk order, and every
/// node's collected Python objects (hooks, Function ctx, packed saved data)
/// in walk order.
struct GraphArgs {
  nb::list tensors;
  nb::list sizes;
  nb::list scalars;
  nb::list hooks;
  std::vector<int64_t> size_values;
};

GraphArgs lift_args(const BackwardState& state) {
  GraphArgs args;
  // Sized once: growing a list of thousands of tensors reallocates it.
  const size_t num_tensors = state.lifted_tensors.size();
  args.tensors = nb::steal<nb::list>(check_py(PyList_New(static_cast<Py_ssize_t>(num_tensors))));
  // See [Note: Leaves accumulated in the graph] for the detach.
  const bool detach_non_leaves = state.leaf_hooks_in_graph && !state.create_graph;
  for (size_t i = 0; i < num_tensors; ++i) {
    const at::Tensor& t = state.lifted_tensors[i];
    PyList_SET_ITEM(
        args.tensors.ptr(),
        static_cast<Py_ssize_t>(i),
        // See [Note: ZeroTensors kept out of compiled graphs] (node_apply.cpp).
        check_py(wrap_tensor(
            materialized_zeros(detach_non_leaves && !t.is_leaf() ? t.detach() : t))));
  }
  for (const auto& ns : state.nodes) {
    if (!ns.collected) {
      continue;
    }
    for (const auto& size : ns.collected->all_size_inputs) {
      args.size_values.push_back(size.value);
    }
    for (const auto& hook : ns.collected->hooks) {
      args.hooks.append(nb::handle(py_object(hook)));
    }
    // Packed data of saved tensors with unpack hooks, after the node's hooks;
    // see NodeInfo::unpack_hooks.
    for (const auto& packed : ns.collected->packed_inputs) {
      args.hooks.append(nb::handle(py_object(packed)));
    }
    if (ns.is_accumulate_grad) {
      continue;
    }
    for (const auto& lifted : ns.collected->lifted_ivalue_args.args) {
      const at::IValue& iv = *lifted.actual_ptr;
      if (iv.isInt()) {
        args.scalars.append(nb::int_(iv.toInt()));
      } else if (iv.isDouble()) {
        args.scalars.append(nb::float_(iv.toDouble()));
      } else {
        TORCH_CHECK_NOT_IMPLEMENTED(
            false, "ca_core: symbolic lifted scalars are not supported yet");
      }
    }
  }
  return args;
}

/// Applies the graph's leaf grads through the real AccumulateGrad nodes, which
/// gives eager's stealing, layout and post-accumulate-grad-hook behaviour. A
/// leaf the graph accumulated itself (`hooks_only`) only gets its grad_fn
/// post hooks; see [Note: Leaves accumulated in the graph].
void accumulate_leaf_grads(
    BackwardState& state,
    const std::vector<uint32_t>& leaf_outputs,
    const std::vector<bool>& hooks_only,
    variable_list& leaf_grads) {
  TORCH_CHECK(
      leaf_grads.size() == leaf_outputs.size(),
      "ca_core: compiled backward returned ",
      leaf_grads.size(),
      " leaf grads, expected ",
      leaf_outputs.size());
  for (size_t k = 0; k < leaf_outputs.size(); ++k) {
    NodeState& ns = state.nodes.at(leaf_outputs[k]);
    TORCH_INTERNAL_ASSERT(ns.is_accumulate_grad);
    if (k < hooks_only.size() && hooks_only[k]) {
      run_leaf_post_hooks(*ns.call.node, std::move(leaf_grads[k]));
    } else {
      run_leaf_node(*ns.call.node, std::move(leaf_grads[k]));
    }
  }
}

/// Runs the callbacks queued with Engine::queue_callback during the compiled
/// backward, as GraphTask::exec_post_processing (not exported) does; see
/// [Note: Final callbacks].
void run_final_callbacks(GraphTask& task) {
  std::unique_lock<std::mutex> lock(task.final_callbacks_lock_);
  // Index loop: a callback may queue another, which runs in this loop too.
  for (size_t i = 0; i < task.final_callbacks_.size(); ++i) {
    std::function<void()> callback = task.final_callbacks_[i];
    lock.unlock();
    callback();
    lock.lock();
  }
}

/// What capture() returns (Python's ca_core.CapturedGraph): the compiled
/// graph and what the engine hook needs to run it.
struct Captured {
  /// The compiled callable (graph inputs -> outputs).
  nb::object compiled;
  /// The walk index of each AccumulateGrad node whose grad the graph returns.
  std::vector<uint32_t> leaf_outputs;
  /// Per leaf output: the graph accumulated it; only its post hooks run.
  /// Empty when none is (the common case), so a cache hit copies nothing.
  std::vector<bool> hooks_only;
  /// See [Note: Saved tensors freed early].
  std::vector<uint32_t> free_early;
  /// Its hits may be served by the eager engine if that is faster; see
  /// [Note: Eager if faster].
  bool eager_if_faster_allowed = false;
};

/// The CapturedGraph capture() returns, or nullopt for None.
std::optional<Captured> unpack_capture(nb::handle result) {
  if (result.is_none()) {
    return std::nullopt;
  }
  Captured* returned = nullptr;
  if (!nb::try_cast<Captured*>(result, returned) || returned == nullptr) {
    throw nb::type_error(
        (std::string("ca_core: capture() must return a ca_core.CapturedGraph or None, got ") +
         Py_TYPE(result.ptr())->tp_name)
            .c_str());
  }
  Captured out = *returned;
  TORCH_CHECK(
      out.hooks_only.empty() || out.hooks_only.size() == out.leaf_outputs.size(),
      "ca_core: CapturedGraph.leaf_hooks_only must be empty or one per leaf output");
  if (std::find(out.hooks_only.begin(), out.hooks_only.end(), true) == out.hooks_only.end()) {
    out.hooks_only.clear();
  }
  return out;
}

/*
[Note: The steps of a backward]
compiled_backward_with_gil runs one backward as five steps over a
BackwardRun, each of which may end it early on the eager engine:
  1. walk: walk_graph() keys every node and lifts its values; a node whose
     compiled_args throws ends here (see [Note: Whose failure]).
  2. lookup: the entry the walk ended at is failed (eager at once), holds a
     graph for these sizes (a hit), or not (a miss); the graph's inputs are
     lifted either way.
  3. capture (a miss only): ca_runtime's capture() builds and compiles the
     graph and the entry keeps it; a capture that fails runs eagerly and
     marks the entry failed.
  4. run: the compiled graph is called. Its first run is where lazy
     compilers compile, and a failure there is judged by eager (see
     [Note: Static when dynamic fails] and [Note: Whose failure]).
  5. finish: the graph's outputs become the engine's outputs and the leaf
     grads go through the real AccumulateGrad nodes, saved variables are
     released and final callbacks run.
Steps 3 and 4 run with the BackwardState active and the compiler interface
installed once (see [Note: One compiler interface for all threads]). When
timing is on (set_timing, for ca_runtime.report()), walk, lookup, run and
finish are timed, and so is the whole hook (hook_ns: the GIL taken, every
step, and the walk state given back for the next backward, which is where
what the steps leave goes); when it is off, the hit path pays one relaxed
atomic load per step.
*/

/// Nanoseconds spent per step, summed over the backwards timed; see
/// [Note: The steps of a backward].
struct Timings {
  std::atomic<bool> enabled{false};
  /// Step 1.
  std::atomic<uint64_t> walk_ns{0};
  /// Step 2: lifting the graph's inputs and freeing saved tensors early included.
  std::atomic<uint64_t> lookup_ns{0};
  /// Step 4.
  std::atomic<uint64_t> run_ns{0};
  /// Step 5.
  std::atomic<uint64_t> finish_ns{0};
  /// The whole engine hook, from before the GIL is taken to after the walk
  /// state is given back.
  std::atomic<uint64_t> hook_ns{0};
  /// Backwards that reached the hook while timing was on.
  std::atomic<uint64_t> timed_backwards{0};
};
Timings g_timings;

/// Adds the time of a scope to `sink` when timing is on.
class StepTimer {
 public:
  explicit StepTimer(std::atomic<uint64_t>& sink, bool counts = true)
      : sink_(counts && g_timings.enabled.load(std::memory_order_relaxed) ? &sink : nullptr) {
    if (sink_ != nullptr) {
      start_ = std::chrono::steady_clock::now();
    }
  }
  ~StepTimer() {
    if (sink_ != nullptr) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - start_);
      sink_->fetch_add(static_cast<uint64_t>(ns.count()), std::memory_order_relaxed);
    }
  }
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

 private:
  std::atomic<uint64_t>* sink_;
  std::chrono::steady_clock::time_point start_;
};

/// One backward in flight through the hook; see [Note: The steps of a backward].
struct BackwardRun {
  BackwardRun(
      const c10::intrusive_ptr<Node>& root,
      const GraphTask& graph_task,
      bool accumulate_grad,
      const torch::autograd::edge_list& output_edges)
      : root(root),
        graph_task(graph_task),
        accumulate_grad(accumulate_grad),
        output_edges(output_edges),
        runtime(nb::borrow(g_runtime)),
        cache(g_cache) {}
  /// Keeps what the cache lets go of during this backward alive until it
  /// ends; see [Note: What the cache lets go of]. Destroyed last.
  CacheUse cache_use;
  /// The engine's root node and task (the eager fallback runs them).
  const c10::intrusive_ptr<Node>& root;
  const GraphTask& graph_task;
  /// The engine's accumulate_grad (backward) and outputs (grad's inputs).
  bool accumulate_grad;
  const torch::autograd::edge_list& output_edges;
  /// The ca_runtime object installed when the backward began (capture,
  /// run_first, report_fallback), a strong reference: enable() may exit on
  /// another thread meanwhile; see [Note: Engine hook lifetime].
  nb::object runtime;
  /// The root of the cache tree it walks (its compiler's).
  ShadowNode* cache;
  /// Its GraphTask's fingerprint, computed only when some fingerprint is
  /// remembered for its cache or it is to be remembered; see [Note: Eager
  /// without the walk].
  std::optional<GraphFingerprint> fingerprint;
  /// The walked backward.
  BackwardStatePtr state;
  /// The cache entry the walk ended at.
  ShadowNode* entry = nullptr;
  /// cache_generation(*cache) after the walk: Python code may clear the cache
  /// meanwhile, and then `entry` is gone; see [Note: Cache and the GIL].
  uint64_t generation = 0;
  /// The graph's inputs.
  GraphArgs args;
  /// The graph to call and what it returns besides the engine's outputs.
  nb::object compiled;
  std::vector<uint32_t> leaf_outputs;
  std::vector<bool> leaf_hooks_only;
  /// The graph has not completed a run yet (lazy compilers compile now).
  bool first_run = false;
  /// Set when this compiled run is timed for the entry's choice: when its
  /// timing began; see [Note: Eager if faster].
  std::optional<std::chrono::steady_clock::time_point> timed_since;
  /// When the walk began: a timed compiled run includes it; see [Note: Eager
  /// without the walk].
  std::chrono::steady_clock::time_point walk_started;
  /// The fingerprint, computed on first use. The walk reads the GraphTask
  /// and the graph without changing them, so it is the same before and after.
  const GraphFingerprint& fingerprint_now() {
    if (!fingerprint) {
      fingerprint = fingerprint_of(*root, graph_task, accumulate_grad, output_edges);
    }
    return *fingerprint;
  }
  /// Whether `entry` still exists.
  bool entry_alive() const {
    return cache_generation(*cache) == generation;
  }
  /// Runs the backward on the eager engine and counts it as a fallback.
  variable_list eager() const {
    ++g_counters.eager_fallbacks;
    return run_eager(root, graph_task);
  }
  /// Runs the backward on the eager engine from lookup(), the walk's state
  /// dropped first; see [Note: The walk lets go before eager runs].
  variable_list eager_after_walk() {
    state.reset();
    return run_eager(root, graph_task);
  }
};

/*
[Note: The walk lets go before eager runs]
The walk's state holds every saved tensor it lifted (the per-node
collected->tensor_args and lifted_tensors). When lookup() sends a walked
backward to the eager engine (a failed entry, a graph still compiling, or
the eager engine chosen, see [Note: Eager if faster]), the state is
recycled first: otherwise eager's release of each node's saved tensors
frees nothing until the backward ends, the allocator takes fresh pages for
the grads meanwhile, and the backward's peak memory is that of a graph
holding everything (tests/scripts/backward_peak_memory.py, eight 1024-wide
layers: 35.4 MB against eager's 18.7 MB; and about 60 us more per backward
on the benchmark's MLP, bench/LOG.md). lookup() runs before the
BackwardState is made active, so nothing else points at it.
*/

/// Step 1. Returns the outputs when the backward already ran eagerly.
std::optional<variable_list> walk(BackwardRun& run) {
  StepTimer timer(g_timings.walk_ns);
  run.walk_started = std::chrono::steady_clock::now();
  const uint64_t walk_generation = cache_generation(*run.cache);
  try {
    run.state = walk_graph(*run.cache, run.root, run.graph_task, run.output_edges);
  } catch (const WalkError& e) {
    if (e.remembered) {
      return run.eager();
    }
    // Eager first: its error is the user's; see [Note: Whose failure].
    variable_list outputs = run_eager(run.root, run.graph_task);
    if (cache_generation(*run.cache) == walk_generation) {
      e.at->walk_failures.push_back(e.type);
    }
    report_fallback(run.runtime, e.node, e.what());
    return outputs;
  }
  run.state->accumulate_grad = run.accumulate_grad;
  run.state->create_graph = c10::GradMode::is_enabled();
  run.entry = run.state->entry;
  run.generation = cache_generation(*run.cache);
  return std::nullopt;
}

/*
[Note: Saved tensors freed early]
Eager frees each node's saved tensors as soon as the node has run. A
compiled graph gets them all as inputs at once, so unless every holder lets
go, they all stay alive until the graph ends, and the peak memory of a
backward grows by every saved activation (on a GPT-style decoder, ten times
eager's). On a cache hit without retain_graph, before the graph runs:
  - the SavedVariables of the nodes the graph traces (capture()'s
    free_early: not those behind a graph break, which run the real node, nor
    Python Functions, whose ctx the graph uses) have their data reset, and
    those nodes' own lists of lifted tensors (collected->tensor_args.inputs)
    are emptied in place (same length, undefined tensors);
  - the walk's lifted_tensors are dropped; the graph's `inputs` list is then
    the only holder left;
  - ca_runtime marks `inputs` as a local Dynamo may steal
    (set_locals_to_steal), so Dynamo and AOTAutograd take the list's items
    over and free each one after its last use, as for torch's own compiled
    autograd.
A node whose values are dropped so can still be traced again (Dynamo
recompiling on a guard failure during the hit): apply_with_saved swaps the
graph's values into the SavedVariables it looks up by address, and
ProxyValues finds each value's slot by position, without the dropped
tensors. It can no longer run eagerly, which a hit never asks of it: eager
fallbacks follow a capture or a failed first run, and lookup() sends a
failed entry's, a compiling graph's or a chosen eager backward to the eager
engine before this runs; nothing was dropped in any of them. Enabled per
entry after its first run.
*/
void free_saved_early(BackwardState& state, const ShadowNode& entry) {
  // See [Note: Nodes that run for real keep their saved tensors].
  const bool may_keep = entry.ran_for_real.size() == entry.free_early.size() &&
      !(state.leaf_hooks_in_graph && !state.create_graph);
  for (size_t i = 0; i < entry.free_early.size(); ++i) {
    if (may_keep && entry.ran_for_real[i]) {
      continue;
    }
    NodeState& ns = state.nodes.at(entry.free_early[i]);
    if (!ns.collected || ns.is_accumulate_grad) {
      continue;
    }
    torch_private::reset_lifted_saved_variables(ns.collected->tensor_args);
    for (auto& t : ns.collected->tensor_args.inputs) {
      t = at::Tensor();
    }
  }
  state.lifted_tensors.clear();
}

/*
[Note: Eager while compiling]
A runtime may compile a graph's kernels on another thread after the graph's
first run (ca_runtime's [Note: Compiling in the background]). It then
answers take_compiling(), called right after that first run, with a
callable that says whether the kernels are ready, and the entry keeps it.
Until it says yes, a backward that reaches the entry runs on the eager
engine, before anything is lifted or freed: eager is the oracle, and its
nodes run without the GIL, so they do not wait behind the compile as the
graph's Python would. It is counted in eager_while_compiling, not as a hit
or a fallback. The first yes drops the callable, and from then on the entry
is served as any other: the hot path pays one null check.
*/

/// Tells the runtime which way an entry chose (optional report_eager_if_faster);
/// the backward has run, so an error there is only printed.
void report_eager_if_faster(const ShadowNode& entry) {
  if (g_runtime == nullptr) {
    return;
  }
  try {
    // The runtime installed now: the run's own may have been uninstalled
    // while the eager engine ran without the GIL.
    nb::object report = nb::getattr(nb::handle(g_runtime), "report_eager_if_faster", nb::none());
    if (!report.is_none()) {
      const EagerIfFaster& c = entry.eager_if_faster;
      report(entry.id, c.eager, static_cast<double>(c.compiled_median_ns) * 1e-9,
             static_cast<double>(c.eager_median_ns) * 1e-9, c.compiled_over_eager);
    }
  } catch (nb::python_error& e) {
    e.discard_as_unraisable("ca_core: report_eager_if_faster");
  }
}

/// Adds one timed run to the choice of `run`'s entry, if it still exists.
void record_eager_if_faster(const BackwardRun& run, bool eager_run, std::chrono::steady_clock::time_point since) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now() - since);
  if (run.entry_alive() && run.entry->eager_if_faster.record(eager_run, static_cast<uint64_t>(ns.count()))) {
    report_eager_if_faster(*run.entry);
  }
}

/// sizes_match() on the walked sizes in lift_args' order, without collecting them.
bool walked_sizes_match(const ShadowNode& entry, const BackwardState& state) {
  size_t i = 0;
  for (const auto& ns : state.nodes) {
    if (!ns.collected) {
      continue;
    }
    for (const auto& size : ns.collected->all_size_inputs) {
      if (!size_fits(entry, i++, size.value)) {
        return false;
      }
    }
  }
  return i == entry.expected_sizes.size();
}

/// After a walk that ended at a choice of eager: remember it; see [Note:
/// Eager without the walk] in eager_if_faster.cpp.
void remember_eager_entry(BackwardRun& run) {
  remember_eager(run.cache, run.fingerprint_now(), run.entry, run.generation);
}

/// The backward run on the eager engine without a walk, if its fingerprint
/// leads to an entry that chose eager; see [Note: Eager without the walk].
std::optional<variable_list> eager_if_faster_without_walk(BackwardRun& run) {
  if (!serve_remembered_eager(run.cache, run.fingerprint_now(), cache_generation(*run.cache))) {
    return std::nullopt;
  }
  ++g_counters.eager_if_faster_runs;
  ++g_counters.eager_if_faster_without_walk;
  return run_eager(run.root, run.graph_task);
}

/// The entry's choice for this backward: its outputs when it ran on the
/// eager engine; see [Note: Eager if faster].
std::optional<variable_list> serve_eager_if_faster(BackwardRun& run) {
  EagerIfFaster& choice = run.entry->eager_if_faster;
  const bool plain = !run.state->keep_graph && !run.state->create_graph;
  const EagerIfFaster::Serve serve = choice.next(plain);
  if (serve == EagerIfFaster::Serve::kCompiled) {
    return std::nullopt;
  }
  // Sizes the graph was not captured for are a miss (a capture, sizes made
  // dynamic) whichever way was chosen at the sizes it was timed for.
  if (!walked_sizes_match(*run.entry, *run.state)) {
    return std::nullopt;
  }
  if (serve == EagerIfFaster::Serve::kTimeCompiled) {
    run.timed_since = run.walk_started;
    return std::nullopt;
  }
  ++choice.eager_runs;
  ++g_counters.eager_if_faster_runs;
  if (serve == EagerIfFaster::Serve::kEager) {
    remember_eager_entry(run);
    return run.eager_after_walk();
  }
  // Timed from after the walk's state is dropped: the compiled run's timer
  // stops before its state goes too.
  run.state.reset();
  const auto since = std::chrono::steady_clock::now();
  variable_list outputs = run_eager(run.root, run.graph_task);
  record_eager_if_faster(run, true, since);
  return outputs;
}

/// Step 2: hit or miss. Returns the outputs when the entry failed before, its
/// graph is still compiling, or its hits run eagerly by choice.
std::optional<variable_list> lookup(BackwardRun& run) {
  StepTimer timer(g_timings.lookup_ns);
  ShadowNode& entry = *run.entry;
  if (entry.failed) {
    ++g_counters.eager_fallbacks;
    return run.eager_after_walk();
  }
  if (C10_UNLIKELY(entry.compiling.is_valid())) {
    // See [Note: Eager while compiling].
    if (!nb::cast<bool>(entry.compiling())) {
      ++g_counters.eager_while_compiling;
      return run.eager_after_walk();
    }
    release_later(entry.compiling);
  }
  if (g_eager_if_faster && entry.may_choose()) {
    if (auto done = serve_eager_if_faster(run)) {
      return done;
    }
  }
  run.args = lift_args(*run.state);
  if (!entry.compiled_fn.is_valid() || !sizes_match(entry, run.args.size_values)) {
    explain_sizes(entry, run.args.size_values, *run.state);
    run.timed_since.reset();  // a capture follows: not a hit to time
    return std::nullopt;
  }
  ++g_counters.cache_hits;
  ++entry.hits;
  run.compiled = entry.compiled_fn;
  run.leaf_outputs = entry.leaf_outputs;
  run.leaf_hooks_only = entry.leaf_hooks_only;
  run.first_run = entry.first_run;
  run.state->dynamic_sizes = entry.dynamic_sizes;
  run.args.sizes = dynamic_size_args(run.state->dynamic_sizes, run.args.size_values);
  if (!run.first_run && !run.state->keep_graph) {
    free_saved_early(*run.state, entry);
  }
  return std::nullopt;
}

/// Whether every tensor the graph lifts is on the CPU, so that a CPU clock
/// times its work; see [Note: Eager if faster] in eager_if_faster.h.
bool lifts_only_cpu_tensors(const BackwardState& state) {
  for (const at::Tensor& t : state.lifted_tensors) {
    if (t.defined() && !t.device().is_cpu()) {
      return false;
    }
  }
  return true;
}

/*
[Note: The running graph's hooks]
A graph's `hooks` input reaches Dynamo as Python objects, which a custom op
in the graph cannot take as arguments. ca_runtime's in-graph checkpoint
recompute (see [Note: Checkpoint regions in the graph] in ca_runtime) is such
an op: it gets hook and packed-data indices, and reads the objects from the
list of the graph running on this thread through running_graph_hook(). The
list is set for the call of the graph and restored after it (a backward
inside a hook runs its own graph), so it is only ever the innermost graph's.
It is set during the capture too, whose checks may read the hooks (see
[Note: Hooks that read saved tensors] in ca_runtime).
*/

/// The `hooks` input of the graph running on this thread, or null.
PyObject*& running_graph_hooks() {
  thread_local PyObject* hooks = nullptr;
  return hooks;
}

/// Makes `hooks` the running graph's for its scope; see
/// [Note: The running graph's hooks].
class RunningHooksGuard {
 public:
  explicit RunningHooksGuard(nb::object hooks)
      : hooks_(std::move(hooks)), prior_(std::exchange(running_graph_hooks(), hooks_.ptr())) {}
  ~RunningHooksGuard() {
    running_graph_hooks() = prior_;
  }
  RunningHooksGuard(const RunningHooksGuard&) = delete;
  RunningHooksGuard& operator=(const RunningHooksGuard&) = delete;

 private:
  /// The list, alive while it is the running graph's.
  nb::object hooks_;
  /// The enclosing graph's list (a backward run by a hook), or null.
  PyObject* prior_;
};

/*
[Note: Deferred captures]
A capture costs seconds (Dynamo, AOTAutograd, Inductor) where an eager
backward costs milliseconds, so a program whose backwards each run once (an
evaluation script, a notebook, gradcheck's perturbed graphs) pays far more
for them than eager would, for hits that never come. Before capturing at an
entry without a graph, the engine hook asks the runtime's optional
`defer_capture(sightings, hooks, sizes_changed)` (sightings: the backwards
this entry has deferred before; hooks: the Python objects the graph would
call, its `hooks` input; sizes_changed: see [Note: Sightings whose sizes
changed]); if it answers True, this backward runs on the eager engine, the
entry's `sightings` goes up and deferred_captures counts it. Nothing else
changes: the entry is not failed, and its next backward asks again. The
runtime's rules (ca_runtime's [Note: Which captures wait]) read nothing but
the count, the objects' code and the Python stack, so the choice is the same
on every run of a program. A runtime without the method captures at once.
It may also answer a string, the reason it declines the entry for good,
after reporting that as a fallback (a graph whose hooks' code may change
hooks; see [Note: Hooks changed while a graph runs]): the entry is marked
failed, as a failed capture's is, and this backward and every later one at
it run on the eager engine. A deferred backward whose graph would call
Python code is also where a hook that changes other nodes' hooks shows
before any graph runs.
*/

/*
[Note: Sightings whose sizes changed]
An entry without a graph keeps the sizes and lifted tensor shapes of its
last deferred backward in expected_sizes and tensor_shapes (which lookup
reads only beside a graph, so they match nothing there). The runtime's
defer_capture is told whether this backward's differ from them: a program
that runs the same model at several sizes once each (a notebook trying
widths) shares one key path across them, and a rule that counts sightings
alone would capture it although no size comes back; see ca_runtime's [Note:
Which captures wait]. When the capture comes, choose_dynamic reads them as
it reads a last capture's: what changed since the last sighting is dynamic
from the first graph on, so a loop whose sizes change every step is
captured once.

[Note: A graph's changed sizes are not deferred]
Only an entry without a graph defers. An entry with a graph reaches the
capture step when its sizes differ from the graph's (lookup's miss): it is
captured again at once with what changed dynamic, as torch.compile
recompiles. Deferring there would also be wrong, not only slow: the
deferral writes the backward's sizes into expected_sizes, which beside a
graph are the sizes it was compiled for, so the next backward at the new
sizes would hit a graph specialised to the old ones (a hook saw a 3-row
grad in a 0-row backward; found by fuzzing enable()'s default).
*/

/// What the runtime's defer_capture answers; see [Note: Deferred captures].
enum class CaptureChoice {
  /// Capture now.
  capture,
  /// Run this backward eagerly; ask again at the entry's next backward.
  defer,
  /// Never capture the entry: the runtime has reported why as a fallback.
  decline,
};

/// Whether the runtime defers this backward's capture (it then runs eagerly)
/// or declines the entry; see [Note: Deferred captures].
CaptureChoice capture_choice(BackwardRun& run) {
  const bool alive = run.entry_alive();
  if (alive && run.entry->compiled_fn.is_valid()) {
    // See [Note: A graph's changed sizes are not deferred].
    return CaptureChoice::capture;
  }
  nb::object defer = nb::getattr(run.runtime, "defer_capture", nb::none());
  if (defer.is_none()) {
    return CaptureChoice::capture;
  }
  const uint32_t sightings = alive ? run.entry->sightings : 0;
  // See [Note: Sightings whose sizes changed] (a first sighting has none before it).
  std::vector<std::vector<int64_t>> shapes = alive ? tensor_shapes(*run.state) : decltype(shapes){};
  const bool sizes_changed = sightings > 0 &&
      (run.args.size_values != run.entry->expected_sizes || shapes != run.entry->tensor_shapes);
  nb::object answer = defer(sightings, run.args.hooks, sizes_changed);
  if (nb::isinstance<nb::str>(answer)) {
    return CaptureChoice::decline;
  }
  if (!nb::cast<bool>(answer)) {
    return CaptureChoice::capture;
  }
  ++g_counters.deferred_captures;
  if (alive) {
    ShadowNode& entry = *run.entry;
    ++entry.sightings;
    entry.expected_sizes = run.args.size_values;
    entry.tensor_shapes = std::move(shapes);
  }
  return CaptureChoice::defer;
}

/// Step 3: captures the backward into its entry; false if the capture failed.
bool capture(BackwardRun& run) {
  BackwardState& state = *run.state;
  choose_dynamic(*run.entry, run.args.size_values, state);
  nb::object description = describe_backward(state, run.entry->id);
  std::optional<Captured> captured;
  {
    RunningHooksGuard running_hooks(run.args.hooks);
    captured = unpack_capture(run.runtime.attr("capture")(description));
  }
  if (!captured) {
    return false;
  }
  ++g_counters.captures;
  run.compiled = std::move(captured->compiled);
  run.leaf_outputs = std::move(captured->leaf_outputs);
  run.leaf_hooks_only = std::move(captured->hooks_only);
  if (run.entry_alive()) {
    ShadowNode& entry = *run.entry;
    release_later(entry.compiled_fn);  // see [Note: What the cache lets go of]
    entry.compiled_fn = run.compiled;
    entry.leaf_outputs = run.leaf_outputs;
    entry.leaf_hooks_only = run.leaf_hooks_only;
    entry.free_early = std::move(captured->free_early);
    entry.ran_for_real.clear();
    entry.eager_if_faster.reset(captured->eager_if_faster_allowed && lifts_only_cpu_tensors(state));
    entry.expected_sizes = run.args.size_values;
    entry.dynamic_sizes = state.dynamic_sizes;
    entry.tensor_shapes = tensor_shapes(state);
    entry.first_run = true;
  }
  run.first_run = true;
  run.args.sizes = dynamic_size_args(state.dynamic_sizes, run.args.size_values);
  return true;
}

/// The first call of a fresh graph, through the runtime's run_first; None if
/// it failed for a reason that is not plainly the user's.
nb::object call_first(BackwardRun& run) {
  return run.runtime.attr("run_first")(
      run.compiled,
      run.args.tensors,
      run.args.sizes,
      run.args.scalars,
      run.args.hooks,
      run.state->dynamic_dims);
}

/// Removes the tag ca_runtime's graph put on the pending exception if a
/// user's hook or Function raised it, so that it reaches the user exactly as
/// eager raised it; see [Note: User errors are tagged] in ca_runtime. An
/// untagged exception whose __context__ chain holds a tagged one replaced
/// the user's on its way out of the graph (a @contextmanager's __exit__ sets
/// __traceback__ through a setattr the user's exception class may refuse):
/// the user's becomes the pending one again, as ca_runtime's
/// user_error_behind does on a first run. Only called on the error path.
void untag_user_error() {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  constexpr int kContextDepth = 8;  // as user_error_behind's
  PyObject* current = value;
  Py_XINCREF(current);
  for (int depth = 0; current != nullptr && depth < kContextDepth; ++depth) {
    if (PyObject_HasAttrString(current, "__ca_user_error__")) {
      // Generic deletion, past a class's own __delattr__ (a frozen exception
      // class refuses it; ca_runtime set the tag the same way).
      PyObject* name = PyUnicode_FromString("__ca_user_error__");
      if (name == nullptr || PyObject_GenericSetAttr(current, name, nullptr) != 0) {
        PyErr_Clear();
      }
      Py_XDECREF(name);
      if (current != value) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        type = reinterpret_cast<PyObject*>(Py_TYPE(current));
        Py_INCREF(type);
        traceback = PyException_GetTraceback(current);  // new reference or null
        value = current;
        Py_INCREF(value);
      }
      break;
    }
    PyObject* context = PyException_GetContext(current);  // new reference or null
    Py_DECREF(current);
    current = context;
  }
  Py_XDECREF(current);
  PyErr_Restore(type, value, traceback);
}

/// Step 4: calls the graph into `result`. Returns the outputs when its first
/// run failed and the backward ran eagerly instead.
std::optional<variable_list> run_graph(BackwardRun& run, nb::object& result) {
  StepTimer timer(g_timings.run_ns);
  RunningHooksGuard running_hooks(run.args.hooks);
  if (!run.first_run) {
    // See [Note: Nodes that run for real keep their saved tensors].
    run.state->release_after_apply = !run.state->keep_graph;
    PyObject* outputs = PyObject_CallFunctionObjArgs(
        run.compiled.ptr(),
        run.args.tensors.ptr(),
        run.args.sizes.ptr(),
        run.args.scalars.ptr(),
        run.args.hooks.ptr(),
        nullptr);
    if (C10_UNLIKELY(outputs == nullptr)) {
      untag_user_error();
    }
    result = nb::steal(check_py(outputs));
    return std::nullopt;
  }
  // A failure of a fresh graph is a compile failure: the runtime warns and
  // returns None, and the backward runs eagerly. An exception raised by user
  // code (a hook, a Function's backward) propagates instead; see
  // [Note: Capture methods].
  result = call_first(run);
  const BackwardState& state = *run.state;
  const bool had_dynamic = !state.dynamic_dims.empty() ||
      std::find(state.dynamic_sizes.begin(), state.dynamic_sizes.end(), true) !=
          state.dynamic_sizes.end();
  if (result.is_none() && had_dynamic && run.entry_alive()) {
    // See [Note: Static when dynamic fails].
    run.entry->static_sizes = true;
    if (!capture(run)) {
      // The runtime has warned about this capture's failure, the one warning
      // this backward gets; as any failed capture, the entry is marked failed.
      variable_list eager_outputs = run.eager();
      if (run.entry_alive()) {
        run.entry->static_sizes = false;
        mark_failed(*run.entry, run.runtime);
      }
      return eager_outputs;
    }
    result = call_first(run);
    if (result.is_none() && run.entry_alive()) {
      // Static sizes did not help either: not a failure of dynamic sizes
      // (a user's error, or one of ours), so the entry is left as it was.
      run.entry->static_sizes = false;
    }
  }
  if (result.is_none()) {
    // Eager decides whose failure it was: an error it raises too is the
    // user's and leaves the entry as it is; see [Note: Whose failure].
    variable_list eager_outputs = run_eager(run.root, run.graph_task);
    report_fallback(
        run.runtime, "compiled graph", nb::cast<std::string>(nb::str(run.runtime.attr("last_failure"))));
    if (run.entry_alive()) {
      mark_failed(*run.entry, run.runtime);
      release_later(run.entry->compiled_fn);
    }
    return eager_outputs;
  }
  if (run.entry_alive()) {
    run.entry->first_run = false;
    // See [Note: Eager while compiling]; an optional method of the runtime.
    nb::object take = nb::getattr(run.runtime, "take_compiling", nb::none());
    if (!take.is_none()) {
      nb::object compiling = take();
      if (!compiling.is_none() && run.entry_alive()) {
        release_later(run.entry->compiling);
        run.entry->compiling = std::move(compiling);
      }
    }
  }
  return std::nullopt;
}

/*
[Note: Hooks changed while a graph runs]
The eager engine reads a node's hooks when it runs the node, so a hook that
registers a hook on a node that runs later, or removes one, changes what that
node calls. A graph calls the hooks the walk found (its `hooks` input), and a
hook that Dynamo traces has its registrations applied only after the graph.
Which hooks a hook will change cannot be known before it runs, so after every
graph run that called Python (a node with Python objects, whose hooks, ctx
or packed data fill the `hooks` input) the engine hook compares the walked
nodes' hook registries with what the walk saw
(NodeState::hook_signature; torch_private item 12: the number of hooks of each
kind, and per Python hook dict its size and largest RemovableHandle id). Only
nodes after the first one with Python objects (BackwardState::
first_python_node) are compared: no user code ran before that node's hooks, so
a change to it or to an earlier node came after eager would have read their
hooks (a hook that removes itself, the one-shot pattern, is such a change),
with one exception: a post hook registered on that first node by its own
hooks, which eager reads after them and calls, so a registration there
(torch_private::largest_post_hook_id grown past
BackwardState::first_python_node_post_hook_id; a removal never grows it) is
a change too. On a change that backward's grads
are the graph's, which differ from eager's where the changed node ran after
the change: the runtime warns once (report_hooks_changed), and the entry is
marked failed, so every later backward of that graph runs on the eager
engine, which reads the hooks as they are. That backward is not eager's;
making it so would need the graph to read each node's hooks when it reaches
the node, which a graph traced by Dynamo cannot (it applies a traced hook's
registrations after the graph). So no graph is run where such a change can be
foreseen: the runtime declines to capture an entry whose graph would call
code that names a hook registration or a handle's removal (ca_runtime's
[Note: Which captures wait]), and each of its backwards runs on the eager
engine, which reads each node's hooks when it reaches it. Its first
backward is deferred rather than declined, and compared the same way
(deferred_eager): a change there marks the entry failed at once, as one
made while the graph ran (the warning names the node); without one the
next backward declines it (the warning names the hook). What is left: a
change made by code the runtime's look at the hooks' code does not reach
(a method found through an attribute chain such as self.helper.swap() or
getattr, a function past the 64 it follows, a hook object replaced by
another with the same key after the capture), which is found after that
backward's graph ran. A graph without Python objects
runs no code that could register a hook: the walk computes no signature for
it and nothing is compared, so a hook-free cache hit pays nothing for this.
*/

/// The first walked node whose hooks differ from what the walk saw, or null;
/// see [Note: Hooks changed while a graph runs].
const NodeState* node_with_changed_hooks(const BackwardState& state) {
  if (state.first_python_node < 0) {
    return nullptr;
  }
  const NodeState& first = state.nodes[static_cast<size_t>(state.first_python_node)];
  if (torch_private::largest_post_hook_id(*first.call.node) > state.first_python_node_post_hook_id) {
    return &first;
  }
  for (size_t i = static_cast<size_t>(state.first_python_node) + 1; i < state.nodes.size(); ++i) {
    const NodeState& ns = state.nodes[i];
    if (torch_private::hook_registry_signature(*ns.call.node) != ns.hook_signature) {
      return &ns;
    }
  }
  return nullptr;
}

/// Reports a change of the hooks of node `name` during the backward that just
/// ran (its graph if `graph_ran`, else the eager engine), and sends the
/// graph's later backwards to the eager engine; see [Note: Hooks changed while
/// a graph runs].
void report_changed_hooks(BackwardRun& run, const std::string& name, bool graph_ran) {
  auto mark = [&run]() {
    if (run.entry_alive()) {
      mark_failed(*run.entry, run.runtime);  // reads the reason the report set
      release_later(run.entry->compiled_fn);
    }
  };
  nb::object report = nb::getattr(run.runtime, "report_hooks_changed", nb::none());
  if (!report.is_none()) {
    try {
      report(name, graph_ran);
    } catch (...) {
      mark();  // the warning may be an error (a warnings filter)
      throw;
    }
  }
  mark();
}

/// A deferred backward, run on the eager engine; when its graph would call
/// Python code before other nodes, their hooks are compared with the walk's
/// after it; see [Note: Hooks changed while a graph runs].
variable_list deferred_eager(BackwardRun& run) {
  run.args = GraphArgs();
  const BackwardState& state = *run.state;
  if (state.first_python_node < 0) {
    return run.eager_after_walk();
  }
  c10::intrusive_ptr<Node> first = state.nodes[static_cast<size_t>(state.first_python_node)].call.node;
  const uint64_t first_post_hook_id = state.first_python_node_post_hook_id;
  std::vector<std::pair<c10::intrusive_ptr<Node>, uint64_t>> walked;
  for (size_t i = static_cast<size_t>(state.first_python_node) + 1; i < state.nodes.size(); ++i) {
    walked.emplace_back(state.nodes[i].call.node, state.nodes[i].hook_signature);
  }
  variable_list outputs = run.eager_after_walk();
  if (torch_private::largest_post_hook_id(*first) > first_post_hook_id) {
    report_changed_hooks(run, first->name(), /*graph_ran=*/false);
    return outputs;
  }
  for (const auto& [node, signature] : walked) {
    if (torch_private::hook_registry_signature(*node) != signature) {
      report_changed_hooks(run, node->name(), /*graph_ran=*/false);
      break;
    }
  }
  return outputs;
}

/// Step 5: the engine's outputs from the graph's `result`; leaf grads
/// accumulated, saved variables released, final callbacks run.
variable_list finish(BackwardRun& run, nb::object result) {
  StepTimer timer(g_timings.finish_ns);
  // Empty the inputs list itself, not only our reference to it: Dynamo may
  // keep the list of the call that compiled (its graph's example inputs),
  // which would keep those saved tensors alive. Then drop our Python
  // references so that AccumulateGrad can steal fresh grads as eager does.
  if (PyList_SetSlice(run.args.tensors.ptr(), 0, PY_SSIZE_T_MAX, nullptr) != 0) {
    check_py(nullptr);
  }
  run.args = GraphArgs();
  BackwardState& state = *run.state;
  if (state.release_after_apply && run.entry_alive()) {
    // See [Note: Nodes that run for real keep their saved tensors].
    ShadowNode& entry = *run.entry;
    entry.ran_for_real.resize(entry.free_early.size());
    for (size_t i = 0; i < entry.free_early.size(); ++i) {
      const uint32_t idx = entry.free_early[i];
      entry.ran_for_real[i] = idx < state.nodes.size() && state.nodes[idx].ran_for_real;
    }
  }
  variable_list outputs;
  variable_list leaf_grads;
  {
    PyObject* seq = check_py(PySequence_Fast(result.ptr(), "compiled backward must return a sequence"));
    nb::object holder = nb::steal(seq);
    result = nb::object();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    TORCH_CHECK(
        static_cast<size_t>(n) >= state.num_outputs,
        "ca_core: compiled backward returned ",
        n,
        " values, expected at least ",
        state.num_outputs);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    outputs.reserve(state.num_outputs);
    for (Py_ssize_t i = 0; i < n; ++i) {
      at::Tensor t = unpack_tensor(items[i], "compiled backward output");
      if (static_cast<size_t>(i) < state.num_outputs) {
        outputs.emplace_back(std::move(t));
      } else {
        leaf_grads.emplace_back(std::move(t));
      }
    }
  }
  // Eager runs leaf nodes, their hooks and the final callbacks without the
  // GIL: a callback (DDP's finalize_backward) may wait for a thread that
  // needs it. See [Note: Final callbacks].
  nb::gil_scoped_release no_gil;
  accumulate_leaf_grads(state, run.leaf_outputs, run.leaf_hooks_only, leaf_grads);
  if (!state.keep_graph) {
    for (auto& ns : state.nodes) {
      if (ns.call.needed) {
        ns.call.node->release_variables();
      }
    }
  }
  run_final_callbacks(const_cast<GraphTask&>(run.graph_task));
  return outputs;
}

/*
[Note: The hook's grad mode]
The engine calls the hook on the thread that called backward(), right after
building the GraphTask there, whose thread_locals_ captured that thread's
state with one change: the grad mode set to create_graph. So the hook sets
only the grad mode (torch_private::task_grad_mode) for the walk, capture and
graph, where restoring the task's whole ThreadLocalState would set and reset
every thread-local torch keeps (RecordFunction callbacks, autocast, dispatch
modes, saved-tensor hooks: about 1 µs of a backward that eager spends 15 µs
on). A backward that only goes to the eager engine (a nested one, anomaly
mode, one served without a walk) sets nothing and leaves Dynamo's callback
alone, as eager does: the engine sets the task's state for each node itself.
The fingerprint reads the task's grad mode too, so that it is the same
before the walk and at the choice of eager; see [Note: Eager without the walk].
*/
variable_list compiled_backward_with_gil(
    const c10::intrusive_ptr<Node>& root,
    const GraphTask& graph_task,
    bool accumulate_grad,
    const torch::autograd::edge_list& output_edges) {
  if (t_hook_depth > 0 || g_runtime == nullptr) {
    // A backward started inside a compiled backward (hooks, checkpoint) runs
    // eagerly; the outer one keeps its state.
    return run_eager(root, graph_task);
  }
  if (torch::autograd::AnomalyMode::is_enabled()) {
    // See [Note: Anomaly mode].
    ++g_counters.eager_fallbacks;
    return run_eager(root, graph_task);
  }
  DepthGuard depth;
  if (g_timings.enabled.load(std::memory_order_relaxed)) {
    ++g_timings.timed_backwards;
  }
  // See [Note: The steps of a backward].
  BackwardRun run(root, graph_task, accumulate_grad, output_edges);
  if (g_eager_if_faster && remembers_eager_under(run.cache)) {
    // See [Note: Eager without the walk] and [Note: The hook's grad mode].
    if (auto done = eager_if_faster_without_walk(run)) {
      return std::move(*done);
    }
  }
  // See [Note: The hook's grad mode].
  c10::AutoGradMode grad_mode(torch_private::task_grad_mode(graph_task));
  // See [Note: Dynamo's callback during a compiled backward].
  DynamoCallbackOff no_dynamo_callback;
  if (auto done = walk(run)) {
    return std::move(*done);
  }
  if (auto done = lookup(run)) {
    return std::move(*done);
  }
  if (!run.compiled.is_valid()) {
    switch (capture_choice(run)) {
      case CaptureChoice::capture:
        break;
      case CaptureChoice::defer:
        // See [Note: Deferred captures]: not a fallback.
        return deferred_eager(run);
      case CaptureChoice::decline:
        // The runtime reported the fallback, and why, before answering.
        if (run.entry_alive()) {
          mark_failed(*run.entry, run.runtime);
        }
        return run.eager();
    }
  }
  ScopedSlot<BackwardState> active(active_backward(), run.state.get());
  InterfaceScope interface;
  if (!run.compiled.is_valid() && !capture(run)) {
    if (run.entry_alive()) {
      mark_failed(*run.entry, run.runtime);
    }
    return run.eager();
  }
  nb::object result;
  if (auto done = run_graph(run, result)) {
    return std::move(*done);
  }
  if (const NodeState* changed = node_with_changed_hooks(*run.state)) {
    // See [Note: Hooks changed while a graph runs].
    report_changed_hooks(run, changed->call.node->name(), /*graph_ran=*/true);
  }
  variable_list outputs = finish(run, std::move(result));
  if (C10_UNLIKELY(run.timed_since.has_value())) {
    // See [Note: Eager if faster].
    record_eager_if_faster(run, false, *run.timed_since);
  }
  return outputs;
}

/// The function installed in the engine. A Python exception (a user hook's)
/// leaves as torch's python_error, which backward()'s caller re-raises
/// unchanged; nanobind's own error type would reach the user as a
/// RuntimeError holding the traceback text.
variable_list compiled_backward(
    const c10::intrusive_ptr<Node>& root,
    const GraphTask& graph_task,
    bool accumulate_grad,
    const torch::autograd::edge_list& output_edges) {
  // A backward nested in a compiled one (a hook's) is inside the outer hook's time.
  StepTimer timer(g_timings.hook_ns, /*counts=*/t_hook_depth == 0);
  // The engine calls the hook without the GIL.
  nb::gil_scoped_acquire gil;
  try {
    return compiled_backward_with_gil(
        root, graph_task, accumulate_grad, output_edges);
  } catch (nb::python_error& e) {
    e.restore();
    check_py(nullptr);
    throw; // unreachable: check_py(nullptr) always throws
  }
}

} // namespace

void count_node_put_back() {
  g_counters.nodes_put_back.fetch_add(1, std::memory_order_relaxed);
}

void run_leaf_node(Node& fn, at::Tensor grad) {
  variable_list inputs;
  inputs.emplace_back(std::move(grad));
  for (const auto& hook : fn.pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  if (fn.post_hooks().empty()) {
    fn(std::move(inputs));
    return;
  }
  // The node may steal its input grad: the post hooks see the engine's copy.
  variable_list outputs = fn(variable_list(inputs));
  for (const auto& hook : fn.post_hooks()) {
    outputs = (*hook)(outputs, inputs);
  }
}

void run_leaf_post_hooks(Node& fn, at::Tensor grad) {
  variable_list inputs;
  inputs.emplace_back(std::move(grad));
  variable_list outputs;
  for (const auto& hook : fn.post_hooks()) {
    outputs = (*hook)(outputs, inputs);
  }
}

PyObject* installed_runtime() {
  return g_runtime;
}

void register_engine_hook(nb::module_& m) {
  nb::class_<Captured>(
      m,
      "CapturedGraph",
      "What a runtime's capture() returns: the compiled graph and what the engine hook needs to run "
      "it; see ca_runtime's [Note: Capture methods].")
      .def(
          "__init__",
          [](Captured* self,
             nb::object compiled,
             std::vector<uint32_t> leaf_outputs,
             std::vector<bool> leaf_hooks_only,
             std::vector<uint32_t> free_early,
             bool eager_if_faster_allowed) {
            new (self) Captured{
                std::move(compiled),
                std::move(leaf_outputs),
                std::move(leaf_hooks_only),
                std::move(free_early),
                eager_if_faster_allowed};
          },
          nb::kw_only(),
          nb::arg("compiled"),
          nb::arg("leaf_outputs"),
          nb::arg("leaf_hooks_only") = std::vector<bool>(),
          nb::arg("free_early") = std::vector<uint32_t>(),
          nb::arg("eager_if_faster_allowed") = false)
      .def_ro("compiled", &Captured::compiled, "The compiled callable (graph inputs -> outputs).")
      .def_ro(
          "leaf_outputs",
          &Captured::leaf_outputs,
          "The walk index of each AccumulateGrad node whose grad the graph returns.")
      .def_ro(
          "leaf_hooks_only",
          &Captured::hooks_only,
          "Per leaf output (or empty): the graph accumulated it already; only its grad_fn post hooks run.")
      .def_ro(
          "free_early",
          &Captured::free_early,
          "The nodes whose saved tensors may be dropped before a cache hit runs; see [Note: Saved "
          "tensors freed early].")
      .def_ro(
          "eager_if_faster_allowed",
          &Captured::eager_if_faster_allowed,
          "Whether its hits may run on the eager engine where that measures faster.");
  m.def(
      "install_engine_hook",
      [](nb::object runtime, const std::string& compiler_key) {
        for (const char* method : {"capture", "run_first", "report_fallback"}) {
          if (!nb::hasattr(runtime, method)) {
            throw nb::type_error(
                (std::string("install_engine_hook: runtime has no method '") +
                 method + "'")
                    .c_str());
          }
        }
        PyObject* prior = g_runtime;
        g_runtime = runtime.inc_ref().ptr();
        g_cache = &cache_root(compiler_key);
        // See [Note: Eager if faster]; optional, off without it.
        g_eager_if_faster = nb::cast<bool>(nb::getattr(runtime, "eager_if_faster", nb::bool_(false)));
        Py_XDECREF(prior);
        Engine::set_compiled_autograd(&compiled_backward);
      },
      nb::arg("runtime"),
      nb::arg("compiler_key") = "default",
      "Installs ca_core's engine hook, serving backwards with `runtime` from "
      "the cache of `compiler_key`; see [Note: Engine hook lifetime] and "
      "[Note: One cache per compiler].");
  m.def(
      "rearm_engine_hook",
      []() {
        if (g_runtime != nullptr) {
          Engine::set_compiled_autograd(&compiled_backward);
        }
      },
      "Puts ca_core's hook back into the engine if a runtime is installed "
      "(after code that cleared the engine's slot).");
  m.def(
      "uninstall_engine_hook",
      []() {
        Engine::set_compiled_autograd(nullptr);
        PyObject* prior = std::exchange(g_runtime, nullptr);
        Py_XDECREF(prior);
      },
      "Removes ca_core's engine hook: backwards run on the eager engine.");
  m.def(
      "running_graph_hook",
      [](size_t index) -> nb::object {
        PyObject* hooks = running_graph_hooks();
        if (hooks == nullptr) {
          throw nb::value_error("running_graph_hook: no compiled backward graph is running");
        }
        if (index >= static_cast<size_t>(PyList_GET_SIZE(hooks))) {
          throw nb::index_error(
              ("running_graph_hook: index " + std::to_string(index) + " is out of range for " +
               std::to_string(PyList_GET_SIZE(hooks)) + " hooks")
                  .c_str());
        }
        return nb::borrow(PyList_GET_ITEM(hooks, static_cast<Py_ssize_t>(index)));
      },
      nb::arg("index"),
      "Item `index` of the `hooks` input of the compiled backward graph "
      "running on this thread; see [Note: The running graph's hooks].");
  m.def(
      "installed_runtime",
      []() -> nb::object {
        return g_runtime ? nb::borrow(g_runtime) : nb::none();
      },
      "The runtime object while the hook is installed, else None.");
  m.def(
      "counters",
      []() {
        nb::dict d;
        for (const CounterField& counter : kCounterFields) {
          d[counter.name] = (g_counters.*counter.field).load();
        }
        return d;
      },
      "captures, cache_hits, eager_fallbacks, eager_while_compiling, "
      "eager_if_faster_runs (see [Note: Eager if faster]), "
      "eager_if_faster_without_walk (those of eager_if_faster_runs served without a walk, see "
      "[Note: Eager without the walk]) and "
      "nodes_put_back (see [Note: Freed saved tensors put back]) and "
      "deferred_captures (see [Note: Deferred captures]) since the "
      "last reset_counters().");
  m.def(
      "reset_counters",
      []() {
        for (const CounterField& counter : kCounterFields) {
          g_counters.*counter.field = 0;
        }
        g_timings.walk_ns = 0;
        g_timings.lookup_ns = 0;
        g_timings.run_ns = 0;
        g_timings.finish_ns = 0;
        g_timings.hook_ns = 0;
        g_timings.timed_backwards = 0;
        reset_keys_hashed();
      },
      "Sets every counter and timing to zero.");
  m.def(
      "set_timing",
      [](bool enabled) { g_timings.enabled = enabled; },
      nb::arg("enabled"),
      "Times the walk, lookup, run and finish steps and the whole hook of every backward (off by default); "
      "see [Note: The steps of a backward].");
  m.def(
      "timings",
      []() {
        nb::dict d;
        d["walk_ns"] = g_timings.walk_ns.load();
        d["lookup_ns"] = g_timings.lookup_ns.load();
        d["run_ns"] = g_timings.run_ns.load();
        d["finish_ns"] = g_timings.finish_ns.load();
        d["hook_ns"] = g_timings.hook_ns.load();
        d["timed_backwards"] = g_timings.timed_backwards.load();
        d["keys_hashed"] = keys_hashed();
        return d;
      },
      "walk_ns, lookup_ns, run_ns, finish_ns, hook_ns (the whole hook; see "
      "[Note: The steps of a backward]) (summed) and timed_backwards since the last "
      "reset_counters(), while set_timing(True); keys_hashed, whether timing or "
      "not: cache lookups that hashed a key (see [Note: The child taken last]).");
}

} // namespace ca
