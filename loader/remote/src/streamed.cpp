#include "streaming.hpp"

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

using detail::fetch_sidecars;
using detail::SidecarOutcome;

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
    pinfeed::detail::log().warn(
        "remote: {} answers Range requests with the whole object (no Range support): "
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
  if (s.size > kMaxSampleBytes)
    throw DataError(describe(i), fmt::format("member of {} bytes is over the limit", s.size));
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
    const ssize_t r =
        ::pread(fd->get(), buf.data() + done, buf.size() - done, static_cast<off_t>(s.offset - kHeader + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw DataError(sh.shown, fmt::format("read of {} failed: {}", s.key, std::strerror(errno)));
    if (r == 0)
      throw DatasetChanged(
          sh.shown, fmt::format("{} is cut short at byte {}: the shard changed", s.key, s.offset - kHeader + done));
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
