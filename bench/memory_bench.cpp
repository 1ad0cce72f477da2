// Micro-benchmarks of the memory module (Google Benchmark). Figures go to
// docs/results.md with the command that produced them.
//
//   build/release/bench/pinfeed-memory-bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true   (one command line)
#include <benchmark/benchmark.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "pinfeed/memory/buffer_pool.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"
#include "pinfeed/units.hpp"

namespace {

using namespace pinfeed::literals;
namespace pm = pinfeed::memory;

pm::PinnedResource& pinned() {
  static pm::PinnedResource r;  // cuda_register with a device, mlock otherwise
  return r;
}
pm::PageableResource& pageable() {
  static pm::PageableResource r;
  return r;
}

// The loader's hot path: take a slot, give it back. Uncontended and with
// several threads competing for 8 slots.
void BM_PoolAcquireRelease(benchmark::State& state) {
  static pm::BufferPool* pool = nullptr;
  if (state.thread_index() == 0) {
    pm::BufferPool::Config c;
    c.slots = 8;
    c.slot_bytes = 1_MiB;
    pool = new pm::BufferPool(c, pinned(), pageable());
  }
  for (auto _ : state) {
    auto lease = pool->acquire();
    benchmark::DoNotOptimize(lease.data());
  }
  if (state.thread_index() == 0) {
    delete pool;
    pool = nullptr;
  }
}
BENCHMARK(BM_PoolAcquireRelease)->Threads(1)->Threads(2)->Threads(4)->UseRealTime();

// A fence that is already complete, as after a copy that finished.
void BM_PoolReleaseAfterFence(benchmark::State& state) {
  pm::BufferPool::Config c;
  c.slots = 8;
  c.slot_bytes = 1_MiB;
  pm::BufferPool pool(c, pinned(), pageable());
  auto fence = std::make_shared<pm::ManualFence>();
  fence->signal();
  for (auto _ : state) {
    auto lease = pool.acquire();
    lease.release_after(fence);
  }
}
BENCHMARK(BM_PoolReleaseAfterFence);

// Making pinned memory: mmap + pre-fault + lock (+ unlock + unmap), GB/s.
void BM_PinnedAllocate(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = pinned().allocate(bytes, 4096);
    benchmark::DoNotOptimize(p);
    pinned().deallocate(p, bytes, 4096);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_PinnedAllocate)->Arg(64 << 20)->Arg(256 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same without locking: mmap + pre-fault, GB/s.
void BM_PageableAllocate(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = pageable().allocate(bytes, 4096);
    benchmark::DoNotOptimize(p);
    pageable().deallocate(p, bytes, 4096);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_PageableAllocate)->Arg(64 << 20)->Arg(256 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

// Why slots are pre-faulted once: writing a batch into a fresh mapping pays
// a page fault and zeroing per 4 KiB page; into a reused slot it does not.
void BM_WriteFreshMapping(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    std::memset(p, 1, bytes);
    benchmark::ClobberMemory();
    ::munmap(p, bytes);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_WriteFreshMapping)->Arg(64 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_WritePrefaultedSlot(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  pm::BufferPool::Config c;
  c.slots = 1;
  c.slot_bytes = bytes;
  pm::BufferPool pool(c, pinned(), pageable());
  for (auto _ : state) {
    auto lease = pool.acquire();
    std::memset(lease.data(), 1, bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_WritePrefaultedSlot)->Arg(64 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

// What touching memory again costs after it sat untouched for a while, with
// the CPU busy meanwhile: on a host that reclaims idle guest memory (these
// VMs), a pool slot or a page-cache page re-touched an epoch later pays
// microseconds per page. One write per 4 KiB page of a 64 MiB block, pinned
// (huge pages) or pageable (small pages); range(0) = idle milliseconds.
void BM_TouchAfterIdle(benchmark::State& state, bool pinned_memory) {
  constexpr std::size_t kBytes = 64_MiB, kPage = 4_KiB;
  pm::HostResource& r = pinned_memory ? static_cast<pm::HostResource&>(pinned()) : pageable();
  auto* p = static_cast<unsigned char*>(r.allocate(kBytes, kPage));
  std::memset(p, 1, kBytes);
  const auto idle = std::chrono::milliseconds(state.range(0));
  for (auto _ : state) {
    state.PauseTiming();
    const auto until = std::chrono::steady_clock::now() + idle;
    volatile std::uint64_t spin = 0;
    while (std::chrono::steady_clock::now() < until) spin = spin + 1;
    state.ResumeTiming();
    for (std::size_t i = 0; i < kBytes; i += kPage) p[i] = static_cast<unsigned char>(p[i] + 1);
    benchmark::ClobberMemory();
  }
  state.counters["per_4k_page"] = benchmark::Counter(
      static_cast<double>(kBytes / kPage), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  r.deallocate(p, kBytes, kPage);
}
BENCHMARK_CAPTURE(BM_TouchAfterIdle, pinned, true)
    ->Arg(0)
    ->Arg(10)
    ->Arg(50)
    ->Arg(200)
    ->Arg(1000)
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_TouchAfterIdle, pageable, false)
    ->Arg(0)
    ->Arg(10)
    ->Arg(50)
    ->Arg(200)
    ->Arg(1000)
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The two halves of a pressure episode for a pool of 5 slabs of 64 MiB, 4 of
// them released (the floor is at least one slot): critical (munlock + munmap of each idle slab: what
// makes RSS fall) and normal (map, first-touch and mlock each again: what a
// regrowth costs, in the maintenance thread). range(0): 1 times the release,
// 0 the regrowth; the other half runs untimed.
void BM_PoolPressureHalf(benchmark::State& state) {
  const bool time_release = state.range(0) == 1;
  pm::BufferPool::Config c;
  c.slots = 5;
  c.slot_bytes = 64_MiB;
  c.slab_bytes = 64_MiB;
  c.min_live_slots = 1;
  pm::BufferPool pool(c, pinned(), pageable());
  for (auto _ : state) {
    if (!time_release) state.PauseTiming();
    pool.on_pressure(pm::PressureLevel::critical);
    pool.wait_idle(std::chrono::seconds(60));
    if (!time_release) state.ResumeTiming();
    if (time_release) state.PauseTiming();
    pool.on_pressure(pm::PressureLevel::normal);
    pool.wait_idle(std::chrono::seconds(60));
    if (time_release) state.ResumeTiming();
  }
  if (pool.stats().pinned_slots != 5) state.SkipWithError("pool did not re-pin");
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 4 * (64 << 20));
}
BENCHMARK(BM_PoolPressureHalf)->ArgName("release")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

// What one pressure-monitor sample costs (justifies the 250 ms period).
void BM_SnapshotRead(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(pm::MemorySnapshot::read("/"));
}
BENCHMARK(BM_SnapshotRead)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("pin_method", std::string(pm::to_string(pinned().method())));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
