#include "pinfeed/loader/streamed.hpp"

#include <curl/curl.h>
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "curl_transfer.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"

// Note [Streamed shards]
// ~~~~~~~~~~~~~~~~~~~~~~
// A shard's index (its samples, labels, offsets) is all the loader needs
// before the epoch: pack writes it as NAME.tar.index.json, a few bytes per
// sample, so opening a remote set costs one small GET per shard and the
// epoch's order is known at once. Every sample is then one Range request for
// its header and data (512 + size bytes), made by one fetcher thread driving
// a libcurl multi handle (`streams` transfers at once, connections kept
// alive), in the order the loader announced with plan():
//
//   plan(order) -> fetcher: Range GETs along the order, while the bytes
//                  fetched and not yet read stay under the read-ahead bound
//   read(i)     -> the fetched bytes (the bound's room comes back), or, when
//                  sample i was not fetched yet, a request at the front of
//                  the queue ("demand": outside the bound, at most one per
//                  reading thread) and a wait
//
// Each answer is checked before it is used: a 206 whose Content-Range names
// the indexed bytes of a shard of the indexed size, and a header whose
// checksum and size are the indexed member's. A stale index or a shard
// rewritten on the server is DatasetChanged naming the URL, never other
// bytes under the indexed label; an ETag that changes mid-epoch too.
// Transport errors, 5xx, 408 and 429 are retried with backoff and jitter
// (a server killed and restarted mid-epoch costs a pause); a 4xx or the end
// of the retry budget is a RemoteError naming the URL and the status, which
// stops the epoch (never a silently short one).
//
// The read-ahead bound counts against the host's memory: by default the
// least of 256 MiB and 1/16 of what is really available (cgroup-aware).
// Under elevated pressure it is a quarter, under critical 4 MiB, and
// fetched samples past the new bound are given back at once (they are
// fetched again when the loader comes to them).
//
// With cache_dir, stager threads (RemoteConfig::parallel, 8), started by
// the first read, stage whole shards into the cache (remote.hpp's staging:
// atomic files, locks shared by the node's ranks, LRU eviction) while the
// epoch streams; a shard's reads move to its local copy once it is there,
// so the next epoch reads from disk.
//
// Stopping: an epoch's reads come through read_stoppable with the run's stop
// token, and one waiting for bytes throws Cancelled within 100 ms of the
// stop: a loader dropped while a server stalls goes at once instead of
// waiting out remote_timeout and retries.

namespace pinfeed::loader {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint64_t kHeader = 512;
/// A sidecar's size limit: ~900k samples of one shard (Note [Bounded sidecars]).
constexpr std::uint64_t kMaxIndexBytes = 64ULL << 20U;
constexpr std::uint64_t kMaxIndexEntries = 1'000'000;

}  // namespace

std::string shard_index_url(const std::string& shard) { return shard + ".index.json"; }

std::string shard_index_json(const fs::path& tar, std::size_t max_classes) {
  const auto samples = TarShards::index(tar, max_classes);
  nlohmann::json list = nlohmann::json::array();
  for (const auto& s : samples) list.push_back({s.key, s.offset, s.size, s.label, s.header_sum});
  nlohmann::ordered_json j{{"format", "pinfeed-shard-index"},
                           {"version", 1},
                           {"shard", tar.filename().string()},
                           {"size", fs::file_size(tar)},
                           {"samples", std::move(list)}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

fs::path write_shard_index(const fs::path& tar, std::size_t max_classes) {
  const std::string text = shard_index_json(tar, max_classes);
  const fs::path out = tar.string() + ".index.json", tmp = out.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc | std::ios::binary);
    f << text;
    if (!f.flush()) throw DataError(tmp, "cannot write the shard's index");
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  if (ec) throw DataError(out, fmt::format("cannot write the shard's index: {}", ec.message()));
  return out;
}

namespace {

/// Note [Bounded sidecars]: a sidecar is read by a SAX handler that keeps
/// only well-formed entries ([key, offset, size, label, header_sum], whole
/// numbers) and stops at the first thing that is not one, so its memory is
/// its text and its entries, never a document tree (64 MiB of "[]," was
/// 1.75 GiB as one). The entries are then held to what a tar can be: each
/// member's data on a 512-byte block after its header, inside the shard,
/// under the sample limit, no two overlapping, no key twice; and a reader
/// checks the header's name, size and checksum before using the bytes.
class IndexReader : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit IndexReader(ShardIndex& out) : out_(out) {}

  bool null() override { return scalar("null"); }
  bool boolean(bool) override { return scalar("a boolean"); }
  bool number_integer(number_integer_t v) override {
    if (v < 0) return entry_value(Value{v, true}, "a negative number");
    return entry_value(Value{v, true}, nullptr);
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (in_entry() || top_key_ == "size" || top_key_ == "version") {
      if (v > static_cast<number_unsigned_t>(std::numeric_limits<std::int64_t>::max())) return fail("a number too large");
    }
    return entry_value(Value{static_cast<std::int64_t>(v), true}, nullptr);
  }
  bool number_float(number_float_t, const string_t&) override {
    return in_entry() || top_key_ == "size" ? fail("a fractional number where a whole one belongs")
                                            : scalar("a fractional number");
  }
  bool string(string_t& v) override {
    if (in_entry()) {
      if (field_ != 0) return fail("a string where a number belongs");
      entry_.key = std::move(v);
      ++field_;
      return true;
    }
    if (depth_ == 1 && top_key_ == "format") format_ = v;
    return depth_ == 1 || skipping() ? true : fail("a string where an entry belongs");
  }
  bool binary(binary_t&) override { return fail("binary data"); }
  bool start_object(std::size_t) override {
    ++depth_;
    if (depth_ == 1 || skipping()) return true;
    return fail("an object where an entry belongs");
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) top_key_ = k;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    if (depth_ == 2 && top_key_ == "samples") {
      samples_seen_ = true;
      return true;
    }
    if (depth_ == 3 && top_key_ == "samples") {
      entry_ = {};
      field_ = 0;
      return true;
    }
    return skipping() ? true : fail("an array where an entry's field belongs");
  }
  bool end_array() override {
    if (depth_ == 3 && top_key_ == "samples") {
      if (field_ != 5) return fail(fmt::format("an entry with {} fields, not [key, offset, size, label, header_sum]", field_));
      // A member takes a header and a block at least: no more entries than
      // the shard has room for (its "size" comes first in what pack writes).
      const std::uint64_t cap = size_seen_ ? out_.size / 1024 + 1 : kMaxIndexEntries;
      if (out_.samples.size() >= std::min<std::uint64_t>(cap, kMaxIndexEntries)) {
        return fail(fmt::format("more entries than a {}-byte shard can hold", size_seen_ ? out_.size : 0));
      }
      out_.samples.push_back(std::move(entry_));
    }
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    if (error_.empty()) error_ = fmt::format("{} (at byte {})", e.what(), position);
    return false;
  }

  [[nodiscard]] const std::string& error() const { return error_; }
  [[nodiscard]] const std::string& format() const { return format_; }
  [[nodiscard]] std::int64_t version() const { return version_; }
  [[nodiscard]] bool has_size() const { return size_seen_; }
  [[nodiscard]] bool has_samples() const { return samples_seen_; }

 private:
  struct Value {
    std::int64_t v;
    bool whole;
  };
  [[nodiscard]] bool in_entry() const { return depth_ == 3 && top_key_ == "samples"; }
  [[nodiscard]] bool skipping() const { return depth_ >= 2 && top_key_ != "samples"; }  // another key's value
  bool fail(const std::string& what) {
    if (error_.empty()) {
      error_ = fmt::format("{} (entry {} of \"samples\")", what, out_.samples.size());
      if (!in_entry() && depth_ <= 2) error_ = what;
    }
    return false;
  }
  bool scalar(const char* what) {
    if (in_entry()) return fail(fmt::format("{} in an entry", what));
    return true;
  }
  bool entry_value(Value x, const char* problem) {
    if (depth_ == 1) {
      if (top_key_ == "size") {
        if (problem != nullptr) return fail(fmt::format("\"size\" is {}", problem));
        out_.size = static_cast<std::uint64_t>(x.v);
        size_seen_ = true;
      } else if (top_key_ == "version") {
        version_ = x.v;
      }
      return true;
    }
    if (!in_entry()) return skipping() ? true : fail("a number where an entry belongs");
    if (field_ == 0 || field_ >= 5) return fail("a number where the key belongs, or a sixth field");
    if (problem != nullptr && field_ != 3) return fail(fmt::format("{} for an offset, size or checksum", problem));
    switch (field_) {
      case 1: entry_.offset = static_cast<std::uint64_t>(x.v); break;
      case 2: entry_.size = static_cast<std::uint64_t>(x.v); break;
      case 3: entry_.label = x.v; break;
      default: entry_.header_sum = static_cast<std::uint64_t>(x.v); break;
    }
    ++field_;
    return true;
  }

  ShardIndex& out_;
  int depth_ = 0;
  std::string top_key_, format_, error_;
  std::int64_t version_ = 0;
  bool size_seen_ = false, samples_seen_ = false;
  TarShards::IndexedSample entry_;
  unsigned field_ = 0;
};

}  // namespace

ShardIndex parse_shard_index(const std::string& text, const std::string& source, std::size_t max_classes) {
  ShardIndex out;
  IndexReader reader(out);
  const bool ok = nlohmann::json::sax_parse(text, &reader, nlohmann::json::input_format_t::json, true, true);
  if (!ok || !reader.error().empty()) {
    throw DataError(source, fmt::format("not a readable shard index: {}", reader.error().empty() ? "malformed" : reader.error()));
  }
  if (reader.format() != "pinfeed-shard-index" || reader.version() != 1) {
    throw DataError(source, "not a pinfeed shard index (format pinfeed-shard-index, version 1)");
  }
  if (!reader.has_size() || !reader.has_samples()) {
    throw DataError(source, "not a readable shard index: no \"size\" or no \"samples\"");
  }
  std::vector<std::pair<std::uint64_t, std::size_t>> by_offset;
  std::unordered_set<std::string_view> keys;
  by_offset.reserve(out.samples.size());
  for (std::size_t k = 0; k < out.samples.size(); ++k) {
    const TarShards::IndexedSample& s = out.samples[k];
    if (s.offset < kHeader || s.offset > out.size || s.size > out.size - s.offset) {
      throw DataError(source, fmt::format("sample '{}' at byte {} ({} bytes) is outside the {}-byte shard", s.key,
                                          s.offset, s.size, out.size));
    }
    if (s.offset % kHeader != 0) {
      throw DataError(source, fmt::format("sample '{}' at byte {}: a tar member's data starts on a 512-byte block",
                                          s.key, s.offset));
    }
    if (s.size > kMaxSampleBytes) {
      throw DataError(source, fmt::format("sample '{}' is {} bytes, over the {}-byte limit for one sample", s.key,
                                          s.size, kMaxSampleBytes));
    }
    if (s.label < 0 || static_cast<std::uint64_t>(s.label) >= max_classes) {
      throw DataError(source, fmt::format("sample '{}': label {} is not in 0..{} (max_classes)", s.key, s.label,
                                          max_classes - 1));
    }
    if (!keys.insert(s.key).second) throw DataError(source, fmt::format("sample '{}' is listed twice", s.key));
    by_offset.emplace_back(s.offset, k);
  }
  std::sort(by_offset.begin(), by_offset.end());
  for (std::size_t k = 1; k < by_offset.size(); ++k) {
    const TarShards::IndexedSample& prev = out.samples[by_offset[k - 1].second];
    const TarShards::IndexedSample& next = out.samples[by_offset[k].second];
    if (next.offset == prev.offset && next.size == prev.size && next.header_sum == prev.header_sum) {
      continue;  // a hard link: its entry is its target's bytes, as tar extracts it
    }
    // The next member's header comes after this member's data, rounded up to a block.
    if (next.offset < prev.offset + (prev.size + kHeader - 1) / kHeader * kHeader + kHeader) {
      throw DataError(source, fmt::format("samples '{}' (byte {}) and '{}' (byte {}) overlap: not one tar's members",
                                          prev.key, prev.offset, next.key, next.offset));
    }
  }
  return out;
}

// ---------------------------------------------------------------- the reader

struct StreamedShards::Impl {
  struct Shard {
    std::string url;    ///< as given: what requests use
    std::string shown;  ///< in messages (redacted), or the local path
    std::string name;   ///< the file name (fingerprints, relative names)
    std::uint64_t bytes = 0;
    bool remote = false;
    std::shared_ptr<const UniqueFd> fd;  ///< a local copy (guarded by mutex)
    std::string etag;                    ///< the first answer's (guarded by mutex)
    /// A shard that failed for good (a 4xx, the retry budget spent, changed
    /// on the server): its other samples fail at once instead of each
    /// spending the budget again (guarded by mutex).
    std::exception_ptr failed;
  };
  struct Sample : TarShards::IndexedSample {
    std::uint32_t shard = 0;
    bool linked = false;  ///< a hard link's entry: the header at its offset names its target
  };
  struct Job {
    std::size_t index = 0;
    std::uint64_t gen = 0;
    std::size_t pos = 0;      ///< place in the plan (demand: none)
    bool counted = false;     ///< inside the read-ahead bound
    unsigned attempt = 0;
    Clock::time_point at{};
  };
  struct Ready {
    std::string body;
    std::size_t pos = 0;
    bool counted = false;
  };
  struct Active {
    Job job;
    detail::Easy handle;
    detail::HeaderList headers;
    detail::Transfer t;
    std::string body;
  };

  RemoteConfig config;
  std::shared_ptr<std::atomic<bool>> cancel = std::make_shared<std::atomic<bool>>(false);
  std::vector<Shard> shards;
  std::vector<Sample> samples;
  std::size_t num_classes = 0;
  std::size_t remote_shards = 0;

  mutable std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::size_t> order;
  /// occurrence[p]: how many times order[p]'s sample comes in order[0..p]
  /// (DistributedSampler's padding repeats a few); taken[i]: reads of i in
  /// this plan. A place whose sample was read that often is not fetched
  /// again (a read that ran ahead of the cursor took it on demand).
  std::vector<std::uint32_t> occurrence;
  std::unordered_map<std::size_t, std::uint32_t> taken;
  std::size_t cursor = 0;
  std::uint64_t gen = 0;
  std::unordered_map<std::size_t, Ready> ready;
  std::unordered_set<std::size_t> queued;  ///< in flight, waiting to retry, or asked for
  std::deque<Job> demand;
  std::vector<Job> retry;
  std::unordered_map<std::size_t, std::exception_ptr> failed;
  std::unordered_map<std::size_t, unsigned> waiting;  ///< reads blocked on a sample, by index
  std::uint64_t ahead = 0, base_limit = 0, limit = 0;
  StreamStats stats;
  bool closing = false;
  bool served = false;     // a read has had its bytes: the stagers may start
  std::vector<std::shared_ptr<const void>> keep;  ///< the cache's locks

  CURLM* multi = nullptr;
  std::thread fetcher;
  std::vector<std::thread> stagers;       ///< with cache_dir: `parallel` of them
  std::atomic<std::size_t> stage_next{0};  ///< the next shard a stager takes
  std::shared_ptr<memory::PressureMonitor> monitor;
  std::uint64_t subscription = 0;

  [[nodiscard]] std::uint64_t need(std::size_t i) const { return kHeader + samples[i].size; }
  void wake() const {
    if (multi != nullptr) curl_multi_wakeup(multi);
  }

  /// The shards' indexed samples, in order, with what a reader checks.
  void add_samples(std::vector<ShardIndex>& indexes) {
    std::int64_t max_label = -1;
    for (std::size_t s = 0; s < indexes.size(); ++s) {
      for (TarShards::IndexedSample& x : indexes[s].samples) {
        max_label = std::max(max_label, x.label);
        Sample sample;
        static_cast<TarShards::IndexedSample&>(sample) = std::move(x);
        sample.shard = static_cast<std::uint32_t>(s);
        samples.push_back(std::move(sample));
      }
    }
    if (samples.empty()) throw DataError(shards.front().shown, "dataset is empty: no key.jpg + key.cls pairs in the shards");
    std::map<std::pair<std::uint32_t, std::uint64_t>, unsigned> at;  // a hard link shares its target's offset
    for (const Sample& x : samples) ++at[{x.shard, x.offset}];
    for (Sample& x : samples) x.linked = at[{x.shard, x.offset}] > 1;
    num_classes = static_cast<std::size_t>(max_label + 1);
  }

  /// Copies cache_dir already holds are read from the first sample on (each
  /// confirmed by the server first, as staging does); the rest stream while
  /// the stagers fetch them.
  void use_cached_copies(const std::vector<std::size_t>& remote) {
    std::vector<std::string> cached;
    std::vector<std::size_t> cached_at;
    for (const std::size_t s : remote) {
      const fs::path p = cache_path(shards[s].url, config);
      std::error_code ec;
      if (!p.empty() && fs::exists(p.string() + ".meta", ec)) {
        cached.push_back(shards[s].url);
        cached_at.push_back(s);
      }
    }
    if (cached.empty()) return;
    StagedShards staged = stage_shards(cached, config);
    for (std::size_t k = 0; k < cached.size(); ++k) {
      Shard& sh = shards[cached_at[k]];
      RegularFile file(staged.local[k], "a tar shard");
      if (file.size() != sh.bytes) continue;  // another version than the index's: streamed
      sh.fd = std::make_shared<const UniqueFd>(file.take());
      ++stats.shards_local;
    }
    keep.push_back(staged.keep);
  }

  /// With cache_dir: up to `parallel` stagers, one per shard not cached.
  void start_stagers() {
    const auto uncached = static_cast<std::size_t>(
        std::count_if(shards.begin(), shards.end(), [](const Shard& sh) { return sh.remote && !sh.fd; }));
    const std::size_t n = std::min<std::size_t>(std::max(1U, config.parallel), uncached);
    for (std::size_t k = 0; k < n; ++k) {
      try {
        stagers.emplace_back([this] { stage(); });
      } catch (const std::system_error& e) {  // out of threads (RLIMIT_NPROC): fewer stagers, or none
        pinfeed::detail::log().warn("remote: {} of {} threads to fill cache_dir started: {}", k, n, e.what());
        break;
      }
    }
  }

  /// The next transfer to start, under the lock: a retry that is due, then
  /// a read waiting for its sample, then the plan while the bound has room.
  std::optional<Job> next_job(Clock::time_point now) {
    for (auto it = retry.begin(); it != retry.end(); ++it) {
      if (it->at > now && !shards[samples[it->index].shard].failed) continue;
      Job j = *it;
      retry.erase(it);
      return j;
    }
    if (!demand.empty()) {
      Job j = demand.front();
      demand.pop_front();
      return j;
    }
    while (cursor < order.size()) {
      const std::size_t i = order[cursor];
      const Shard& sh = shards[samples[i].shard];
      const auto t = taken.find(i);
      if (sh.fd || sh.failed || ready.contains(i) || queued.contains(i) || failed.contains(i) ||
          (t != taken.end() && t->second >= occurrence[cursor])) {
        ++cursor;
        continue;
      }
      // A sample larger than the bound still goes when nothing else is ahead.
      if (ahead + need(i) > limit && ahead > 0) return std::nullopt;
      queued.insert(i);
      ahead += need(i);
      stats.readahead_peak = std::max(stats.readahead_peak, ahead);
      return Job{i, gen, cursor++, true, 0, now};
    }
    return std::nullopt;
  }

  /// A transfer for `job`, set up (not yet added to the multi handle).
  std::unique_ptr<Active> make_transfer(const Job& job) {
    auto a = std::make_unique<Active>();
    a->job = job;
    const Sample& s = samples[job.index];
    const Shard& sh = shards[s.shard];
    a->handle = detail::make_handle(sh.url, config, a->headers);
    CURL* h = a->handle.get();
    a->t.handle = h;
    a->t.text = &a->body;
    a->t.text_limit = need(job.index);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, detail::on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &a->t);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, detail::on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &a->t);
    detail::watch_progress(h, a->t, config);  // a trickle is a stall; closing ends it
    const std::string range = fmt::format("{}-{}", s.offset - kHeader, s.offset + s.size - 1);
    curl_easy_setopt(h, CURLOPT_RANGE, range.c_str());  // copied by libcurl
    return a;
  }

  /// Why a finished 2xx transfer's bytes are not sample i's ("" when they are).
  /// `changed` is set when the shard on the server is not the indexed one.
  std::string check_answer(const Active& a, long code, bool& changed) const {
    const Sample& s = samples[a.job.index];
    const Shard& sh = shards[s.shard];
    if (code == 200) {
      return "the server answered a Range request with the whole object: streaming needs Range support (nginx, "
             "S3 and most servers have it); without the .index.json sidecars the shards are staged whole instead";
    }
    std::uint64_t first = 0, last = 0, total = 0;
    if (std::sscanf(a.t.content_range.c_str(), "bytes %lu-%lu/%lu", &first, &last, &total) != 3) {
      return fmt::format("a 206 answer without a usable Content-Range ('{}')", a.t.content_range);
    }
    if (total != sh.bytes) {
      changed = true;
      return fmt::format("is {} bytes on the server, its index says {}: the shard changed after its index was "
                         "written (pinfeed-data index makes a new one)",
                         total, sh.bytes);
    }
    if (first != s.offset - kHeader || last != s.offset + s.size - 1) {
      return fmt::format("the server sent bytes {}-{} for a request of {}-{}", first, last, s.offset - kHeader,
                         s.offset + s.size - 1);
    }
    if (a.body.size() != need(a.job.index)) {
      return fmt::format("{} bytes arrived of the {} asked for", a.body.size(), need(a.job.index));
    }
    if (!(s.linked ? TarShards::header_matches(a.body.data(), s.size, s.header_sum)
                   : TarShards::header_matches(a.body.data(), s.size, s.header_sum, s.key))) {
      changed = true;
      return fmt::format("member {} at byte {} is not the indexed one: the shard changed after its index was written "
                         "(pinfeed-data index makes a new one)",
                         s.key, s.offset - kHeader);
    }
    return {};
  }

  /// A transfer ended (fetcher thread).
  void finish(Active& a, CURLcode rc) {
    const long code = detail::response_code(a.handle.get());
    const std::size_t i = a.job.index;
    Shard& sh = shards[samples[i].shard];
    std::exception_ptr fatal;
    std::string retry_why;
    if (rc == CURLE_OK && code >= 200 && code < 300) {
      bool changed = false;
      const std::string problem = check_answer(a, code, changed);
      if (problem.empty()) {
        const std::scoped_lock lock(mutex);
        if (!a.t.etag.empty() && !sh.etag.empty() && a.t.etag != sh.etag) {
          fatal = std::make_exception_ptr(DatasetChanged(
              sh.shown, fmt::format("changed on the server while it was read (ETag {}, now {}): restart to read the "
                                    "new shard and its index",
                                    sh.etag, a.t.etag)));
        } else {
          if (sh.etag.empty()) sh.etag = a.t.etag;
          ++stats.requests;
          stats.bytes += a.body.size();
          queued.erase(i);
          if (a.job.counted) ahead -= need(i);
          if (sh.fd) {
            // Cached meanwhile: its readers read the file.
          } else if (a.job.gen == gen) {
            ready[i] = Ready{std::move(a.body), a.job.pos, a.job.counted};
            if (a.job.counted) ahead += need(i);
          } else if (waiting.contains(i)) {
            ready[i] = Ready{std::move(a.body), 0, false};  // an earlier plan's, but a read waits for it
          }
          cv.notify_all();
          return;
        }
      } else if (changed) {
        fatal = std::make_exception_ptr(DatasetChanged(sh.shown, problem));
      } else if (code == 200) {
        fatal = std::make_exception_ptr(RemoteError(sh.url, code, problem));
      } else {
        retry_why = problem;
      }
    } else if (rc == CURLE_OK && detail::final_status(code)) {
      fatal = std::make_exception_ptr(RemoteError(sh.url, code, detail::status_text(code, a.t.error_body)));
    } else if (rc == CURLE_WRITE_ERROR && code == 200) {
      bool changed = false;
      fatal = std::make_exception_ptr(RemoteError(sh.url, code, check_answer(a, code, changed)));
    } else if (const std::string why = detail::permanent_error(rc, a.t); !why.empty()) {
      fatal = std::make_exception_ptr(RemoteError(sh.url, 0, why));
    } else {
      retry_why = !a.t.stalled.empty() ? a.t.stalled
                  : rc != CURLE_OK     ? curl_easy_strerror(rc)
                                       : detail::status_text(code, a.t.error_body);
    }
    const std::scoped_lock lock(mutex);
    if (!fatal && a.job.attempt < config.retries) {
      Job again = a.job;
      ++again.attempt;
      again.at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(detail::backoff_seconds(config, a.job.attempt)));
      retry.push_back(again);  // still queued, still counted
      ++stats.retries;
      if (a.job.attempt == 0 || again.attempt == config.retries) {
        pinfeed::detail::log().warn("remote: {} ({}): {}; try {} of {} in a moment", sh.shown, samples[i].key,
                                    retry_why, again.attempt + 1, config.retries + 1);
      }
      return;
    }
    queued.erase(i);
    if (a.job.counted) ahead -= need(i);
    if (a.job.gen != gen && !waiting.contains(i)) return;  // an earlier plan's: nobody reads it now
    if (!fatal) {
      fatal = std::make_exception_ptr(
          RemoteError(sh.url, rc == CURLE_OK ? code : 0,
                      fmt::format("{} (sample {}; gave up after {} tries)", retry_why, samples[i].key, a.job.attempt + 1)));
    }
    failed[i] = fatal;
    if (!sh.failed) sh.failed = fatal;
    cv.notify_all();
  }

  /// Drops the jobs of an earlier plan nobody waits for (under the lock).
  bool stale(const Job& j) {
    if (j.gen == gen || waiting.contains(j.index)) return false;
    queued.erase(j.index);
    if (j.counted) ahead -= need(j.index);
    return true;
  }

  /// A job that cannot start or finish: its sample fails (under the lock).
  void fail_job(const Job& job, std::exception_ptr e) {
    queued.erase(job.index);
    if (job.counted) ahead -= need(job.index);
    failed[job.index] = std::move(e);
    cv.notify_all();
  }

  void run() {
    std::map<CURL*, std::unique_ptr<Active>> active;
    for (;;) {
      std::vector<Job> jobs;
      {
        std::unique_lock lock(mutex);
        if (closing) break;
        const auto now = Clock::now();
        while (active.size() + jobs.size() < std::max(1U, config.streams)) {
          std::optional<Job> job = next_job(now);
          if (!job) break;
          if (stale(*job)) continue;
          if (const std::exception_ptr gone = shards[samples[job->index].shard].failed) {
            fail_job(*job, gone);  // its shard failed for good meanwhile
            continue;
          }
          jobs.push_back(*job);
        }
      }
      // Handles are made outside the lock: S3's reads the credentials.
      for (const Job& job : jobs) {
        try {
          auto a = make_transfer(job);
          CURL* h = a->handle.get();
          if (const CURLMcode rc = curl_multi_add_handle(multi, h); rc != CURLM_OK) {
            throw RemoteError(shards[samples[job.index].shard].url, 0,
                              fmt::format("libcurl could not start a transfer: {}", curl_multi_strerror(rc)));
          }
          active.emplace(h, std::move(a));
        } catch (...) {
          const std::scoped_lock lock(mutex);
          fail_job(job, std::current_exception());
        }
      }
      int running = 0;
      curl_multi_perform(multi, &running);
      int left = 0;
      while (CURLMsg* m = curl_multi_info_read(multi, &left)) {
        if (m->msg != CURLMSG_DONE) continue;
        CURL* const done = m->easy_handle;  // m is not valid past curl_multi_remove_handle
        const CURLcode result = m->data.result;
        const auto it = active.find(done);
        if (it == active.end()) continue;
        std::unique_ptr<Active> a = std::move(it->second);
        active.erase(it);
        curl_multi_remove_handle(multi, done);
        finish(*a, result);
      }
      int wait_ms = 100;
      {
        const std::scoped_lock lock(mutex);
        const auto now = Clock::now();
        for (const Job& j : retry) {
          wait_ms = std::min<int>(wait_ms, static_cast<int>(std::max<std::int64_t>(
                                               0, std::chrono::duration_cast<std::chrono::milliseconds>(j.at - now).count())));
        }
      }
      curl_multi_poll(multi, nullptr, 0, wait_ms, nullptr);
    }
    for (auto& [h, a] : active) curl_multi_remove_handle(multi, h);
  }

  /// With cache_dir: whole shards into the cache while the epoch streams,
  /// `parallel` at once (one at a time left a 20-shard set 3 shards short of
  /// cached when epoch 2 began, over a 20 ms round trip).
  void stage() {
    {
      // Not before the first sample is read: eight whole shards at once
      // would delay the first batch (0.38 -> 0.6-0.9 s at 20 ms RTT).
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return served || closing; });
    }
    for (std::size_t s = stage_next++; s < shards.size(); s = stage_next++) {
      {
        const std::scoped_lock lock(mutex);
        if (closing) return;
        if (!shards[s].remote || shards[s].fd) continue;
      }
      try {
        StagedShards staged = stage_shards({shards[s].url}, config, {shards[s].bytes});
        RegularFile file(staged.local.front(), "a tar shard");
        if (file.size() != shards[s].bytes) {
          pinfeed::detail::log().warn("remote: {}: the cached copy is {} bytes, its index says {}: read remotely",
                                      shards[s].shown, file.size(), shards[s].bytes);
          continue;
        }
        auto fd = std::make_shared<const UniqueFd>(file.take());
        const std::scoped_lock lock(mutex);
        shards[s].fd = std::move(fd);
        keep.push_back(staged.keep);
        ++stats.shards_local;
        for (auto it = ready.begin(); it != ready.end();) {  // its fetched samples: read from the file now
          if (samples[it->first].shard != s || waiting.contains(it->first)) {
            ++it;
            continue;
          }
          if (it->second.counted) ahead -= need(it->first);
          it = ready.erase(it);
        }
        cv.notify_all();  // readers waiting for this shard's samples read the copy
      } catch (const std::exception& e) {
        if (cancel->load()) return;  // closing
        pinfeed::detail::log().warn("remote: caching {} failed, its samples stream: {}", shards[s].shown, e.what());
      }
    }
  }

  /// set_level's work, under the lock; whether samples were given back.
  bool apply_level(memory::PressureLevel level) {
    bool gave_back = false;
    const std::uint64_t was = limit;
    limit = level == memory::PressureLevel::normal     ? base_limit
            : level == memory::PressureLevel::elevated ? base_limit / 4
                                                       : std::min<std::uint64_t>(base_limit, 4ULL << 20U);
    if (limit != was) {
      pinfeed::detail::log().info("remote: {} pressure: read-ahead bound {} bytes ({} held)", memory::to_string(level),
                                  limit, ahead);
    }
    if (limit > was) wake();
    std::vector<std::pair<std::size_t, std::size_t>> by_pos;  // (plan place, index), counted, not waited for
    if (ahead > limit) {
      for (const auto& [i, r] : ready) {
        if (r.counted && !waiting.contains(i)) by_pos.emplace_back(r.pos, i);
      }
    }
    std::sort(by_pos.begin(), by_pos.end(), std::greater<>());
    for (const auto& [pos, i] : by_pos) {
      if (ahead <= limit) break;
      ahead -= need(i);
      ready.erase(i);
      cursor = std::min(cursor, pos);  // fetched again when the loader comes near
      ++stats.dropped;
      gave_back = true;
    }
    return gave_back;
  }

  /// The bound for `level`; fetched samples past it are given back, and
  /// so is the heap they leave (malloc_trim: freed chunks in the middle of
  /// glibc's arenas stay resident otherwise).
  void set_level(memory::PressureLevel level) {
    bool gave_back = false;
    {
      const std::scoped_lock lock(mutex);
      gave_back = apply_level(level);
    }
    if (gave_back) ::malloc_trim(0);
  }
};

namespace {

enum class SidecarOutcome { indexed, missing, no_ranges };

/// The remote shards' index sidecars, `parallel` at once, into indexes[s]:
/// every one read (indexed), one missing (the set is staged), or served
/// without Range support (staged too). Throws what fails otherwise.
SidecarOutcome fetch_sidecars(const std::vector<std::string>& specs, const std::vector<std::size_t>& remote,
                              std::size_t max_classes, const RemoteConfig& config, std::vector<ShardIndex>& indexes) {
  std::atomic<std::size_t> next{0};
  std::atomic<bool> missing{false}, no_ranges{false};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  {
    std::vector<std::jthread> pool;
    const unsigned workers = std::max(1U, std::min<unsigned>(config.parallel, static_cast<unsigned>(remote.size())));
    for (unsigned w = 0; w < workers && !remote.empty(); ++w) {
      pool.emplace_back([&] {
        for (std::size_t k = next++; k < remote.size() && !missing; k = next++) {
          const std::size_t s = remote[k];
          const std::string url = shard_index_url(specs[s]);
          try {
            // Asked for as a Range (bytes 0-): a 206 says the server streams;
            // a plain server (python3 -m http.server) sends a 200, and the
            // set is staged instead, with no request more than the sidecars.
            std::string text;
            detail::request(
                url, config, {},
                [&](CURL* h, detail::Transfer& t) {
                  text.clear();
                  t.text = &text;
                  t.text_limit = kMaxIndexBytes;
                  t.text_what = "a shard's index sidecar";
                  curl_easy_setopt(h, CURLOPT_RANGE, "0-");
                },
                [&](CURL* h, detail::Transfer&) {
                  if (detail::response_code(h) != 206) no_ranges = true;
                });
            indexes[s] = parse_shard_index(text, redact_url(url), max_classes);
          } catch (const RemoteError& e) {
            // S3 answers 403 for a missing key to a reader without
            // s3:ListBucket: staging then says what the shard itself gets.
            if (e.status() == 404 || e.status() == 410 || e.status() == 403) {
              pinfeed::detail::log().info("remote: {} has no index sidecar ({}): staging whole shards instead of "
                                          "streaming (pinfeed-data index makes sidecars)",
                                          redact_url(specs[s]), e.what());
              missing = true;
              continue;
            }
            const std::scoped_lock lock(failure_mutex);
            if (!failure) failure = std::current_exception();
            next = remote.size();
          } catch (...) {
            const std::scoped_lock lock(failure_mutex);
            if (!failure) failure = std::current_exception();
            next = remote.size();
          }
        }
      });
    }
  }
  if (failure) std::rethrow_exception(failure);
  return missing ? SidecarOutcome::missing : no_ranges ? SidecarOutcome::no_ranges : SidecarOutcome::indexed;
}

}  // namespace

std::unique_ptr<StreamedShards> StreamedShards::open(const std::vector<std::string>& specs, std::size_t max_classes,
                                                     const RemoteConfig& config) {
  for (const std::string& u : specs) {
    if (u.starts_with("pipe:")) return nullptr;
    const auto host = u.find("://");
    if (is_remote_url(u) && u.find_first_of("?#", host == std::string::npos ? 0 : host + 3) != std::string::npos) {
      return nullptr;  // a presigned URL: its sidecar would need its own signature
    }
  }
  std::unique_ptr<StreamedShards> out(new StreamedShards());
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->shards.resize(specs.size());
  std::vector<ShardIndex> indexes(specs.size());
  std::vector<std::size_t> remote;
  for (std::size_t s = 0; s < specs.size(); ++s) {
    Impl::Shard& sh = impl->shards[s];
    sh.url = specs[s];
    sh.remote = is_remote_url(specs[s]);
    if (sh.remote) {
      sh.shown = redact_url(specs[s]);
      sh.name = remote_shard_name(specs[s]);
      remote.push_back(s);
    } else {
      sh.shown = specs[s];
      sh.name = fs::path(specs[s]).filename().string();
      RegularFile file(specs[s], "a tar shard");
      indexes[s] = ShardIndex{file.size(), TarShards::index(specs[s], max_classes)};
      sh.bytes = file.size();
      sh.fd = std::make_shared<const UniqueFd>(file.take());
    }
  }
  const SidecarOutcome got = fetch_sidecars(specs, remote, max_classes, config, indexes);
  if (got == SidecarOutcome::missing) return nullptr;
  for (const std::size_t s : remote) impl->shards[s].bytes = indexes[s].size;
  const bool no_ranges = got == SidecarOutcome::no_ranges;
  if (no_ranges) {
    pinfeed::detail::log().warn("remote: {} answers Range requests with the whole object (no Range support): "
                                "streaming is off, the shards are staged whole (nginx, S3 and most object stores "
                                "stream)",
                                redact_url(specs[remote.front()]));
    return nullptr;
  }
  impl->add_samples(indexes);
  impl->remote_shards = remote.size();
  impl->stats.shards = remote.size();
  if (config.readahead != 0) {
    impl->base_limit = config.readahead;
  } else {
    const std::uint64_t room = memory::MemorySnapshot::read("/").effective_available();
    impl->base_limit = std::clamp<std::uint64_t>(room / 16, 4ULL << 20U, 256ULL << 20U);
  }
  impl->limit = impl->base_limit;
  impl->use_cached_copies(remote);
  detail::curl_init_once();
  impl->multi = curl_multi_init();
  if (impl->multi == nullptr) throw RemoteError(specs.front(), 0, "libcurl could not make a multi handle");
  curl_multi_setopt(impl->multi, CURLMOPT_MAX_HOST_CONNECTIONS, static_cast<long>(std::max(1U, config.streams)));
  curl_multi_setopt(impl->multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, static_cast<long>(std::max(1U, config.streams)));
  Impl* raw = impl.get();
  impl->config.cancel = impl->cancel;  // the closing dataset stops a shard being cached mid-transfer
  impl->fetcher = std::thread([raw] { raw->run(); });
  if (!config.cache_dir.empty()) impl->start_stagers();
  pinfeed::detail::log().info("remote: streaming {} shards ({} samples), read-ahead bound {} bytes, {} streams{}",
                              remote.size(), impl->samples.size(), impl->base_limit, config.streams,
                              config.cache_dir.empty() ? "" : ", caching whole shards into cache_dir");
  out->impl_ = std::move(impl);
  return out;
}

StreamedShards::~StreamedShards() {
  if (!impl_) return;
  if (impl_->monitor) impl_->monitor->unsubscribe(impl_->subscription);
  {
    const std::scoped_lock lock(impl_->mutex);
    impl_->closing = true;
  }
  impl_->cancel->store(true);
  impl_->wake();
  impl_->cv.notify_all();
  if (impl_->fetcher.joinable()) impl_->fetcher.join();
  for (std::thread& t : impl_->stagers) t.join();  // a shard being cached stops at its next progress call
  curl_multi_cleanup(impl_->multi);
}

std::size_t StreamedShards::size() const noexcept { return impl_->samples.size(); }
std::int64_t StreamedShards::label(std::size_t i) const { return impl_->samples.at(i).label; }
std::size_t StreamedShards::num_classes() const noexcept { return impl_->num_classes; }
std::uint64_t StreamedShards::stored_size(std::size_t i) const { return impl_->samples.at(i).size; }

std::string StreamedShards::describe(std::size_t i) const {
  const auto& s = impl_->samples.at(i);
  return fmt::format("{}:{}", impl_->shards[s.shard].shown, s.key);
}

std::string StreamedShards::relative_name(std::size_t i) const {
  const auto& s = impl_->samples.at(i);
  return fmt::format("{}:{}", impl_->shards[s.shard].name, s.key);
}

std::string StreamedShards::summary() const {
  return fmt::format("tar shards ({} files, first {}, streamed): {} images, {} classes", impl_->shards.size(),
                     impl_->shards.front().shown, impl_->samples.size(), impl_->num_classes);
}

void StreamedShards::plan(std::span<const std::size_t> order) const {
  Impl& m = *impl_;
  {
    const std::scoped_lock lock(m.mutex);
    ++m.gen;
    m.order.assign(order.begin(), order.end());
    m.occurrence.resize(m.order.size());
    std::unordered_map<std::size_t, std::uint32_t> seen;
    for (std::size_t p = 0; p < m.order.size(); ++p) m.occurrence[p] = ++seen[m.order[p]];
    m.taken.clear();
    m.cursor = 0;
    for (const auto& [i, r] : m.ready) {
      if (r.counted) m.ahead -= m.need(i);
    }
    m.ready.clear();
    m.failed.clear();
  }
  m.wake();
}

void StreamedShards::read(std::size_t i, std::vector<std::byte>& out) const { read_stoppable(i, out, {}); }

void StreamedShards::read_stoppable(std::size_t i, std::vector<std::byte>& out, const std::stop_token& stop) const {
  Impl& m = *impl_;
  const Impl::Sample& s = m.samples.at(i);
  if (s.size > kMaxSampleBytes) throw DataError(describe(i), fmt::format("member of {} bytes is over the limit", s.size));
  std::shared_ptr<const UniqueFd> fd;
  std::string body;
  {
    std::unique_lock lock(m.mutex);
    std::optional<Clock::time_point> since;
    ++m.taken[i];  // the plan's next place for i is this read's
    for (;;) {
      fd = m.shards[s.shard].fd;
      if (fd) break;
      if (const auto it = m.ready.find(i); it != m.ready.end()) {
        body = std::move(it->second.body);
        if (it->second.counted) m.ahead -= m.need(i);
        m.ready.erase(it);
        break;
      }
      if (const auto f = m.failed.find(i); f != m.failed.end()) std::rethrow_exception(f->second);
      if (m.shards[s.shard].failed) std::rethrow_exception(m.shards[s.shard].failed);
      if (m.closing) throw Error(fmt::format("{}: the dataset was closed while the sample was read", describe(i)));
      if (stop.stop_requested()) {  // seen within the 100 ms wait below
        throw Cancelled(fmt::format("{}: the loader stopped its epoch while the sample was fetched", describe(i)));
      }
      if (!m.queued.contains(i)) {
        m.queued.insert(i);
        m.demand.push_back(Impl::Job{i, m.gen, 0, false, 0, Clock::now()});
        m.wake();
      }
      if (!since) {
        since = Clock::now();
        ++m.stats.waits;
      }
      ++m.waiting[i];
      m.cv.wait_for(lock, std::chrono::milliseconds(100));
      if (--m.waiting[i] == 0) m.waiting.erase(i);
    }
    if (since) m.stats.wait_seconds += std::chrono::duration<double>(Clock::now() - *since).count();
    if (!m.served) {
      m.served = true;
      m.cv.notify_all();  // the stagers start
    }
  }
  if (!fd) {
    m.wake();  // the bound has room again
    out.resize(s.size);
    std::memcpy(out.data(), body.data() + kHeader, s.size);
    return;
  }
  // A local shard, or a remote one's cached copy: header and data in one read.
  const Impl::Shard& sh = m.shards[s.shard];
  std::vector<char> buf(kHeader + s.size);
  std::size_t done = 0;
  while (done < buf.size()) {
    const ssize_t r = ::pread(fd->get(), buf.data() + done, buf.size() - done, static_cast<off_t>(s.offset - kHeader + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw DataError(sh.shown, fmt::format("read of {} failed: {}", s.key, std::strerror(errno)));
    if (r == 0) throw DatasetChanged(sh.shown, fmt::format("{} is cut short at byte {}: the shard changed", s.key, s.offset - kHeader + done));
    done += static_cast<std::size_t>(r);
  }
  if (!(s.linked ? TarShards::header_matches(buf.data(), s.size, s.header_sum)
                 : TarShards::header_matches(buf.data(), s.size, s.header_sum, s.key))) {
    throw DatasetChanged(sh.shown, fmt::format("member {} at byte {} is not the indexed one any more: restart to "
                                               "index it again",
                                               s.key, s.offset - kHeader));
  }
  out.resize(s.size);
  std::memcpy(out.data(), buf.data() + kHeader, s.size);
}

std::optional<StreamStats> StreamedShards::stream_stats() const {
  const std::scoped_lock lock(impl_->mutex);
  StreamStats st = impl_->stats;
  st.readahead_bytes = impl_->ahead;
  st.readahead_limit = impl_->limit;
  return st;
}

void StreamedShards::follow(std::shared_ptr<memory::PressureMonitor> monitor) {
  if (!monitor || impl_->monitor) return;
  impl_->monitor = std::move(monitor);
  Impl* raw = impl_.get();
  impl_->subscription = impl_->monitor->subscribe(
      [raw](memory::PressureLevel, memory::PressureLevel to, const memory::PressureReading&) { raw->set_level(to); });
  // The level now, read under the lock a delivery also takes: a change
  // delivered meanwhile is applied after this, never before.
  bool gave_back = false;
  {
    const std::scoped_lock lock(raw->mutex);
    gave_back = raw->apply_level(raw->monitor->level());
  }
  if (gave_back) ::malloc_trim(0);
}

}  // namespace pinfeed::loader
