// pinfeed-bench threads: images/s and RSS per thread count (table, CSV, plot).
#include <fmt/format.h>
#include <libyuv/scale_argb.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <oneapi/tbb/info.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/transform.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/trainer/device_type.hpp"
#include "pinfeed/trainer/trainer.hpp"
#include "pinfeed/units.hpp"
#include "plot.hpp"
#include "tool_main.hpp"

#include "bench_common.hpp"

namespace pinfeed::bench {

/// Runs the loader bench with `threads` worker threads in a child process
/// (fork, before this process has started any thread of its own), so each
/// count's RSS is its own and not the high-water mark of the ones before.
json loader_bench_in_child(pl::LoaderConfig config, unsigned threads, std::size_t epochs, std::size_t repeat,
                           std::size_t ceiling_files) {
  config.threads = threads;
  int fds[2];
  if (::pipe(fds) != 0) throw pinfeed::Error(fmt::format("pipe: {}", std::strerror(errno)));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw pinfeed::Error(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[1]);
    int rc = 1;
    try {
      rc = run_loader_bench(config, epochs, repeat, ceiling_files, /*as_json=*/true);
    } catch (const std::exception& e) {
      fmt::print(stderr, "pinfeed-bench: {} threads: {}\n", threads, e.what());
    }
    std::fflush(stdout);
    ::_exit(rc);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw pinfeed::Error(fmt::format("the loader bench with {} threads failed (see above)", threads));
  }
  return json::parse(out);
}

/// Images/s and RSS over the pool for each thread count: a table, a CSV and
/// a plot (PREFIX.csv, PREFIX.png), the bound being pool + 64 MiB.
int run_threads_bench(const pl::LoaderConfig& config, const std::vector<unsigned>& counts, std::size_t epochs,
                      std::size_t repeat, std::size_t ceiling_files, const std::string& out, bool as_json) {
  const auto dataset = pl::open_dataset(config.dataset, config.list_root);  // a bad --data fails here, once
  json rows = json::array();
  std::string csv = "threads,images_per_s,matching_decode_images_per_s,overhead,rss_mib,pool_mib,over_pool_mib\n";
  for (const unsigned t : counts) {
    const json r = loader_bench_in_child(config, t, epochs, repeat, ceiling_files);
    const auto& m = r["memory"];
    const double pool_mib =
        (m["pool_pinned_bytes"].get<double>() + m["pool_pageable_bytes"].get<double>()) / (1024.0 * 1024.0);
    const double rss = m["loading_rss_mib_max"].get<double>();
    json row = {{"threads", t},
                {"images_per_s", r["loader"]["images_per_s"]},
                {"matching_decode_images_per_s", r["ceiling"]["planned_images_per_s"]},
                {"overhead_vs_planned_decode", r["overhead_vs_planned_decode"]},
                {"loading_rss_mib", rss},
                {"pool_mib", pool_mib},
                {"rss_over_pool_mib", rss - pool_mib}};
    csv += fmt::format("{},{:.1f},{:.1f},{:.4f},{:.1f},{:.1f},{:.1f}\n", t, row["images_per_s"].get<double>(),
                       row["matching_decode_images_per_s"].get<double>(),
                       row["overhead_vs_planned_decode"].get<double>(), rss, pool_mib, rss - pool_mib);
    rows.push_back(std::move(row));
  }
  const std::string commands =
      "set key below\nset xlabel 'loader threads'\nset logscale x 2\n"
      "set ylabel 'images/s'\nset y2label 'RSS while loading, over the pool (MiB)'\nset ytics nomirror\nset y2tics\n"
      "set yrange [0:*]\nset y2range [0:80]\n"
      "set title 'pinfeed-bench threads: throughput and memory against the thread count'\n"
      "plot '{csv}' using 1:2 skip 1 with linespoints lw 2 title 'loader images/s', "
      "'{csv}' using 1:3 skip 1 with linespoints dt 2 title 'matching decode images/s', "
      "'{csv}' using 1:7 skip 1 axes x1y2 with linespoints lw 2 title 'RSS over the pool', "
      "64 axes x1y2 with lines dt 3 lc rgb 'red' title 'bound: pool + 64 MiB'\n";
  const std::string png = pinfeed::tools::write_plot(out, csv, commands, "pinfeed-bench");
  if (as_json) {
    fmt::print("{}\n",
               json{{"dataset", dataset->summary()}, {"rows", rows}, {"csv", out + ".csv"}, {"png", png}}.dump(2));
    return 0;
  }
  fmt::print("pinfeed-bench threads: {}\n", dataset->summary());
  fmt::print("  (each count in its own process: pinfeed-bench loader --repeat {} --epochs {}, medians)\n", repeat,
             epochs);
  fmt::print("  {:>7} {:>12} {:>16} {:>9} {:>10} {:>10} {:>10}\n", "threads", "images/s", "matching decode", "overhead",
             "RSS MiB", "pool MiB", "over pool");
  for (const auto& row : rows) {
    fmt::print("  {:>7} {:>12.1f} {:>16.1f} {:>+8.1f}% {:>10.1f} {:>10.1f} {:>10.1f}\n", row["threads"].get<unsigned>(),
               row["images_per_s"].get<double>(), row["matching_decode_images_per_s"].get<double>(),
               row["overhead_vs_planned_decode"].get<double>() * 100, row["loading_rss_mib"].get<double>(),
               row["pool_mib"].get<double>(), row["rss_over_pool_mib"].get<double>());
  }
  fmt::print("  data: {}.csv{}\n", out, png.empty() ? "" : fmt::format(", plot: {}", png));
  return 0;
}

}  // namespace pinfeed::bench
