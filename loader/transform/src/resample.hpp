#pragma once
// The resampler's kernels and loops, shared by the sample writer
// (sample_writer.cpp) and defined in resample.cpp. Private to loader/transform.
#include <cstddef>
#include <cstdint>

#include "pinfeed/loader/transform.hpp"

namespace pinfeed::loader::detail {

/// A crop, then a resize of it (RandomResizedCrop, and the whole image).
ResampleAxis crop_axis(int start, int length, int out);
/// The filter's half-width at scale 1 (PIL's filter->support).
double filter_support(Interpolation f) noexcept;
/// PIL's filter functions of the distance in source pixels at scale 1.
double filter_weight(Interpolation f, double x) noexcept;

/// PIL's resample kernel for one axis of `n` outputs, in the coordinates of
/// rows decoded at 1/dct size starting at source pixel `origin`, `size` of
/// them; taps padded to a multiple of `multiple` (resample.cpp).
void make_kernel(const ResampleAxis& axis, int n, int dct, int origin, int size, Interpolation filter, int multiple,
                 SampleWriter::Kernel& k);
/// The kernel's taps regrouped for `lanes` output pixels per AVX2/AVX-512 step.
void make_quads(SampleWriter::Kernel& k, int lanes);
/// One row through a kernel (the horizontal pass), at SIMD level `simd`.
void resample_row(const std::uint8_t* in, int size, const SampleWriter::Kernel& k, std::uint8_t* out, SimdLevel simd);
/// One output row from `count` rows weighted by `w` (the vertical pass).
void resample_rows(const std::uint8_t* const* rows, const std::int16_t* w, int count, std::size_t bytes,
                   std::uint8_t* out, SimdLevel simd);

}  // namespace pinfeed::loader::detail
