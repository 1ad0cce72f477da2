// pinfeed-bench remote: the same shards from a server and from local disk,
// in alternating rounds of one run. Each round times, for each source:
// opening (for URLs: fetching every shard into a private folder, cold, or
// checking a warm cache_dir), the first batch, and the epoch; then a second
// epoch (the shards are local by then). Medians over the rounds.
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench_common.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::bench {

namespace {

struct Round {
  double open_s = 0, first_batch_s = 0, epoch_ips = 0, second_epoch_ips = 0;
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
  r.second_epoch_ips = drain(loader, 1, nullptr, t0);
  return r;
}

json medians(const std::vector<Round>& rounds) {
  std::vector<double> open, first, epoch, second;
  for (const Round& r : rounds) {
    open.push_back(r.open_s);
    first.push_back(r.first_batch_s);
    epoch.push_back(r.epoch_ips);
    second.push_back(r.second_epoch_ips);
  }
  return {{"open_s", median(open)},
          {"first_batch_s", median(first)},
          {"first_epoch_images_per_s", median(epoch)},
          {"second_epoch_images_per_s", median(second)}};
}

void print_report(const json& j) {
  fmt::print("remote {} vs local {}: {} samples, {} in {} shards, {} threads, {} rounds (medians)\n",
             j["remote"].get<std::string>(), j["local"].get<std::string>(), j["samples"].get<std::size_t>(),
             pinfeed::format_bytes(j["bytes"].get<std::uint64_t>()), j["shards"].get<std::size_t>(),
             j["threads"].get<unsigned>(), j["rounds"].get<std::size_t>());
  fmt::print("  {:<22} {:>9} {:>12} {:>18} {:>18}\n", "", "open s", "1st batch s", "epoch 1 images/s", "epoch 2 images/s");
  for (const char* k : {"local", "remote_cold", "remote_cached"}) {
    const json& m = j["results"][k];
    fmt::print("  {:<22} {:>9.3f} {:>12.3f} {:>18.0f} {:>18.0f}\n", k, m["open_s"].get<double>(),
               m["first_batch_s"].get<double>(), m["first_epoch_images_per_s"].get<double>(),
               m["second_epoch_images_per_s"].get<double>());
  }
  fmt::print("  cold fetch {:.0f} MB/s; remote/local images/s: epoch 1 {:.3f} (cold), {:.3f} (cache); epoch 2 {:.3f}\n",
             j["cold_fetch_mb_per_s"].get<double>(), j["ratio_epoch1_cold"].get<double>(),
             j["ratio_epoch1_cached"].get<double>(), j["ratio_epoch2_cold"].get<double>());
}

}  // namespace

int run_remote_bench(const pl::LoaderConfig& config, const std::string& local, const std::filesystem::path& cache_dir,
                     std::size_t repeat, bool as_json) {
  if (!pl::is_remote_url(config.dataset.substr(0, config.dataset.find(',')))) {
    throw ConfigError(fmt::format("remote: --data '{}' is not a URL (http://, https://, s3://, pipe:)", config.dataset));
  }
  pl::LoaderConfig local_config = config;
  local_config.dataset = local;
  pl::LoaderConfig cold = config;
  cold.remote.cache_dir.clear();  // a private folder each time: every shard fetched
  pl::LoaderConfig cached = config;
  cached.remote.cache_dir = cache_dir;
  std::uint64_t bytes = 0;
  std::size_t shards = 0, samples = 0;
  {
    const auto d = pl::open_dataset(local);
    samples = d->size();
    for (const auto& p : pl::expand_shard_pattern(local)) {
      bytes += std::filesystem::file_size(p);
      ++shards;
    }
    (void)run_round(cached);  // fills the cache
  }
  std::vector<Round> l, c, w;
  for (std::size_t k = 0; k < repeat; ++k) {  // alternating: the machine's drift falls on all three alike
    l.push_back(run_round(local_config));
    c.push_back(run_round(cold));
    w.push_back(run_round(cached));
  }
  json j{{"remote", config.dataset}, {"local", local}, {"samples", samples}, {"bytes", bytes}, {"shards", shards},
         {"threads", pl::default_threads(config.threads)}, {"rounds", repeat}};
  j["results"] = {{"local", medians(l)}, {"remote_cold", medians(c)}, {"remote_cached", medians(w)}};
  const auto ratio = [&](const char* a, const char* key) {
    return j["results"][a][key].get<double>() / j["results"]["local"][key].get<double>();
  };
  j["ratio_epoch1_cold"] = ratio("remote_cold", "first_epoch_images_per_s");
  j["ratio_epoch1_cached"] = ratio("remote_cached", "first_epoch_images_per_s");
  j["ratio_epoch2_cold"] = ratio("remote_cold", "second_epoch_images_per_s");
  j["cold_fetch_mb_per_s"] = static_cast<double>(bytes) / 1e6 / j["results"]["remote_cold"]["open_s"].get<double>();
  return emit_report(j, as_json, print_report);
}

}  // namespace pinfeed::bench
