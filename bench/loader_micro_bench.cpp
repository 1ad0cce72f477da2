// Micro-benchmarks of the per-sample path (Google Benchmark): what each
// decode trick saves and what the transform costs, on one synthetic
// 500x375 JPEG (~100 KB, quality 90, 4:2:0).
//
//   build/release/bench/pinfeed-loader-bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true   (one command line)
#include <benchmark/benchmark.h>

#include <vector>

#include "pinfeed/loader/jpeg_decoder.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/loader/synthetic.hpp"
#include "pinfeed/loader/transform.hpp"
#include "pinfeed/memory/pageable_resource.hpp"
#include "pinfeed/memory/pinned_resource.hpp"

namespace {

namespace pl = pinfeed::loader;

const std::vector<std::byte>& jpeg() {
  static const std::vector<std::byte> data = pl::make_synthetic_jpeg(0, 3, 1, pl::SyntheticImageSpec{});
  return data;
}

void BM_DecodeFull(benchmark::State& state) {
  pl::JpegDecoder d;
  pl::DecodedImage img;
  for (auto _ : state) d.decode_full(jpeg(), img, "bench");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}
BENCHMARK(BM_DecodeFull)->Unit(benchmark::kMicrosecond);

// RandomResizedCrop plans over many samples: arg 0 = decode whole images,
// 1 = ROI (crop columns, skip rows above, stop after the last), 2 = ROI + DCT scaling.
void BM_DecodePlanned(benchmark::State& state) {
  pl::TransformConfig t;
  t.roi_decode = state.range(0) >= 1;
  t.dct_scaling = state.range(0) >= 2;
  pl::JpegDecoder d;
  pl::DecodedImage img;
  std::uint64_t i = 0;
  for (auto _ : state) {
    pl::SampleRng rng(0, 0, i++ % 512);
    d.decode_planned(
        jpeg(),
        [&](const pl::ImageHeader& h) {
          const pl::CropPlan p = pl::plan_crop(h, t, rng);
          return t.roi_decode ? pl::JpegDecoder::Plan{p.region, p.scale}
                              : pl::JpegDecoder::Plan{pl::Region{0, 0, h.width, h.height}, 1};
        },
        img, "bench");
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}
BENCHMARK(BM_DecodePlanned)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond);

// Resize a 300x250 region to 224x224, flip, write: arg 0 = float32 NCHW normalized, 1 = uint8 NHWC.
void BM_SampleWriter(benchmark::State& state) {
  pl::TransformConfig t;
  t.layout = state.range(0) == 0 ? pl::Layout::nchw_f32 : pl::Layout::nhwc_u8;
  pl::SampleWriter w(t);
  pl::DecodedImage img;
  img.width = 300;
  img.height = 250;
  img.pixels.assign(300 * 250 * 4, 100);
  std::vector<std::byte> out(t.sample_bytes());
  bool flip = false;
  for (auto _ : state) {
    w.write(img, pl::Region{}, flip, out);
    flip = !flip;
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}
BENCHMARK(BM_SampleWriter)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// The same, writing each sample to the next place in a 147 MiB buffer (the
// demo's pool: 4 slots of 64 float32 samples), so the output is cold as in
// the pipeline: arg 0 = pinned (the pool's PinnedResource), 1 = pageable.
void BM_SampleWriterColdOutput(benchmark::State& state) {
  pl::TransformConfig t;
  pl::SampleWriter w(t);
  pl::DecodedImage img;
  img.width = 300;
  img.height = 250;
  img.pixels.assign(300 * 250 * 4, 100);
  const std::size_t samples = 256, bytes = samples * t.sample_bytes();
  std::unique_ptr<pinfeed::memory::HostResource> resource;
  if (state.range(0) == 0) {
    resource = std::make_unique<pinfeed::memory::PinnedResource>();
  } else {
    resource = std::make_unique<pinfeed::memory::PageableResource>();
  }
  auto* base = static_cast<std::byte*>(resource->allocate(bytes, 4096));
  std::size_t k = 0;
  bool flip = false;
  for (auto _ : state) {
    w.write(img, pl::Region{}, flip, std::span<std::byte>(base + (k++ % samples) * t.sample_bytes(), t.sample_bytes()));
    flip = !flip;
    benchmark::ClobberMemory();
  }
  resource->deallocate(base, bytes, 4096);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}
BENCHMARK(BM_SampleWriterColdOutput)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
