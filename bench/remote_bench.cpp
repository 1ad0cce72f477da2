// pinfeed-bench remote: the same shards from a server and from local disk,
// in alternating rounds of one run. Sources: local disk; the server with no
// cache (shards with index sidecars stream, sample by sample, every epoch);
// the server with a fresh cache_dir (epoch 1 streams while whole shards are
// cached, epoch 2 reads what is cached by then); the server with a warm
// cache_dir. Each round times opening, the first batch, and two epochs.
// Medians over the rounds.
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_common.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::bench {

namespace {

struct Round {
  double open_s = 0, first_batch_s = 0, epoch_ips = 0, second_epoch_ips = 0;
  double stream_mb = 0, waits = 0, wait_s = 0, readahead_peak_mb = 0;  ///< epoch 1's transfers (streamed only)
  double cached_at_epoch2 = 0;  ///< shards read from cache_dir when epoch 2 began
};

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// One epoch; its images/s.
double drain(pl::Loader& loader, std::uint64_t epoch, double* first_batch_s, Clock::time_point t0) {
  loader.begin_epoch(epoch);
  std::size_t n = 0;
  bool first = true;
  const auto start = Clock::now();
  while (auto b = loader.next()) {
    if (first && first_batch_s != nullptr) *first_batch_s = since(t0);
    first = false;
    n += b->size();
  }
  return static_cast<double>(n) / since(start);
}

Round run_round(const pl::LoaderConfig& config) {
  Round r;
  const auto t0 = Clock::now();
  pl::Loader loader(config);  // opens (and for URLs stages) the dataset
  r.open_s = since(t0);
  const double first_epoch = drain(loader, 0, &r.first_batch_s, t0);
  // The first epoch's rate counted from the start: what a job waits for.
  r.epoch_ips = static_cast<double>(loader.dataset().size()) / since(t0);
  (void)first_epoch;
  if (const auto st = loader.stats().remote) {
    r.stream_mb = static_cast<double>(st->bytes) / 1e6;
    r.waits = static_cast<double>(st->waits);
    r.wait_s = st->wait_seconds;
    r.readahead_peak_mb = static_cast<double>(st->readahead_peak) / 1e6;
    r.cached_at_epoch2 = static_cast<double>(st->shards_local);
  }
  r.second_epoch_ips = drain(loader, 1, nullptr, t0);
  return r;
}

/// Fills cache_dir: one epoch, then the stager's last shards.
void fill_cache(const pl::LoaderConfig& config) {
  pl::Loader loader(config);
  (void)drain(loader, 0, nullptr, Clock::now());
  const auto deadline = Clock::now() + std::chrono::minutes(10);
  while (Clock::now() < deadline) {
    const auto st = loader.stats().remote;
    if (!st || st->shards_local == st->shards) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

json medians(const std::vector<Round>& rounds) {
  std::vector<double> open, first, epoch, second, mb, waits, wait_s, peak, cached;
  for (const Round& r : rounds) {
    open.push_back(r.open_s);
    first.push_back(r.first_batch_s);
    epoch.push_back(r.epoch_ips);
    second.push_back(r.second_epoch_ips);
    mb.push_back(r.stream_mb);
    waits.push_back(r.waits);
    wait_s.push_back(r.wait_s);
    peak.push_back(r.readahead_peak_mb);
    cached.push_back(r.cached_at_epoch2);
  }
  return {{"open_s", median(open)},
          {"first_batch_s", median(first)},
          {"first_epoch_images_per_s", median(epoch)},
          {"second_epoch_images_per_s", median(second)},
          {"epoch1_streamed_mb", median(mb)},
          {"epoch1_waits", median(waits)},
          {"epoch1_wait_s", median(wait_s)},
          {"readahead_peak_mb", median(peak)},
          {"shards_cached_at_epoch2", median(cached)}};
}

void print_report(const json& j) {
  fmt::print("remote {} vs local {}: {} samples, {} in {} shards, {} threads, {} rounds (medians)\n",
             j["remote"].get<std::string>(), j["local"].get<std::string>(), j["samples"].get<std::size_t>(),
             pinfeed::format_bytes(j["bytes"].get<std::uint64_t>()), j["shards"].get<std::size_t>(),
             j["threads"].get<unsigned>(), j["rounds"].get<std::size_t>());
  fmt::print("  {:<22} {:>9} {:>12} {:>18} {:>18} {:>11} {:>8} {:>13}\n", "", "open s", "1st batch s",
             "epoch 1 images/s", "epoch 2 images/s", "streamed MB", "waits", "read-ahead MB");
  for (const char* k : {"local", "remote_no_cache", "remote_fresh_cache", "remote_warm_cache"}) {
    const json& m = j["results"][k];
    fmt::print("  {:<22} {:>9.3f} {:>12.3f} {:>18.0f} {:>18.0f} {:>11.1f} {:>8.0f} {:>13.1f}\n", k,
               m["open_s"].get<double>(), m["first_batch_s"].get<double>(), m["first_epoch_images_per_s"].get<double>(),
               m["second_epoch_images_per_s"].get<double>(), m["epoch1_streamed_mb"].get<double>(),
               m["epoch1_waits"].get<double>(), m["readahead_peak_mb"].get<double>());
  }
  fmt::print(
      "  remote/local images/s: no cache epoch 1 {:.3f}, epoch 2 {:.3f}; fresh cache epoch 2 {:.3f}; warm cache "
      "epoch 1 {:.3f}\n",
      j["ratio_epoch1_no_cache"].get<double>(), j["ratio_epoch2_no_cache"].get<double>(),
      j["ratio_epoch2_fresh_cache"].get<double>(), j["ratio_epoch1_warm_cache"].get<double>());
}

}  // namespace

int run_remote_bench(const pl::LoaderConfig& config, const std::string& local, const std::filesystem::path& cache_dir,
                     std::size_t repeat, bool as_json) {
  if (!pl::is_remote_url(config.dataset.substr(0, config.dataset.find(',')))) {
    throw ConfigError(fmt::format("remote: --data '{}' is not a URL (http://, https://, s3://, pipe:)",
                                  pl::redact_spec(config.dataset)));
  }
  pl::LoaderConfig local_config = config;
  local_config.dataset = local;
  pl::LoaderConfig none = config;
  none.remote.cache_dir.clear();  // nothing kept: every epoch from the server
  pl::LoaderConfig warm = config;
  warm.remote.cache_dir = cache_dir / "warm";
  std::uint64_t bytes = 0;
  std::size_t shards = 0, samples = 0;
  {
    const auto d = pl::open_dataset(local);
    samples = d->size();
    for (const auto& p : pl::expand_shard_pattern(local)) {
      bytes += std::filesystem::file_size(p);
      ++shards;
    }
    fill_cache(warm);
  }
  std::vector<Round> l, n, f, w;
  for (std::size_t k = 0; k < repeat; ++k) {  // alternating: the machine's drift falls on all alike
    l.push_back(run_round(local_config));
    n.push_back(run_round(none));
    pl::LoaderConfig fresh = config;
    fresh.remote.cache_dir = cache_dir / fmt::format("fresh-{}", k);
    f.push_back(run_round(fresh));
    w.push_back(run_round(warm));
  }
  json j{{"remote", pl::redact_spec(config.dataset)},
         {"local", local},
         {"samples", samples},
         {"bytes", bytes},
         {"shards", shards},
         {"threads", pl::default_threads(config.threads)},
         {"rounds", repeat},
         {"readahead", config.remote.readahead},
         {"streams", config.remote.streams}};
  j["results"] = {{"local", medians(l)},
                  {"remote_no_cache", medians(n)},
                  {"remote_fresh_cache", medians(f)},
                  {"remote_warm_cache", medians(w)}};
  const auto ratio = [&](const char* a, const char* key) {
    return j["results"][a][key].get<double>() / j["results"]["local"][key].get<double>();
  };
  j["ratio_epoch1_no_cache"] = ratio("remote_no_cache", "first_epoch_images_per_s");
  j["ratio_epoch2_no_cache"] = ratio("remote_no_cache", "second_epoch_images_per_s");
  j["ratio_epoch2_fresh_cache"] = ratio("remote_fresh_cache", "second_epoch_images_per_s");
  j["ratio_epoch1_warm_cache"] = ratio("remote_warm_cache", "first_epoch_images_per_s");
  return emit_report(j, as_json, print_report);
}

}  // namespace pinfeed::bench
