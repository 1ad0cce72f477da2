// The graph's work: one sample read, decoded and written in place
// (SampleStage, sample_stage.hpp), and one run of one epoch (EpochRun,
// epoch_run.hpp) that schedules it batch by batch.
#include "epoch_run.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/sample_stage.hpp"

namespace pinfeed::loader {

namespace {

/// Passes a region of the decoded rows on (all of them when empty): the
/// crop, when the whole image is decoded (no ROI decoding).
class CropRows final : public RowSink {
 public:
  explicit CropRows(RowSink& next) : next_(&next) {}
  Region region;

  void begin(int width, int height) override {
    y_ = 0;
    box_ = clamp_region(region, width, height);
    next_->begin(box_.width, box_.height);
  }
  void row(const std::uint8_t* bgra) override {
    if (y_ >= box_.y && y_ < box_.y + box_.height) next_->row(bgra + static_cast<std::size_t>(box_.x) * 4);
    ++y_;
  }

 private:
  RowSink* next_;
  Region box_;
  int y_ = 0;
};

std::uint64_t since(std::chrono::steady_clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}
}  // namespace

CropPlan SampleStage::plan(std::size_t index, std::uint64_t epoch, SampleScratch& s) const {
  dataset_->read(index, s.bytes);
  SampleRng rng(seed_, epoch, index);
  try {
    return plan_crop(s.decoder.header(s.bytes, ""), config_, rng);
  } catch (const DataError& e) {
    throw DataError(dataset_->describe(index), e.reason());
  }
}

void SampleStage::operator()(std::size_t index, std::uint64_t epoch, std::span<std::byte> out, SampleScratch& s,
                             StageTimes& times) const {
  auto t0 = std::chrono::steady_clock::now();
  dataset_->read_stoppable(index, s.bytes, stop_);
  times.read_ns += since(t0);

  t0 = std::chrono::steady_clock::now();
  SampleRng rng(seed_, epoch, index);
  CropPlan plan;
  // Decode and transform run interleaved: each decoded row goes straight to
  // the writer, which resizes and writes a band of output rows at a time.
  // Without ROI decoding the whole image is decoded and the region is cut
  // out of the rows as they pass (measurement mode).
  CropRows crop(s.writer.sink());
  RowSink& sink = config_.roi_decode ? s.writer.sink() : crop;
  try {
    static const std::string kUnnamed;  // named below, only when something fails
    s.decoder.decode_planned(
        s.bytes,
        [&](const ImageHeader& h) {
          plan = plan_crop(h, config_, rng);
          s.writer.prepare(plan, out);
          if (!config_.roi_decode) {
            crop.region = plan.region;
            return JpegDecoder::Plan{Region{0, 0, h.width, h.height}, 1};
          }
          return JpegDecoder::Plan{plan.region, plan.scale};
        },
        sink, kUnnamed);
  } catch (const DataError& e) {
    throw DataError(dataset_->describe(index), e.reason());
  }
  if (!s.writer.complete())
    throw Error(fmt::format("{}: the decoder stopped before the sample was written", dataset_->describe(index)));
  const std::uint64_t total = since(t0), output = s.writer.take_output_ns();
  times.transform_ns += output;
  times.decode_ns += total - std::min(total, output);
}

}  // namespace pinfeed::loader

namespace pinfeed::loader::detail {

EpochRun::EpochRun(const Dataset& d, const LoaderConfig& c) : dataset(&d), stage(d, c.transform, c.seed), config(c) {
  stage.stop_reads_on(stop.get_token());
}

void EpochRun::fail(std::exception_ptr e) {
  {
    const std::scoped_lock lock(mutex);
    if (!error) error = std::move(e);
  }
  stopping = true;
  stop.request_stop();
  cv.notify_all();
  wake_turns();
}

bool EpochRun::return_token(std::size_t slot) {
  const std::scoped_lock lock(token_mutex);
  if (held_slots.erase(slot) == 0) return false;
  if (stopping.load()) return true;
  if (tokens_out > std::max<std::size_t>(1, pool->serving_slots())) {
    --tokens_out;
    ++parked;
    return true;
  }
  tokens->try_put(Token{});
  return true;
}

void EpochRun::refill_tokens() {
  const std::scoped_lock lock(token_mutex);
  while (parked > 0 && !stopping.load() && tokens_out < pool->serving_slots()) {
    --parked;
    ++tokens_out;
    tokens->try_put(Token{});
  }
}

void EpochRun::begin_stop() {
  {
    const std::scoped_lock lock(token_mutex);
    stopping = true;
  }
  stop.request_stop();
  wake_turns();
}

void EpochRun::wake_turns() {
  { const std::scoped_lock lock(turn_mutex); }  // a waiter between its check and its sleep sees `stopping`
  turn_cv.notify_all();
}

bool EpochRun::tokens_all_held() {
  const std::scoped_lock lock(token_mutex);
  return tokens_out > 0 && held_slots.size() >= tokens_out;
}

bool EpochRun::awaiting_slot(std::size_t seq) {
  const std::scoped_lock lock(turn_mutex);
  return next_acquire <= seq;
}

void EpochRun::wait_turn(std::size_t seq) {
  std::unique_lock lock(turn_mutex);
  turn_cv.wait(lock, [&] { return next_acquire >= seq || stopping.load(); });
}

void EpochRun::fill(Build& b, std::size_t i, SampleScratch& s, StageTimes& t) {
  const std::size_t sample_bytes = config.transform.sample_bytes();
  const std::size_t pos = b.job.position + i;
  const std::size_t index = order[pos];
  const std::span<std::byte> out = b.lease.bytes().subspan(i * sample_bytes, sample_bytes);
  try {
    stage(index, epoch, out, s, t);
    input_bytes += s.bytes.size();
    b.indices[i] = index;
    b.labels[i] = dataset->label(index);
    class_good[b.labels[i]].fetch_add(1, std::memory_order_relaxed);
    return;
  } catch (const DatasetChanged&) {
    throw;  // never replaced: every later sample of that file would be wrong too
  } catch (const DataError& e) {
    if (config.on_bad_sample == BadSamplePolicy::fail) throw;
    note_bad(index, e);
    // A deterministic substitute from this rank's own shard: the choice
    // depends on (seed, epoch, position) and on which files are bad only.
    SampleRng pick(config.seed ^ 0x7265706c61636521ULL, epoch, pos);
    for (unsigned attempt = 0; attempt < config.max_replacements; ++attempt) {
      const std::size_t sub = order[pick.below(order.size())];
      try {
        stage(sub, epoch, out, s, t);
      } catch (const DataError&) {
        continue;
      }
      input_bytes += s.bytes.size();
      b.indices[i] = sub;
      b.labels[i] = dataset->label(sub);
      class_good[b.labels[i]].fetch_add(1, std::memory_order_relaxed);
      ++b.replaced;
      const std::uint64_t n = ++replaced;
      check_budget(n, e);
      if (n <= 20 || n % 1000 == 0) {
        pinfeed::detail::log().warn("replaced bad sample {} ({}) with {} [{} replaced this epoch]", e.path().string(),
                                    e.reason(), dataset->describe(sub), n);
      }
      return;
    }
    throw DataError(e.path(), fmt::format("{}; and {} substitutes also failed", e.reason(), config.max_replacements));
  }
}

void EpochRun::note_bad(std::size_t index, const DataError& e) {
  const std::scoped_lock lock(bad_mutex);
  BadClass& bad = bad_classes[dataset->label(index)];
  if (bad.count++ == 0) {
    bad.path = e.path();
    bad.reason = e.reason();
  }
  bad.samples.insert(index);
}

std::string EpochRun::bad_classes_text() {
  const std::scoped_lock lock(bad_mutex);
  std::string text = fmt::format("{} class(es) affected:", bad_classes.size());
  std::size_t shown = 0;
  for (const auto& [label, bad] : bad_classes) {
    if (shown++ == 5) {
      text += " ...";
      break;
    }
    text += fmt::format(" class {} ({} bad, e.g. {}: {}){}", label, bad.count, bad.path.string(), bad.reason,
                        shown < std::min<std::size_t>(bad_classes.size(), 5) ? ";" : "");
  }
  return text;
}

std::uint64_t EpochRun::replacement_limit() const {
  if (config.max_replaced_share <= 0) return 0;
  return std::max<std::uint64_t>(
      1, static_cast<std::uint64_t>(config.max_replaced_share * static_cast<double>(order.size())));
}

void EpochRun::check_budget(std::uint64_t replaced_now, const DataError& last) {
  const std::uint64_t limit = replacement_limit();
  if (replaced_now <= limit) return;
  if (limit == 0) {
    throw DataError(last.path(),
                    fmt::format("{} (replacing bad samples is off: max_replaced_share is 0)", last.reason()));
  }
  throw DataError(last.path(), fmt::format("{} bad samples replaced this epoch, over the budget of {} ({:g}% of this "
                                           "rank's {} samples, max_replaced_share): this is a systematic problem, not "
                                           "a few corrupt files. {}. Last: {}",
                                           replaced_now, limit, config.max_replaced_share * 100, order.size(),
                                           bad_classes_text(), last.reason()));
}

void EpochRun::check_classes() {
  const std::scoped_lock lock(bad_mutex);
  for (const auto& [label, bad] : bad_classes) {
    const auto c = static_cast<std::size_t>(label);
    if (class_good[c].load(std::memory_order_relaxed) != 0 || bad.samples.size() < (*class_total)[c]) continue;
    throw DataError(bad.path,
                    fmt::format("class {}: none of its {} sample(s) could be decoded (e.g. this one: {}); "
                                "they were all replaced by other classes' samples (Note [Replacement budget])",
                                label, bad.samples.size(), bad.reason));
  }
}

BuildPtr EpochRun::assemble_batch(const BatchPlan& job) {
  auto b = std::make_shared<Build>();
  b->job = job;
  ++in_flight;
  struct Done {
    std::atomic<std::size_t>& n;
    ~Done() { --n; }
  } done{in_flight};
  if (stopping.load()) {
    b->skipped = true;
    return b;
  }
  try {
    // Never waits in practice: a token exists only for a free slot. It can
    // wait for a copy still reading a slot (a fence), for a slot the
    // consumer holds (next() lends it out), and a stop ends it. In batch
    // order (Note [Slots in batch order]).
    {
      const Turn turn{*this, job.seq};
      wait_turn(job.seq);
      if (stopping.load()) throw Cancelled("stopping");
      b->lease = pool->acquire(stop.get_token());
    }
    b->labels.resize(job.count);
    b->indices.resize(job.count);
    // Note [Isolated batches]: a thread waiting for this batch's chunks
    // runs only this batch's chunks, never another batch's task nested on
    // its stack. Nested, that batch could block in acquire() for a slot
    // only this batch's delivery frees: under critical pressure at the
    // floor, every batch stopped until the pressure lifted (CI, 28 s).
    oneapi::tbb::this_task_arena::isolate([&] {
      oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, job.count),
                                [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
                                  auto& slot = scratch->local();
                                  if (!slot) {
                                    slot = std::make_unique<SampleScratch>(config.transform, config.max_image_pixels);
                                  }
                                  StageTimes t;
                                  for (std::size_t i = r.begin(); i != r.end(); ++i) fill(*b, i, *slot, t);
                                  read_ns += t.read_ns;
                                  decode_ns += t.decode_ns;
                                  transform_ns += t.transform_ns;
                                });
    });
    samples += job.count;
    (b->lease.pinned() ? pinned_batches : pageable_batches) += 1;
  } catch (const Cancelled&) {
    b->skipped = true;
  } catch (...) {
    // Only here does an exception leave a sample: it ends the epoch with
    // that error; the batch is still sequenced so nothing waits for it.
    fail(std::current_exception());
    b->skipped = true;
  }
  return b;
}

void EpochRun::build_graph(std::size_t prefetch) {
  graph = std::make_unique<flow::graph>();
  source = std::make_unique<flow::input_node<BatchPlan>>(*graph, [this](oneapi::tbb::flow_control& fc) -> BatchPlan {
    if (stopping.load() || next_job >= num_batches) {
      fc.stop();
      return {};
    }
    const std::size_t bs = config.batch_size;
    BatchPlan j{next_job, start + next_job * bs, std::min(bs, order.size() - (start + next_job * bs))};
    ++next_job;
    return j;
  });
  tokens = std::make_unique<flow::buffer_node<Token>>(*graph);
  join = std::make_unique<flow::join_node<std::tuple<BatchPlan, Token>, flow::reserving>>(*graph);
  const auto assembling = std::clamp<std::size_t>(static_cast<std::size_t>(arena->max_concurrency()), 1, kAssembling);
  assemble = std::make_unique<flow::function_node<std::tuple<BatchPlan, Token>, BuildPtr>>(
      *graph, assembling, [this](const std::tuple<BatchPlan, Token>& in) { return assemble_batch(std::get<0>(in)); });
  sequencer = std::make_unique<flow::sequencer_node<BuildPtr>>(*graph, [](const BuildPtr& b) { return b->job.seq; });
  deliver = std::make_unique<flow::function_node<BuildPtr, flow::continue_msg>>(*graph, flow::serial,
                                                                                [this](const BuildPtr& b) {
                                                                                  {
                                                                                    const std::scoped_lock lock(mutex);
                                                                                    ready.push_back(b);
                                                                                  }
                                                                                  cv.notify_all();
                                                                                  return flow::continue_msg{};
                                                                                });
  flow::make_edge(*source, flow::input_port<0>(*join));
  flow::make_edge(*tokens, flow::input_port<1>(*join));
  flow::make_edge(*join, *assemble);
  flow::make_edge(*assemble, *sequencer);
  flow::make_edge(*sequencer, *deliver);
  {
    const std::scoped_lock lock(token_mutex);
    tokens_out = std::min(prefetch, std::max<std::size_t>(1, pool->serving_slots()));
    parked = prefetch - tokens_out;
    for (std::size_t k = 0; k < tokens_out; ++k) tokens->try_put(Token{});
  }
  source->activate();
}

}  // namespace pinfeed::loader::detail
