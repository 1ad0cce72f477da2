#pragma once
// What streaming shares between its files (private to loader/remote): the
// reader's engine, StreamedShards::Impl (range requests ahead of the
// loader within a byte bound; Note [Streamed shards], streamed.cpp), and
// the sidecars' fetch (shard_index.cpp).
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
#include <fstream>
#include <limits>
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

#include "pinfeed/loader/streamed.hpp"

namespace pinfeed::loader {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace detail {

inline constexpr std::uint64_t kHeader = 512;
/// A sidecar's size limit: ~900k samples of one shard (Note [Bounded sidecars]).
inline constexpr std::uint64_t kMaxIndexBytes = 64ULL << 20U;
inline constexpr std::uint64_t kMaxIndexEntries = 1'000'000;

enum class SidecarOutcome { indexed, missing, no_ranges };

/// The remote shards' index sidecars, `parallel` at once, into indexes[s]:
/// every one read (indexed), one missing (the set is staged), or served
/// without Range support (staged too). Throws what fails otherwise.
SidecarOutcome fetch_sidecars(const std::vector<std::string>& specs, const std::vector<std::size_t>& remote,
                              std::size_t max_classes, const RemoteConfig& config, std::vector<ShardIndex>& indexes);

}  // namespace detail

using detail::kHeader;

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
    std::size_t pos = 0;   ///< place in the plan (demand: none)
    bool counted = false;  ///< inside the read-ahead bound
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
  bool served = false;                            // a read has had its bytes: the stagers may start
  std::vector<std::shared_ptr<const void>> keep;  ///< the cache's locks

  CURLM* multi = nullptr;
  std::thread fetcher;
  std::vector<std::thread> stagers;        ///< with cache_dir: `parallel` of them
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
    if (samples.empty())
      throw DataError(shards.front().shown, "dataset is empty: no key.jpg + key.cls pairs in the shards");
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
      return fmt::format(
          "is {} bytes on the server, its index says {}: the shard changed after its index was "
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
      return fmt::format(
          "member {} at byte {} is not the indexed one: the shard changed after its index was written "
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
      retry_why = !a.t.stalled.empty() || rc != CURLE_OK ? detail::retry_reason(rc, a.t)
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
      fatal = std::make_exception_ptr(RemoteError(
          sh.url, rc == CURLE_OK ? code : 0,
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
          wait_ms = std::min<int>(wait_ms,
                                  static_cast<int>(std::max<std::int64_t>(
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

}  // namespace pinfeed::loader
