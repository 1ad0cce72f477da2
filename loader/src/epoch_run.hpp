#pragma once
// One run of one epoch: the flow graph (source -> token join -> assemble ->
// sequencer -> deliver), its tokens and slot turns, and the bad-sample
// budget. Private to the loader (loader.cpp runs it; epoch_run.cpp defines it).
#include "pinfeed/loader/loader.hpp"

#include <fmt/format.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/flow_graph.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <cmath>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <stop_token>

#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/options.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/sample_stage.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pinned_budget.hpp"
#include "pinfeed/memory/pool_plan.hpp"

namespace pinfeed::loader::detail {

namespace flow = oneapi::tbb::flow;

struct BatchPlan {
  std::size_t seq = 0;       // batch number in this run
  std::size_t position = 0;  // epoch position of its first sample
  std::size_t count = 0;     // samples in it
};
using Token = int;

struct Build {
  BatchPlan job;
  memory::SlotLease lease;
  std::vector<std::int64_t> labels;
  std::vector<std::size_t> indices;
  std::atomic<std::size_t> replaced{0};  // samples of this batch filled by substitutes (parallel_for bodies add)
  bool skipped = false;                  // stopped before it was assembled
};
using BuildPtr = std::shared_ptr<Build>;

// Everything one run of one epoch needs. Batches hold a shared_ptr to it so
// a token returned after the run stopped goes nowhere harmful.
struct EpochRun {
  // Shared, immutable for the run.
  const Dataset* dataset = nullptr;
  memory::BufferPool* pool = nullptr;
  oneapi::tbb::task_arena* arena = nullptr;
  oneapi::tbb::enumerable_thread_specific<std::unique_ptr<SampleScratch>>* scratch = nullptr;
  SampleStage stage;
  LoaderConfig config;
  std::uint64_t epoch = 0;
  std::vector<std::size_t> order;  // this rank's dataset indices for the epoch
  std::size_t start = 0;           // first epoch position of this run
  std::size_t num_batches = 0;

  // The graph. Built inside the arena so its tasks run there.
  std::unique_ptr<flow::graph> graph;
  std::unique_ptr<flow::input_node<BatchPlan>> source;
  std::unique_ptr<flow::buffer_node<Token>> tokens;
  std::unique_ptr<flow::join_node<std::tuple<BatchPlan, Token>, flow::reserving>> join;
  std::unique_ptr<flow::function_node<std::tuple<BatchPlan, Token>, BuildPtr>> assemble;
  std::unique_ptr<flow::sequencer_node<BuildPtr>> sequencer;
  std::unique_ptr<flow::function_node<BuildPtr, flow::continue_msg>> deliver;

  std::size_t next_job = 0;  // touched only by the serial source body
  std::atomic<bool> stopping{false};
  std::stop_source stop;

  std::mutex mutex;  // guards ready, delivered, error
  std::condition_variable cv;
  std::deque<BuildPtr> ready;
  std::size_t delivered = 0;
  std::exception_ptr error;

  // Statistics: atomics, summed by every worker.
  std::atomic<std::uint64_t> read_ns{0}, decode_ns{0}, transform_ns{0}, input_bytes{0};
  std::atomic<std::uint64_t> replaced{0}, samples{0}, pinned_batches{0}, pageable_batches{0};
  std::atomic<std::size_t> in_flight{0};
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  // Bad samples, for the replacement budget and the class check.
  std::atomic<std::uint32_t>* class_good = nullptr;       // per label: samples decoded (the Loader's, reset per run)
  const std::vector<std::size_t>* class_total = nullptr;  // per label: samples in the whole dataset
  struct BadClass {
    std::set<std::size_t> samples;  // distinct dataset indices that failed
    std::uint64_t count = 0;        // replacements (a padded sample can fail twice)
    std::filesystem::path path;     // the first one, and why
    std::string reason;
  };
  std::mutex bad_mutex;  // guards bad_classes
  std::map<std::int64_t, BadClass> bad_classes;

  // The stage's reads stop with the run (a streamed read waiting for a
  // stalled server would hold the stop for its timeout).
  EpochRun(const Dataset& d, const LoaderConfig& c);

  void fail(std::exception_ptr e);

  // A Batch returns its token from the user's thread. try_put from outside
  // the arena is allowed: the tasks it spawns go to the graph's arena and
  // count for wait_for_all. token_mutex orders it against stop() setting
  // `stopping`, so no put can start once a stop has begun.
  //
  // Note [Tokens follow the pool]: a token is a batch allowed in flight, so
  // there are never more out than the pool has slots to serve: under
  // critical pressure the pool gives slots back, and a token over the
  // serving count is parked when it comes back instead of starting a batch
  // whose task would block a TBB thread in acquire() (with 2 threads, two
  // such tasks stop every decode). Parked tokens go back out as the pool
  // grows (refill_tokens, on each next()).
  std::mutex token_mutex;  // guards tokens_out, held_slots, parked's changes and the puts
  std::size_t tokens_out = 0;
  // The slots of this run's delivered batches still alive, each with its
  // token (Note [Lent slots]): a slot lent out returns its token only when
  // it is in here (a batch of an earlier run has none of this run's).
  std::set<std::size_t> held_slots;
  std::atomic<std::size_t> parked{0};  // read without the lock by next()
  // Note [Lent slots]: since when next()'s wait has seen the wanted batch
  // stuck, and the pool starved, without a break. Kept here, not in one
  // wait: Python waits in 50 ms slices (to take signals), and a count that
  // restarted with each slice never reached the 0.5 s of starving.
  std::optional<std::chrono::steady_clock::time_point> stuck_since, starved_since;
  /// Slot `slot`'s batch gives its token back (dropped, or lent out). False:
  /// it holds none of this run's.
  bool return_token(std::size_t slot);
  void refill_tokens();

  void begin_stop();
  void wake_turns();

  /// Every token is with a batch the consumer holds: nothing can start
  /// until one is dropped or lent (Note [Lent slots]).
  [[nodiscard]] bool tokens_all_held();

  // Note [Slots in batch order]: batches take their slots in order, so the
  // batch the consumer waits for is never behind a later one that took the
  // last slot (under pressure, at the floor, that stalled the loop until the
  // pressure lifted). At most kAssembling batches are assembled at once
  // (each one's samples spread over every thread): the other slots stay
  // free, so critical pressure can give them back at once instead of
  // waiting for batches to finish.
  static constexpr std::size_t kAssembling = 2;
  std::mutex turn_mutex;  // guards next_acquire
  std::condition_variable turn_cv;
  std::size_t next_acquire = 0;  // the seq whose turn it is to take a slot
  struct Turn {
    EpochRun& run;
    std::size_t seq;
    ~Turn() {
      {
        const std::scoped_lock lock(run.turn_mutex);
        run.next_acquire = std::max(run.next_acquire, seq + 1);
      }
      run.turn_cv.notify_all();
    }
  };
  /// Batch `seq` has not taken its slot yet.
  [[nodiscard]] bool awaiting_slot(std::size_t seq);
  void wait_turn(std::size_t seq);

  // One sample into its place; bad samples follow the policy.
  void fill(Build& b, std::size_t i, SampleScratch& s, StageTimes& t);

  void note_bad(std::size_t index, const DataError& e);

  /// Which classes the bad samples came from, in words (the first few).
  std::string bad_classes_text();

  // Note [Replacement budget]: replacing a few corrupt files keeps every
  // rank's batches full; replacing many hides a systematic problem (a
  // format we cannot read, a broken mount) behind other classes' samples.
  // Past max_replaced_share of this rank's epoch (at least one replacement
  // unless the share is 0, so a small set may lose one file) the epoch
  // fails, with the counts. And when every sample of a class failed (all of
  // the dataset's, seen by this rank) the epoch fails as its last batch is
  // handed out: training on would silently drop the class.
  [[nodiscard]] std::uint64_t replacement_limit() const;

  void check_budget(std::uint64_t replaced_now, const DataError& last);

  /// When the run's last batch is handed out: a class all of whose samples
  /// (the dataset's, not only this rank's) failed here.
  void check_classes();

  BuildPtr assemble_batch(const BatchPlan& job);

  void build_graph(std::size_t prefetch);
};

}  // namespace pinfeed::loader::detail
