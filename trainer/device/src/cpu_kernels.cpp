// The CPU backend's math: each operation posted to its stream, run in
// order on the stream's thread (cpu_stream.hpp), as a GPU runs kernels.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "batch_norm_stats.hpp"
#include "cpu_stream.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"

namespace pinfeed::trainer {

using cpu_detail::give_room_to_openblas;
using cpu_detail::post;

void CpuBackend::gemm(Stream& s, const Gemm& g) {
  note_thread();
  post(s, [g] {
    give_room_to_openblas();
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, g.m, g.n,
                g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.ldc);
  });
}

void CpuBackend::normalize_u8(Stream& s, const std::uint8_t* nhwc, float* nchw, int n, int h, int w,
                              const Normalization& norm) {
  normalize_u8_as(s, nhwc, nchw, FloatType::f32, n, h, w, norm);
}

void CpuBackend::avg_pool(Stream& s, const float* nchw, float* out, int n, int c, int h, int w, int factor) {
  note_thread();
  post(s, [=] {
    const int oh = h / factor, ow = w / factor;
    const float inv = 1.0F / static_cast<float>(factor * factor);
    std::size_t o = 0;
    for (int plane = 0; plane < n * c; ++plane) {
      const float* in =
          nchw + static_cast<std::size_t>(plane) * static_cast<std::size_t>(h) * static_cast<std::size_t>(w);
      for (int y = 0; y < oh; ++y) {
        for (int x = 0; x < ow; ++x) {
          float sum = 0;
          for (int dy = 0; dy < factor; ++dy) {
            const float* row = in + static_cast<std::size_t>(y * factor + dy) * static_cast<std::size_t>(w) +
                               static_cast<std::size_t>(x * factor);
            for (int dx = 0; dx < factor; ++dx) sum += row[dx];
          }
          out[o++] = sum * inv;
        }
      }
    }
  });
}

void CpuBackend::bias_activation(Stream& s, float* z, const float* bias, float* a, int n, int d, bool relu) {
  note_thread();
  post(s, [=] {
    for (int i = 0; i < n; ++i) {
      float* zr = z + static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      float* ar = a + static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      for (int j = 0; j < d; ++j) {
        zr[j] += bias[j];
        ar[j] = relu ? std::max(zr[j], 0.0F) : zr[j];
      }
    }
  });
}

void CpuBackend::relu_backward(Stream& s, float* grad, const float* z, std::size_t count) {
  note_thread();
  post(s, [=] {
    for (std::size_t i = 0; i < count; ++i) grad[i] = z[i] > 0 ? grad[i] : 0.0F;
  });
}

void CpuBackend::bias_grad(Stream& s, const float* dz, float* db, int n, int d) {
  note_thread();
  post(s, [=] {
    for (int i = 0; i < n; ++i) {
      const float* row = dz + static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
      for (int j = 0; j < d; ++j) db[j] += row[j];
    }
  });
}

void CpuBackend::softmax_cross_entropy(Stream& s, const float* logits, const std::int32_t* labels, int n, int k,
                                       float scale, float* dlogits, float* stats) {
  note_thread();
  post(s, [=] {
    double loss = 0;
    int correct = 0;
    for (int i = 0; i < n; ++i) {
      const float* z = logits + static_cast<std::size_t>(i) * static_cast<std::size_t>(k);
      const int label = labels[i];
      int best = 0;
      for (int j = 1; j < k; ++j) best = z[j] > z[best] ? j : best;
      const float zmax = z[best];
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[j] - zmax));
      loss += std::log(sum) - static_cast<double>(z[label] - zmax);
      correct += best == label ? 1 : 0;
      if (dlogits != nullptr) {
        float* g = dlogits + static_cast<std::size_t>(i) * static_cast<std::size_t>(k);
        const float f = scale / static_cast<float>(n);
        for (int j = 0; j < k; ++j) {
          const auto p = static_cast<float>(std::exp(static_cast<double>(z[j] - zmax)) / sum);
          g[j] = f * (p - (j == label ? 1.0F : 0.0F));
        }
      }
    }
    stats[0] += static_cast<float>(loss);
    stats[1] += static_cast<float>(correct);
  });
}

void CpuBackend::sgd(Stream& s, float* w, float* grad, float* momentum, std::size_t count, const SgdStep& step) {
  note_thread();
  post(s, [=] {
    for (std::size_t i = 0; i < count; ++i) {
      const float g = grad[i] + step.weight_decay * w[i];
      momentum[i] = step.momentum * momentum[i] + g;
      w[i] -= step.lr * momentum[i];
    }
  });
}

void CpuBackend::scale(Stream& s, float* x, std::size_t count, float factor) {
  note_thread();
  post(s, [=] {
    for (std::size_t i = 0; i < count; ++i) x[i] *= factor;
  });
}

void CpuBackend::fill(Stream& s, float* x, std::size_t count, float value) {
  note_thread();
  post(s, [=] { std::fill(x, x + count, value); });
}

namespace {

std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

/// float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
std::uint16_t to_bf16(float f) noexcept {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFU) > 0x7F800000U) return static_cast<std::uint16_t>((u >> 16U) | 0x40U);
  u += 0x7FFFU + ((u >> 16U) & 1U);
  return static_cast<std::uint16_t>(u >> 16U);
}

/// float32 -> IEEE float16, round to nearest even, with subnormals,
/// overflow to infinity and NaN.
std::uint16_t to_f16(float f) noexcept {
  std::uint32_t x = float_bits(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16U) & 0x8000U);
  x &= 0x7FFFFFFFU;
  if (x >= 0x7F800000U) return static_cast<std::uint16_t>(sign | (x > 0x7F800000U ? 0x7E00U : 0x7C00U));
  if (x >= 0x477FF000U) return static_cast<std::uint16_t>(sign | 0x7C00U);  // rounds to >= 65520: infinity
  if (x < 0x38800000U) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
    float magnitude = 0;
    std::memcpy(&magnitude, &x, sizeof magnitude);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(magnitude * 16777216.0F)));
  }
  std::uint32_t h = x - 0x38000000U;  // exponent bias 127 -> 15
  h += 0x0FFFU + ((h >> 13U) & 1U);
  return static_cast<std::uint16_t>(sign | (h >> 13U));
}

}  // namespace

void CpuBackend::normalize_u8_as(Stream& s, const std::uint8_t* nhwc, void* nchw, FloatType type, int n, int h, int w,
                                 const Normalization& norm) {
  note_thread();
  post(s, [=] {
    const auto plane = static_cast<std::size_t>(h) * static_cast<std::size_t>(w);
    for (int c = 0; c < 3; ++c) {
      // The loader's float path computes x * (1 / (255 std)) - mean / std; so does this.
      const float sc = 1.0F / (255.0F * norm.std[static_cast<std::size_t>(c)]);
      const float bi = -norm.mean[static_cast<std::size_t>(c)] / norm.std[static_cast<std::size_t>(c)];
      for (int i = 0; i < n; ++i) {
        const std::uint8_t* in = nhwc + static_cast<std::size_t>(i) * plane * 3 + static_cast<std::size_t>(c);
        const std::size_t first = (static_cast<std::size_t>(i) * 3 + static_cast<std::size_t>(c)) * plane;
        const auto value = [&](std::size_t p) { return static_cast<float>(in[3 * p]) * sc + bi; };
        if (type == FloatType::f32) {
          float* out = static_cast<float*>(nchw) + first;
          for (std::size_t p = 0; p < plane; ++p) out[p] = value(p);
        } else {
          std::uint16_t* out = static_cast<std::uint16_t*>(nchw) + first;
          for (std::size_t p = 0; p < plane; ++p)
            out[p] = type == FloatType::f16 ? to_f16(value(p)) : to_bf16(value(p));
        }
      }
    }
  });
}

// ---- the CNN's layers ------------------------------------------------------

void CpuBackend::im2col(Stream& s, const float* x, std::size_t c_stride, std::size_t n_stride, const ConvShape& shape,
                        float* col) {
  note_thread();
  post(s, [=] {
    const int oh = shape.out_h(), ow = shape.out_w();
    const std::size_t cols = shape.columns();
    for (int ci = 0; ci < shape.c; ++ci) {
      for (int k = 0; k < 9; ++k) {
        const int ky = k / 3, kx = k % 3;
        float* row = col + (static_cast<std::size_t>(ci) * 9 + static_cast<std::size_t>(k)) * cols;
        for (int i = 0; i < shape.n; ++i) {
          const float* plane = x + static_cast<std::size_t>(ci) * c_stride + static_cast<std::size_t>(i) * n_stride;
          for (int y = 0; y < oh; ++y) {
            const int iy = y * shape.stride + ky - 1;
            float* out =
                row + (static_cast<std::size_t>(i) * static_cast<std::size_t>(oh) + static_cast<std::size_t>(y)) *
                          static_cast<std::size_t>(ow);
            for (int xo = 0; xo < ow; ++xo) {
              const int ix = xo * shape.stride + kx - 1;
              const bool inside = iy >= 0 && iy < shape.h && ix >= 0 && ix < shape.w;
              out[xo] = inside ? plane[static_cast<std::size_t>(iy) * static_cast<std::size_t>(shape.w) +
                                       static_cast<std::size_t>(ix)]
                               : 0.0F;
            }
          }
        }
      }
    }
  });
}

void CpuBackend::col2im(Stream& s, const float* col, const ConvShape& shape, float* dx) {
  note_thread();
  post(s, [=] {
    const int oh = shape.out_h(), ow = shape.out_w(), st = shape.stride;
    const std::size_t cols = shape.columns();
    std::size_t o = 0;
    for (int ci = 0; ci < shape.c; ++ci) {
      for (int i = 0; i < shape.n; ++i) {
        for (int iy = 0; iy < shape.h; ++iy) {
          for (int ix = 0; ix < shape.w; ++ix) {
            float sum = 0;
            for (int k = 0; k < 9; ++k) {
              const int ty = iy + 1 - k / 3, tx = ix + 1 - k % 3;  // y * stride, x * stride
              if (ty < 0 || tx < 0 || ty % st != 0 || tx % st != 0 || ty / st >= oh || tx / st >= ow) continue;
              sum +=
                  col[(static_cast<std::size_t>(ci) * 9 + static_cast<std::size_t>(k)) * cols +
                      (static_cast<std::size_t>(i) * static_cast<std::size_t>(oh) + static_cast<std::size_t>(ty / st)) *
                          static_cast<std::size_t>(ow) +
                      static_cast<std::size_t>(tx / st)];
            }
            dx[o++] = sum;
          }
        }
      }
    }
  });
}

void CpuBackend::bn_stats(Stream& s, const float* x, int c, std::size_t m, float* sums) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < c; ++r) {
      const float* row = x + static_cast<std::size_t>(r) * m;
      double sum = 0, sq = 0;
      for (std::size_t j = 0; j < m; ++j) {
        sum += row[j];
        sq += static_cast<double>(row[j]) * row[j];
      }
      sums[r] = static_cast<float>(sum);
      sums[c + r] = static_cast<float>(sq);
    }
  });
}

void CpuBackend::bn_forward(Stream& s, const float* x, const float* sums, const BatchNormArgs& a, float* xhat,
                            float* y) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < a.c; ++r) {
      const auto [mean, var] = batch_norm_moments(sums, a, r);
      const auto inv = static_cast<float>(1.0 / std::sqrt(var + a.eps));
      a.invstd[r] = inv;
      const auto mu = static_cast<float>(mean);
      const float g = a.gamma[r], b = a.beta[r];
      const std::size_t first = static_cast<std::size_t>(r) * a.m;
      for (std::size_t j = first; j < first + a.m; ++j) {
        const float h = (x[j] - mu) * inv;
        if (xhat != nullptr) xhat[j] = h;
        const float v = g * h + b;
        y[j] = a.relu ? std::max(v, 0.0F) : v;
      }
    }
  });
}

void CpuBackend::bn_backward_reduce(Stream& s, float* dy, const float* y, const float* xhat, const BatchNormArgs& a,
                                    float* red, float* dgamma, float* dbeta) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < a.c; ++r) {
      const std::size_t first = static_cast<std::size_t>(r) * a.m;
      double sum = 0, dot = 0;
      for (std::size_t j = first; j < first + a.m; ++j) {
        if (a.relu && !(y[j] > 0)) dy[j] = 0;
        sum += dy[j];
        dot += static_cast<double>(dy[j]) * xhat[j];
      }
      red[r] = static_cast<float>(sum);
      red[a.c + r] = static_cast<float>(dot);
      dbeta[r] += red[r];
      dgamma[r] += red[a.c + r];
    }
  });
}

void CpuBackend::bn_backward_input(Stream& s, const float* dy, const float* xhat, const float* red,
                                   const BatchNormArgs& a, float* dx) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < a.c; ++r) {
      const float k = a.gamma[r] * a.invstd[r];
      const float mean_dy = red[r] / a.count, mean_dot = red[a.c + r] / a.count;
      const std::size_t first = static_cast<std::size_t>(r) * a.m;
      for (std::size_t j = first; j < first + a.m; ++j) dx[j] = k * (dy[j] - mean_dy - xhat[j] * mean_dot);
    }
  });
}

void CpuBackend::channel_mean(Stream& s, const float* x, int c, int n, std::size_t hw, float* out) {
  note_thread();
  post(s, [=] {
    for (int r = 0; r < c; ++r) {
      for (int i = 0; i < n; ++i) {
        const float* p =
            x + (static_cast<std::size_t>(r) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i)) * hw;
        double sum = 0;
        for (std::size_t j = 0; j < hw; ++j) sum += p[j];
        out[static_cast<std::size_t>(i) * static_cast<std::size_t>(c) + static_cast<std::size_t>(r)] =
            static_cast<float>(sum / static_cast<double>(hw));
      }
    }
  });
}

void CpuBackend::channel_mean_backward(Stream& s, const float* dout, int c, int n, std::size_t hw, float* dx) {
  note_thread();
  post(s, [=] {
    const float inv = 1.0F / static_cast<float>(hw);
    for (int r = 0; r < c; ++r) {
      for (int i = 0; i < n; ++i) {
        const float g =
            dout[static_cast<std::size_t>(i) * static_cast<std::size_t>(c) + static_cast<std::size_t>(r)] * inv;
        float* p = dx + (static_cast<std::size_t>(r) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i)) * hw;
        std::fill(p, p + hw, g);
      }
    }
  });
}

void CpuBackend::widen_labels(Stream& s, const std::int32_t* in, std::int64_t* out, std::size_t n) {
  note_thread();
  post(s, [=] { std::copy(in, in + n, out); });
}

}  // namespace pinfeed::trainer
