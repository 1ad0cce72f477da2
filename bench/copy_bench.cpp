// pinfeed-bench copy: host-to-device copies from pinned and from pageable memory.
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

/// Host-to-device copies through the trainer's backend, from a pinned buffer
/// and from a pageable one of the same size: what a pool slot costs once
/// pressure has moved it to pageable memory.
int run_copy_bench(const std::string& device, std::size_t mib, std::size_t repeat, bool as_json) {
  namespace pt = pinfeed::trainer;
  const pt::DeviceSpec spec = pt::parse_devices(device);
  if (spec.count != 1 && !spec.all) throw pinfeed::ConfigError("copy: give one device (cpu or cuda:N)");
  const pt::DeviceType& type = pt::device_type(spec.kind);
  std::unique_ptr<pt::DeviceBackend> backend =
      type.make_backend(type.indexed && !spec.devices.empty() ? spec.devices.front() : 0, pt::BackendOptions{});
  backend->make_current();  // this thread drives the device
  const std::size_t bytes = mib << 20U;
  pinfeed::memory::PinnedResource pinned;
  pinfeed::memory::PageableResource pageable;
  void* hp = pinned.allocate(bytes, 4096);
  void* hq = pageable.allocate(bytes, 4096);
  std::memset(hp, 1, bytes);
  std::memset(hq, 1, bytes);
  auto dev = backend->allocate(bytes);
  auto stream = backend->create_stream();
  const auto time_copy = [&](void* src) {
    const auto t0 = std::chrono::steady_clock::now();
    backend->copy_h2d(*stream, dev.get(), src, bytes);
    backend->synchronize(*stream);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> tp, tq;
  for (std::size_t r = 0; r < repeat + 1; ++r) {  // the first round warms up
    const double a = time_copy(hp), b = time_copy(hq);
    if (r == 0) continue;
    tp.push_back(a);
    tq.push_back(b);
  }
  const double mp = median(tp), mq = median(tq);
  const double gp = static_cast<double>(bytes) / mp / 1e9, gq = static_cast<double>(bytes) / mq / 1e9;
  pinned.deallocate(hp, bytes, 4096);
  pageable.deallocate(hq, bytes, 4096);
  if (as_json) {
    fmt::print("{}\n", json{{"device", backend->name()},
                            {"bytes", bytes},
                            {"repeat", repeat},
                            {"pinned_seconds", mp},
                            {"pageable_seconds", mq},
                            {"pinned_gb_per_s", gp},
                            {"pageable_gb_per_s", gq},
                            {"pageable_over_pinned", mq / mp}}
                           .dump(2));
    return 0;
  }
  fmt::print("pinfeed-bench copy: {} MiB host -> {} (medians of {})\n", mib, backend->name(), repeat);
  fmt::print("  from pinned memory     {:8.3f} ms  {:6.2f} GB/s\n", mp * 1e3, gp);
  fmt::print("  from pageable memory   {:8.3f} ms  {:6.2f} GB/s   ({:.2f}x the pinned time)\n", mq * 1e3, gq, mq / mp);
  return 0;
}

}  // namespace pinfeed::bench
