// pinfeed-bench: loader throughput against the machine's own decode ceiling.
//
//   pinfeed-bench loader --data DIR [--batch 64] [--crop random] [--json] ...
//
// In one run it measures (1) the decode ceiling: a single-thread, full-size
// TurboJPEG decode of the same files (read into memory first, so it is the
// decoder alone), times the thread count; and (2) the pinfeed loader over the
// dataset with the given transforms, per-stage times, peak RSS and the pool's
// pinned/pageable bytes. `floor` times the loader's work besides decoding,
// each part alone; `threads` runs the loader bench per thread count (table,
// CSV, plot); `copy` times host-to-device copies from pinned and pageable
// memory; `remote` reads the same shards from a server and from disk.
// Benchmarks, not tests: numbers go to docs/results.md.
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

#include "loader_flags.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/loader/dataset.hpp"
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

namespace pl = pinfeed::loader;
using namespace pinfeed::bench;

int main(int argc, char** argv) {
  CLI::App app{"pinfeed-bench: loader throughput against the decode ceiling; host-to-device copy costs"};
  app.require_subcommand(1);
  pl::LoaderConfig config;
  config.watch_pressure = true;
  std::size_t epochs = 1, repeat = 3, ceiling_files = 200;
  bool as_json = false;
  auto* ld = app.add_subcommand("loader", "images/s of the loader and of a bare full decode, same files, same run");
  // What the loader is asked to do, the same flags for every loader
  // subcommand, from the loader's option table.
  const auto add_loader_options = [&](CLI::App* sub) {
    sub->add_option("--data", config.dataset, "folder, file list or tar shard pattern")->required();
    pinfeed::tools::add_loader_flags(
        *sub, config,
        {"batch_size:--batch", "prefetch", "crop", "size", "height", "resize", "layout", "interpolation",
         "max_replaced_share", "roi_decode:--no-roi", "dct_scaling:--dct-scale"});
  };
  add_loader_options(ld);
  pinfeed::tools::add_loader_flags(*ld, config, {"threads"});
  ld->add_option("--epochs", epochs, "loader epochs per round")->check(CLI::Range(1, 1000));
  ld->add_option("--repeat", repeat, "rounds (ceiling + loader); figures are medians")->check(CLI::Range(1, 100));
  ld->add_option("--ceiling-files", ceiling_files, "files decoded for the ceiling")->check(CLI::Range(1, 100000));
  ld->add_flag("--json", as_json, "print JSON");
  std::size_t floor_repeat = 5, evict_mib = 512;
  auto* fl = app.add_subcommand("floor", "the loader's unavoidable work besides decoding, each part alone");
  add_loader_options(fl);  // --batch x --prefetch: the pool the output is written to
  pinfeed::tools::add_loader_flags(*fl, config, {"threads"});  // the matching decode's threads
  fl->add_option("--repeat", floor_repeat, "rounds; figures are medians")->check(CLI::Range(1, 100));
  fl->add_option("--evict-mib", evict_mib, "written before each read pass, to push the files out of the CPU caches")
      ->check(CLI::Range(1, 65536));
  fl->add_flag("--json", as_json, "print JSON");
  std::vector<unsigned> thread_counts{1, 2, 4, 8};
  std::string threads_out = "pinfeed-threads";
  auto* th = app.add_subcommand("threads", "images/s and RSS over the pool for each thread count: table, CSV, plot");
  add_loader_options(th);
  th->add_option("--counts", thread_counts, "thread counts, comma separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  th->add_option("--epochs", epochs, "loader epochs per round")->check(CLI::Range(1, 1000));
  th->add_option("--repeat", repeat, "rounds per count; figures are medians")->check(CLI::Range(1, 100));
  th->add_option("--ceiling-files", ceiling_files, "files decoded for the matching decode")
      ->check(CLI::Range(1, 100000));
  th->add_option("--out", threads_out, "prefix of the CSV and the PNG");
  th->add_flag("--json", as_json, "print JSON");
  std::string copy_device = "cpu";
  std::size_t copy_mib = 64, copy_repeat = 5;
  auto* cp = app.add_subcommand("copy", "host-to-device copy time from pinned and from pageable memory");
  cp->add_option("--device", copy_device, "cpu or cuda:N");
  cp->add_option("--mib", copy_mib, "bytes per copy, MiB")->check(CLI::Range(1, 16384));
  cp->add_option("--repeat", copy_repeat, "copies of each kind; medians")->check(CLI::Range(1, 1000));
  cp->add_flag("--json", as_json, "print JSON");

  std::string remote_local, remote_cache;
  auto* rm = app.add_subcommand("remote",
                                "the same shards from a server (no cache, a fresh and a warm cache_dir) and "
                                "from disk");
  add_loader_options(rm);  // --data: the URL pattern
  pinfeed::tools::add_loader_flags(
      *rm, config,
      {"threads", "remote_readahead", "remote_streams", "remote_timeout", "remote_min_rate", "remote_retries"});
  rm->add_option("--local", remote_local, "the same shards on local disk (pattern)")->required();
  rm->add_option("--cache-dir", remote_cache, "cache_dir for the cached runs")->required();
  rm->add_option("--repeat", repeat, "rounds; figures are medians")->check(CLI::Range(1, 100));
  rm->add_flag("--json", as_json, "print JSON");

  return pinfeed::tools::run_tool("pinfeed-bench", app, argc, argv, [&] {
    spdlog::set_level(spdlog::level::warn);
    if (cp->parsed()) return run_copy_bench(copy_device, copy_mib, copy_repeat, as_json);
    if (rm->parsed()) return run_remote_bench(config, remote_local, remote_cache, repeat, as_json);
    if (fl->parsed()) return run_floor_bench(config, floor_repeat, evict_mib, as_json);
    if (th->parsed()) {
      if (thread_counts.empty()) throw pinfeed::ConfigError("threads: --counts needs at least one thread count");
      pinfeed::tools::check_plot_prefix(threads_out, "--out");
      return run_threads_bench(config, thread_counts, epochs, repeat, ceiling_files, threads_out, as_json);
    }
    return run_loader_bench(config, epochs, repeat, ceiling_files, as_json);
  });
}
