// pinfeed-diag: can this host afford pinned memory for a job, what limits it,
// and how is memory pressure right now. Argument parsing and printing only;
// every figure and verdict comes from pinfeed::memory.
//
// Exit codes: 0 report printed; 1 the host could not be read (message names
// the file); 2 bad flags or an absurd request (message names the flag); 3 the
// planned pool does not fit in memory at all (verdict does-not-fit).
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "pinfeed/error.hpp"
#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/diagnostics.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/numa.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/memory/pool_plan.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"
#include "pinfeed/units.hpp"
#include "tool_main.hpp"

namespace {

using json = nlohmann::ordered_json;
namespace pm = pinfeed::memory;
using pinfeed::format_bytes;

/// The request (root, plan inputs, sample window) plus what only the tool has.
struct Options : pm::DiagnosticsRequest {
  bool json = false;
  std::optional<double> watch_seconds;
  unsigned count = 0;
  bool with_pool = false;
  bool verbose = false;
};

std::atomic<bool> g_interrupted{false};

/// The planned pool does not fit in memory at all (verdict does-not-fit).
constexpr int kExitDoesNotFit = 3;

std::string or_none(const std::optional<std::uint64_t>& v, std::string_view none = "none") {
  return v ? format_bytes(*v) : std::string(none);
}

void print_report(const json& j, const pm::MemorySnapshot& s, const std::optional<pm::PressureReading>& activity) {
  fmt::print("pinfeed-diag: host memory report (root {})\n\n", j["root"].get<std::string>());
  fmt::print("Memory\n");
  fmt::print("  MemTotal {:>14}   MemAvailable {:>12}   Shmem {:>10}   Mlocked {:>10}\n", format_bytes(s.mem_total),
             format_bytes(s.mem_available), format_bytes(s.shmem), format_bytes(s.mlocked));
  fmt::print("  really available {} of {} ({:.1f}%): the least of MemAvailable and the cgroup room\n",
             format_bytes(s.effective_available()), format_bytes(s.effective_total()), s.available_fraction() * 100);
  fmt::print("\nSwap\n");
  if (s.swap_total == 0) {
    fmt::print("  none configured\n");
  } else {
    fmt::print("  {} of {} used\n", format_bytes(s.swap_used()), format_bytes(s.swap_total));
  }
  if (s.pswpin && s.pswpout) fmt::print("  since boot: {} pages in, {} pages out\n", *s.pswpin, *s.pswpout);
  if (activity) {
    fmt::print("  now: {:.0f} pages/s in, {:.0f} pages/s out\n", activity->swap_in_rate, activity->swap_out_rate);
  }
  fmt::print("\nPressure (PSI)\n");
  if (s.psi) {
    fmt::print("  some avg10 {:.2f}%  avg60 {:.2f}%  avg300 {:.2f}%\n", s.psi->some.avg10, s.psi->some.avg60,
               s.psi->some.avg300);
    if (s.psi->full) {
      fmt::print("  full avg10 {:.2f}%  avg60 {:.2f}%  avg300 {:.2f}%\n", s.psi->full->avg10, s.psi->full->avg60,
                 s.psi->full->avg300);
    }
  } else {
    fmt::print("  unavailable: {}\n", s.psi_note);
  }
  if (activity) fmt::print("  level: {} ({})\n", pm::to_string(activity->level), activity->reason);
  const auto& cg = s.cgroup;
  fmt::print("\nCgroup\n");
  if (cg.version == pm::CgroupVersion::none) {
    fmt::print("  no memory cgroup found\n");
  } else {
    fmt::print("  {} {} ({})\n", pm::to_string(cg.version), cg.path, cg.dir.string());
    fmt::print("  limit {}   usage {}   inactive file {}   room {}\n", or_none(cg.limit_bytes, "none"),
               format_bytes(cg.usage_bytes), format_bytes(cg.inactive_file_bytes),
               or_none(cg.room_bytes(), "unlimited"));
    if (cg.high_bytes) fmt::print("  memory.high {}\n", format_bytes(*cg.high_bytes));
    if (cg.pressure) fmt::print("  cgroup PSI some avg10 {:.2f}%\n", cg.pressure->some.avg10);
    if (cg.oom_kills) fmt::print("  oom kills {}   times at the limit {}\n", *cg.oom_kills, cg.max_events.value_or(0));
    if (cg.failcnt) fmt::print("  failcnt {}\n", *cg.failcnt);
  }
  fmt::print("\nLocking\n");
  fmt::print("  RLIMIT_MEMLOCK {}   CAP_IPC_LOCK {}   locked by this process {}\n",
             s.memlock_limit_known ? or_none(s.memlock_limit, "unlimited") : std::string("unknown"),
             s.cap_ipc_lock ? "yes (limit does not apply)" : "no", format_bytes(s.vm_locked));
  if (!j["numa"].is_null()) {
    fmt::print("\nNUMA ({})\n", j["numa"]["hwloc"].get<bool>() ? "hwloc" : "hwloc unavailable: one node assumed");
    for (const auto& n : j["numa"]["nodes"]) {
      fmt::print("  node {}: {} cpus ({}), {}\n", n["os_index"].get<unsigned>(), n["cpu_count"].get<unsigned>(),
                 n["cpus"].get<std::string>(), format_bytes(n["memory_bytes"].get<std::uint64_t>()));
    }
    fmt::print("\nGPUs\n");
    const auto& cuda = j["cuda"];
    if (cuda["devices"].empty()) fmt::print("  no GPU: {}\n", cuda["message"].get<std::string>());
    for (const auto& d : cuda["devices"]) {
      fmt::print("  {}: {} {} pci {} numa node {}\n", d["index"].get<int>(), d["name"].get<std::string>(),
                 format_bytes(d["memory_bytes"].get<std::uint64_t>()), d["pci_bus_id"].get<std::string>(),
                 d["numa_node"].get<int>());
      if (d["host_page_tables"].get<bool>()) {
        fmt::print(
            "     reads pageable memory through the host page tables (Grace/ATS): registration need not\n"
            "     page-lock, so VmLck, not the pool's \"pinned\", says what is locked\n");
      }
    }
  } else {
    fmt::print("\n({})\n", j["note"].get<std::string>());
  }
  fmt::print("\nProcesses holding locked or pinned memory\n");
  if (j["locked_memory_users"].empty()) fmt::print("  none\n");
  int shown = 0;
  for (const auto& u : j["locked_memory_users"]) {
    if (++shown > 10) break;
    fmt::print("  {:>7} {:<16} locked {:>12}  pinned {:>12}\n", u["pid"].get<int>(), u["name"].get<std::string>(),
               format_bytes(u["vm_locked_bytes"].get<std::uint64_t>()),
               format_bytes(u["vm_pinned_bytes"].get<std::uint64_t>()));
  }
}

void print_plan(const pm::PoolPlanRequest& r, const pm::PoolPlan& p) {
  fmt::print("\nPlan: {} GPU(s), batch {}, prefetch {}, pinning by {}{}\n", r.gpus, format_bytes(r.batch_bytes),
             r.prefetch, pm::to_string(r.policy.method),
             r.local_ranks > 1 ? fmt::format(", {} ranks on this host share its memory", r.local_ranks) : "");
  fmt::print("  pool needs {} slots x {} = {}\n", p.slots_needed, format_bytes(p.slot_bytes),
             format_bytes(p.need_bytes));
  fmt::print("  pinned budget {} (limited by {}):\n", format_bytes(p.budget.bytes), p.budget.limiting);
  for (const auto& t : p.budget.terms) {
    fmt::print("    {} {:<14} {:>12}  {}\n", t.name == p.budget.limiting ? "*" : " ", t.name, format_bytes(t.bytes),
               t.detail);
  }
  fmt::print("  verdict: {}\n", pm::to_string(p.verdict));
  for (const auto& reason : p.reasons) fmt::print("  - {}\n", reason);
}

// ------------------------------------------------------------------- watch

int watch(const Options& o, const std::optional<pm::PoolPlanRequest>& req) {
  pm::PressureMonitor::Config mc;
  mc.root = o.root;
  mc.period = std::chrono::milliseconds(static_cast<long>(*o.watch_seconds * 1000));
  mc.validate();
  pm::PressureMonitor monitor(mc);

  std::optional<pm::PinnedResource> pinned;
  std::optional<pm::PageableResource> pageable;
  std::optional<pm::BufferPool> pool;
  if (o.with_pool) {
    if (!req) throw pinfeed::ConfigError("--with-pool needs --batch or --batch-bytes to size the pool");
    const pm::PoolPlan plan = pm::plan_pool(pm::MemorySnapshot::read(o.root), *req);
    if (plan.verdict == pm::Verdict::does_not_fit)
      throw pinfeed::ConfigError(fmt::format("--with-pool: {}", plan.fit.explain("--prefetch", "--batch", req->gpus)));
    pinned.emplace(pm::PinnedResource::Config{req->policy.method, std::nullopt});
    pageable.emplace();
    pm::BufferPool::Config pc;
    pc.slots = plan.slots_needed;
    pc.slot_bytes = req->batch_bytes;
    pc.slab_bytes = pc.slot_bytes;  // the Loader's rule: one slot per slab, so the budget pins whole slots
    pc.pinned_budget_bytes = plan.budget.bytes;
    pool.emplace(pc, *pinned, *pageable);
    pool->follow(monitor);
  }

  if (!o.json) {
    fmt::print("{:>8} {:>12} {:>6} {:>8} {:>8} {:>7} {:>7} {:>9}{}\n", "time_s", "available", "avail%", "swpin/s",
               "swpout/s", "some%", "full%", "level", pool ? "  pool pinned/pageable/released  given back" : "");
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (unsigned i = 0; (o.count == 0 || i < o.count) && !g_interrupted.load(); ++i) {
    if (i > 0) std::this_thread::sleep_for(mc.period);
    const pm::PressureReading r = monitor.step();
    if (pool) pool->wait_idle(std::chrono::milliseconds(2000));
    const double t = std::chrono::duration<double>(r.at - t0).count();
    if (o.json) {
      json line{{"time_s", t},
                {"available_bytes", r.available_bytes},
                {"available_fraction", r.available_fraction},
                {"swap_in_pages_per_s", r.swap_in_rate},
                {"swap_out_pages_per_s", r.swap_out_rate},
                {"psi_some_avg10", r.psi_some},
                {"psi_full_avg10", r.psi_full},
                {"level", pm::to_string(r.level)},
                {"reason", r.reason}};
      if (pool) {
        const auto st = pool->stats();
        line["pool"] = st;
      }
      fmt::print("{}\n", line.dump());
    } else {
      std::string pool_col;
      if (pool) {
        const auto st = pool->stats();
        pool_col = fmt::format("  {:>11}/{}/{:<10} {}{}", st.pinned_slots, st.pageable_slots, st.released_slots,
                               format_bytes(st.given_back_bytes),
                               st.last_release_seconds < 0
                                   ? std::string{}
                                   : fmt::format(" ({:.0f} ms after critical)", st.last_release_seconds * 1e3));
      }
      fmt::print("{:>8.2f} {:>12} {:>5.1f}% {:>8.0f} {:>8.0f} {:>7.2f} {:>7.2f} {:>9}{}\n", t,
                 format_bytes(r.available_bytes), r.available_fraction * 100, r.swap_in_rate, r.swap_out_rate,
                 r.psi_some, r.psi_full, pm::to_string(r.level), pool_col);
    }
    std::fflush(stdout);
  }
  return 0;
}

int run(const Options& o) {
  const auto req = pm::diagnostics_plan_request(o);  // validates flags before any output
  if (o.watch_seconds) return watch(o, req);

  pm::MemorySnapshot s = pm::MemorySnapshot::read(o.root);
  std::optional<pm::PressureReading> activity;
  if (o.root == "/" && o.sample_ms > 0) {
    // Rates need two readings: measure swap activity over a short window.
    pm::PressureMonitor::Config mc;
    mc.root = o.root;
    pm::PressureMonitor monitor(mc);
    monitor.step(s);
    std::this_thread::sleep_for(std::chrono::milliseconds(o.sample_ms));
    s = pm::MemorySnapshot::read(o.root);
    activity = monitor.step(s);
  }
  json j = pm::diagnostics_report_json(o.root, s, activity);
  std::optional<pm::PoolPlan> plan;
  if (req) {
    plan = pm::plan_pool(s, *req);
    j["plan"] = pm::pool_plan_json(*req, *plan);
  }
  if (o.json) {
    fmt::print("{}\n", j.dump(2));
  } else {
    print_report(j, s, activity);
    if (plan) print_plan(*req, *plan);
    if (!plan) fmt::print("\n(no plan: give --batch 256x3x224x224:u8 or --batch-bytes N to size a pinned pool)\n");
  }
  return plan && plan->verdict == pm::Verdict::does_not_fit ? kExitDoesNotFit : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"pinfeed-diag: host memory, pinning limits and pressure; plans a pinned batch pool"};
  app.set_version_flag("--version", "pinfeed-diag 0.1.0");
  app.add_option("--root", o.root, "read proc/ and sys/ under this folder (a snapshot of another host)")
      ->check(CLI::ExistingDirectory);
  app.add_flag("--json", o.json, "print JSON (with --watch: one object per line)");
  app.add_option("--gpus", o.gpus, "GPUs (consumers) the pool feeds")->check(CLI::Range(1U, 1024U));
  auto* bb = app.add_option("--batch-bytes", o.batch_bytes, "bytes of one batch in host memory (e.g. 38535168, 512MiB)")
                 ->transform(CLI::AsSizeValue(false));
  app.add_option("--batch", o.batch_shape, "batch shape, e.g. 256x3x224x224:u8 (u8 f16 bf16 f32 f64)")->excludes(bb);
  app.add_option("--prefetch", o.prefetch, "batches in flight per GPU")->check(CLI::Range(1U, 64U));
  app.add_option("--local-ranks", o.local_ranks,
                 "processes on this host sharing its memory (default: LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, "
                 "an srun step's SLURM_STEP_TASKS_PER_NODE, else 1)")
      ->check(CLI::Range(1U, 4096U));
  app.add_option("--fraction", o.fraction, "share of the really available memory pinning may take")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--reserve", o.reserve_bytes, "memory to keep free before the fraction applies (e.g. 4GiB)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--pin-method", o.pin_method, "auto, mlock or cuda: mlock is charged to RLIMIT_MEMLOCK")
      ->check(CLI::IsMember(pinfeed::enum_choices(pinfeed::memory::kPinMethodWords)));
  app.add_option("--gpu-mem", o.gpu_memory_bytes, "memory per GPU for the 2x host RAM rule (default: GPU 0's)")
      ->transform(CLI::AsSizeValue(false));
  auto* w = app.add_option("--watch", o.watch_seconds, "stream a line per sample every SECONDS (default 1)")
                ->expected(0, 1)
                ->default_str("1")
                ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--count", o.count, "with --watch: stop after N samples (0: until Ctrl-C)")->needs(w);
  app.add_flag("--with-pool", o.with_pool, "with --watch: run a buffer pool sized by the plan and show its slots")
      ->needs(w);
  app.add_option("--sample-ms", o.sample_ms, "window to measure swap rates over in the report")
      ->check(CLI::Range(0U, 10000U));
  app.add_flag("-v,--verbose", o.verbose, "log pool and pressure events to stderr");
  return pinfeed::tools::run_tool("pinfeed-diag", app, argc, argv, [&] {
    if (w->count() > 0 && !o.watch_seconds) o.watch_seconds = 1.0;
    spdlog::set_level(o.verbose ? spdlog::level::info : spdlog::level::warn);
    std::signal(SIGINT, [](int) { g_interrupted = true; });
    return run(o);
  });
}
