// Note [The reference CNN]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Blocks of conv3x3 (stride 2, padding 1, no bias) -> BatchNorm -> ReLU,
// then global average pooling and a linear classifier: the smallest model
// whose accuracy needs more than a colour average (textures), whose compute
// is real (a 64 px image costs ~10 M multiply-adds forward with cnn:32,64,128), and
// whose BatchNorm makes data parallelism differ from one worker unless the
// statistics are synchronized (SyncBN).
//
// Activations are "CNHW": channel-major, every sample's every pixel of a
// channel in one row. Then a convolution is one GEMM over the whole batch,
//   z (out x n*oh*ow) = W (out x in*9) . col (in*9 x n*oh*ow),
// (im2col builds col; the first block reads the NCHW images directly), and
// BatchNorm reduces contiguous rows. Backward:
//   dW += dz . col^T,   dcol = W^T . dz  (into col, no longer needed),
//   dx = col2im(dcol)   (gathered per element: deterministic).
//
// BatchNorm in data parallel: per worker, each worker's statistics are its
// own samples' (what DDP does). With SyncBN the per-channel sums (sum x,
// sum x^2) and, in backward, (sum dy, sum dy*xhat) are summed over every
// worker before use, with count = every worker's values: N workers with
// B/N samples each then compute exactly what one worker with B computes
// (the derivation is in docs/architecture.md, "SyncBN"). Parameter
// gradients stay local and DDP averages them, as with any parameter.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/sample_rng.hpp"
#include "pinfeed/trainer/model.hpp"

namespace pinfeed::trainer {

namespace {

void validate_cnn(const ModelConfig& c) {
  if (c.channels.empty() || c.channels.size() > 8) {
    throw ConfigError(fmt::format("model {}: a cnn has 1..8 blocks, not {}", c.spec(), c.channels.size()));
  }
  for (const int w : c.channels) {
    if (w < 1 || w > 4096)
      throw ConfigError(fmt::format("model {}: a block width must be 1..4096, not {}", c.spec(), w));
  }
}

std::unique_ptr<Model> make_cnn(DeviceBackend& backend, const ModelConfig& config, int max_batch) {
  return std::make_unique<Cnn>(backend, config, max_batch);
}

}  // namespace

const ModelType& cnn_model_type() {
  static const ModelType t{ModelKind::cnn,           "cnn", "C,C...",     &ModelConfig::channels,
                           /*uses_pool=*/false,
                           /*uses_batch_norm=*/true, {},    validate_cnn, make_cnn};
  return t;
}

Cnn::Cnn(DeviceBackend& backend, ModelConfig config, int max_batch) : Model(backend, std::move(config), max_batch) {
  int in = 3, side = config_.image_size;
  std::size_t widest = 0;
  for (std::size_t k = 0; k < config_.channels.size(); ++k) {
    Block b;
    b.out = config_.channels[k];
    b.shape = ConvShape{max_batch, in, side, side, 2};
    // The GEMMs take int dimensions: n * oh * ow and in * 9 must fit.
    if (b.shape.columns() > static_cast<std::size_t>(std::numeric_limits<int>::max()) ||
        static_cast<long long>(in) * 9 > std::numeric_limits<int>::max()) {
      throw ConfigError(
          fmt::format("model {}: block {} of a batch of {} at {} px is too large for one GEMM; lower "
                      "the batch or the image size",
                      config_.spec(), k + 1, max_batch, side));
    }
    b.conv = add_param(fmt::format("conv{}.weight", k + 1),
                       static_cast<std::size_t>(b.out) * static_cast<std::size_t>(in) * 9);
    b.gamma = add_param(fmt::format("bn{}.weight", k + 1), static_cast<std::size_t>(b.out));
    b.beta = add_param(fmt::format("bn{}.bias", k + 1), static_cast<std::size_t>(b.out));
    blocks_.push_back(std::move(b));
    in = config_.channels[k];
    side = blocks_.back().shape.out_h();
  }
  fc_w_ = add_param("fc.weight", static_cast<std::size_t>(config_.classes) * static_cast<std::size_t>(in));
  fc_b_ = add_param("fc.bias", static_cast<std::size_t>(config_.classes));
  allocate_params();
  for (Block& b : blocks_) {
    const std::size_t m = b.shape.columns(), out = static_cast<std::size_t>(b.out);
    b.col = floats(static_cast<std::size_t>(b.shape.c) * 9 * m);
    b.z = floats(out * m);
    b.xhat = floats(out * m);
    b.y = floats(out * m);
    b.invstd = floats(out);
    b.sums = floats(2 * out);
    b.red = floats(2 * out);
    widest = std::max(widest, out * m);
    b.running = buffer_count_;  // running_mean, then running_var: out floats each
    buffer_count_ += 2 * out;
  }
  buffers_ = floats(buffer_count_);
  const auto mb = static_cast<std::size_t>(max_batch);
  pooled_ = floats(mb * static_cast<std::size_t>(in));
  dpooled_ = floats(mb * static_cast<std::size_t>(in));
  logits_ = floats(mb * static_cast<std::size_t>(config_.classes));
  dlogits_ = floats(mb * static_cast<std::size_t>(config_.classes));
  g_ = floats(widest);
  dz_ = floats(widest);
}

std::vector<float> Cnn::initial_weights(std::uint64_t seed) const {
  std::vector<float> w(count_);
  const auto uniform = [&](std::size_t p, double fan_in) {
    loader::SampleRng rng(seed, 0x6d6f64656cULL, p);  // "model"
    const double bound = 1.0 / std::sqrt(fan_in);
    const ParamInfo& info = params_[p];
    for (std::size_t i = 0; i < info.count; ++i) w[info.offset + i] = static_cast<float>(rng.uniform(-bound, bound));
  };
  for (const Block& b : blocks_) {
    uniform(b.conv, b.shape.c * 9.0);
    std::fill_n(w.begin() + static_cast<std::ptrdiff_t>(params_[b.gamma].offset), params_[b.gamma].count, 1.0F);
    std::fill_n(w.begin() + static_cast<std::ptrdiff_t>(params_[b.beta].offset), params_[b.beta].count, 0.0F);
  }
  uniform(fc_w_, blocks_.back().out);
  uniform(fc_b_, blocks_.back().out);
  return w;
}

std::vector<float> Cnn::initial_buffers() const {
  std::vector<float> v;
  v.resize(buffer_count_);
  for (const Block& b : blocks_) {
    const auto out = static_cast<std::ptrdiff_t>(b.out);
    const auto mean = v.begin() + static_cast<std::ptrdiff_t>(b.running);
    std::fill(mean, mean + out, 0.0F);            // running_mean
    std::fill(mean + out, mean + 2 * out, 1.0F);  // running_var
  }
  return v;
}

void Cnn::set_sync(int world, AllReduceSum sum) {
  if (!config_.sync_bn || world <= 1) return;
  world_ = world;
  sum_ = std::move(sum);
}

BatchNormArgs Cnn::bn_args(const Block& b, int n, bool training) const {
  BatchNormArgs a;
  a.c = b.out;
  ConvShape sh = b.shape;
  sh.n = n;
  a.m = sh.columns();
  a.count = static_cast<float>(a.m) * static_cast<float>(training && sum_ ? world_ : 1);
  a.gamma = weights() + params_[b.gamma].offset;
  a.beta = weights() + params_[b.beta].offset;
  a.running_mean = buffers() + b.running;
  a.running_var = a.running_mean + b.out;
  a.invstd = b.invstd.as<float>();
  return a;
}

void Cnn::forward(Stream& s, const float* images, int n, bool training) {
  check_batch(n);
  const float* x = images;
  const auto side = static_cast<std::size_t>(config_.image_size);
  std::size_t c_stride = side * side, n_stride = 3 * side * side;  // NCHW images
  for (std::size_t k = 0; k < blocks_.size(); ++k) {
    Block& b = blocks_[k];
    ConvShape sh = b.shape;
    sh.n = n;
    const std::size_t m = sh.columns();
    backend_.im2col(s, x, c_stride, n_stride, sh, b.col.as<float>());
    Gemm g;  // z = W . col
    g.m = b.out;
    g.n = static_cast<int>(m);
    g.k = sh.c * 9;
    g.a = weights() + params_[b.conv].offset;
    g.lda = sh.c * 9;
    g.b = b.col.as<float>();
    g.ldb = static_cast<int>(m);
    g.c = b.z.as<float>();
    g.ldc = static_cast<int>(m);
    backend_.gemm(s, g);
    const BatchNormArgs a = bn_args(b, n, training);
    if (training) {
      backend_.bn_stats(s, b.z.as<float>(), b.out, m, b.sums.as<float>());
      if (sum_) sum_(s, b.sums.as<float>(), 2 * static_cast<std::size_t>(b.out));
      backend_.bn_forward(s, b.z.as<float>(), b.sums.as<float>(), a, b.xhat.as<float>(), b.y.as<float>());
    } else {
      backend_.bn_forward(s, b.z.as<float>(), nullptr, a, nullptr, b.y.as<float>());
    }
    x = b.y.as<float>();
    const auto hw = static_cast<std::size_t>(sh.out_h()) * static_cast<std::size_t>(sh.out_w());
    c_stride = static_cast<std::size_t>(n) * hw;  // CNHW from here on
    n_stride = hw;
  }
  const Block& last = blocks_.back();
  const auto hw = static_cast<std::size_t>(last.shape.out_h()) * static_cast<std::size_t>(last.shape.out_w());
  backend_.channel_mean(s, last.y.as<float>(), last.out, n, hw, pooled_.as<float>());
  Gemm g;  // logits = pooled . W^T
  g.trans_b = true;
  g.m = n;
  g.n = config_.classes;
  g.k = last.out;
  g.a = pooled_.as<float>();
  g.lda = last.out;
  g.b = weights() + params_[fc_w_].offset;
  g.ldb = last.out;
  g.c = logits_.as<float>();
  g.ldc = config_.classes;
  backend_.gemm(s, g);
  backend_.bias_activation(s, logits_.as<float>(), weights() + params_[fc_b_].offset, logits_.as<float>(), n,
                           config_.classes, false);
}

void Cnn::train_step(Stream& s, const float* images, const std::int32_t* labels, int n, float loss_scale, float* stats,
                     const GradReady& ready) {
  forward(s, images, n, true);
  backend_.softmax_cross_entropy(s, logits_.as<float>(), labels, n, config_.classes, loss_scale, dlogits_.as<float>(),
                                 stats);
  if (forward_hook_) forward_hook_(s);
  backward_head(s, n, ready);
  for (std::size_t idx = blocks_.size(); idx-- > 0;) backward_block(s, idx, n, ready);
}

void Cnn::backward_head(Stream& s, int n, const GradReady& ready) {
  const Block& last = blocks_.back();
  const int k = config_.classes;
  Gemm gw;  // dW_fc += dlogits^T . pooled
  gw.trans_a = true;
  gw.m = k;
  gw.n = last.out;
  gw.k = n;
  gw.a = dlogits_.as<float>();
  gw.lda = k;
  gw.b = pooled_.as<float>();
  gw.ldb = last.out;
  gw.beta = 1;
  gw.c = grads() + params_[fc_w_].offset;
  gw.ldc = last.out;
  backend_.gemm(s, gw);
  backend_.bias_grad(s, dlogits_.as<float>(), grads() + params_[fc_b_].offset, n, k);
  if (ready) {
    ready(fc_b_);
    ready(fc_w_);
  }
  Gemm gp;  // dpooled = dlogits . W_fc
  gp.m = n;
  gp.n = last.out;
  gp.k = k;
  gp.a = dlogits_.as<float>();
  gp.lda = k;
  gp.b = weights() + params_[fc_w_].offset;
  gp.ldb = last.out;
  gp.c = dpooled_.as<float>();
  gp.ldc = last.out;
  backend_.gemm(s, gp);
  const auto last_hw = static_cast<std::size_t>(last.shape.out_h()) * static_cast<std::size_t>(last.shape.out_w());
  backend_.channel_mean_backward(s, dpooled_.as<float>(), last.out, n, last_hw, g_.as<float>());
}

void Cnn::backward_block(Stream& s, std::size_t idx, int n, const GradReady& ready) {
  Block& b = blocks_[idx];
  ConvShape sh = b.shape;
  sh.n = n;
  const std::size_t m = sh.columns();
  const BatchNormArgs a = bn_args(b, n, true);
  float* dgamma = grads() + params_[b.gamma].offset;
  float* dbeta = grads() + params_[b.beta].offset;
  backend_.bn_backward_reduce(s, g_.as<float>(), b.y.as<float>(), b.xhat.as<float>(), a, b.red.as<float>(), dgamma,
                              dbeta);
  if (sum_) sum_(s, b.red.as<float>(), 2 * static_cast<std::size_t>(b.out));
  backend_.bn_backward_input(s, g_.as<float>(), b.xhat.as<float>(), b.red.as<float>(), a, dz_.as<float>());
  if (ready) {
    ready(b.beta);
    ready(b.gamma);
  }
  Gemm g;  // dW += dz . col^T
  g.trans_b = true;
  g.m = b.out;
  g.n = sh.c * 9;
  g.k = static_cast<int>(m);
  g.a = dz_.as<float>();
  g.lda = static_cast<int>(m);
  g.b = b.col.as<float>();
  g.ldb = static_cast<int>(m);
  g.beta = 1;
  g.c = grads() + params_[b.conv].offset;
  g.ldc = sh.c * 9;
  backend_.gemm(s, g);
  if (ready) ready(b.conv);
  if (idx == 0) return;  // no gradient for the images
  Gemm gc;               // dcol = W^T . dz, into col (read by the dW above already)
  gc.trans_a = true;
  gc.m = sh.c * 9;
  gc.n = static_cast<int>(m);
  gc.k = b.out;
  gc.a = weights() + params_[b.conv].offset;
  gc.lda = sh.c * 9;
  gc.b = dz_.as<float>();
  gc.ldb = static_cast<int>(m);
  gc.c = b.col.as<float>();
  gc.ldc = static_cast<int>(m);
  backend_.gemm(s, gc);
  backend_.col2im(s, b.col.as<float>(), sh, g_.as<float>());  // the gradient at the previous block's y
}

void Cnn::evaluate(Stream& s, const float* images, const std::int32_t* labels, int n, float* stats) {
  forward(s, images, n, false);
  backend_.softmax_cross_entropy(s, logits_.as<float>(), labels, n, config_.classes, 1.0F, nullptr, stats);
}

}  // namespace pinfeed::trainer
