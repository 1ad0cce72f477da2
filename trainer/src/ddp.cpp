#include "pinfeed/trainer/ddp.hpp"

#include <fmt/format.h>

namespace pinfeed::trainer {

void DdpConfig::validate() const {
  if (bucket_cap_bytes < sizeof(float))
    throw ConfigError(fmt::format("ddp bucket_cap_bytes must be >= 4, got {}", bucket_cap_bytes));
  if (first_bucket_bytes < sizeof(float))
    throw ConfigError(fmt::format("ddp first_bucket_bytes must be >= 4, got {}", first_bucket_bytes));
}

DdpEngine::DdpEngine(DeviceBackend& backend, Communicator& comm, const std::vector<ParamInfo>& params, float* weights,
                     float* grads, DdpConfig config)
    : backend_(backend),
      comm_(comm),
      params_(params),
      weights_(weights),
      grads_(grads),
      bucket_of_(params.size()),
      comm_stream_(backend.create_copy_stream()),
      done_(backend.create_event()),
      collective_ready_(backend.create_event()),
      collective_done_(backend.create_event()) {
  config.validate();
  if (params_.empty()) throw ConfigError("ddp: the model has no parameters");
  // Reverse order; a bucket closes once it reaches its cap (PyTorch's rule).
  std::size_t cap = config.first_bucket_bytes;
  Bucket current;
  bool open = false;
  for (std::size_t i = params_.size(); i-- > 0;) {
    if (!open) {
      current = Bucket{i, i, params_[i].offset, 0};
      open = true;
    }
    current.last_param = i;
    current.offset = params_[i].offset;
    current.count += params_[i].count;
    bucket_of_[i] = buckets_.size();
    if (current.count * sizeof(float) >= cap) {
      buckets_.push_back(current);
      open = false;
      cap = config.bucket_cap_bytes;
    }
  }
  if (open) buckets_.push_back(current);
  for (std::size_t b = 0; b < buckets_.size(); ++b) ready_events_.push_back(backend.create_event());
  pending_.assign(buckets_.size(), 0);
}

void DdpEngine::broadcast_parameters(Stream& compute) {
  const std::size_t first = params_.front().offset;
  const std::size_t total = params_.back().offset + params_.back().count - first;
  auto ev = backend_.create_event();
  backend_.record(*ev, compute);
  backend_.stream_wait(*comm_stream_, *ev);
  comm_.broadcast(*comm_stream_, weights_ + first, total, 0);
  backend_.record(*done_, *comm_stream_);
  backend_.stream_wait(compute, *done_);
}

void DdpEngine::begin_backward(bool sync) {
  sync_ = sync;
  next_launch_ = 0;
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = buckets_[b].first_param - buckets_[b].last_param + 1;
  }
}

void DdpEngine::grad_ready(std::size_t param, Stream& compute) {
  if (param >= params_.size()) throw Error(fmt::format("ddp: no parameter {}", param));
  std::size_t& p = pending_[bucket_of_[param]];
  if (p == 0) throw Error(fmt::format("ddp: gradient of {} reported twice in one backward", params_[param].name));
  --p;
  launch_ready(compute);
}

void DdpEngine::launch_ready(Stream& compute) {
  while (next_launch_ < buckets_.size() && pending_[next_launch_] == 0) {
    const Bucket& b = buckets_[next_launch_];
    if (sync_) {
      Event& ev = *ready_events_[next_launch_];
      backend_.record(ev, compute);
      backend_.stream_wait(*comm_stream_, ev);
      if (next_launch_ == 0 && first_hook_) first_hook_(*comm_stream_);
      comm_.all_reduce(*comm_stream_, grads_ + b.offset, b.count, ReduceOp::average);
    }
    ++next_launch_;
  }
}

void DdpEngine::finish_backward(Stream& compute) {
  if (next_launch_ != buckets_.size()) {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (pending_[b] != 0) {
        throw Error(fmt::format("ddp: backward finished with {} gradient(s) of bucket {} (from {}) not reported",
                                pending_[b], b, params_[buckets_[b].first_param].name));
      }
    }
  }
  if (!sync_) return;
  if (last_hook_) last_hook_(*comm_stream_);
  backend_.record(*done_, *comm_stream_);
  backend_.stream_wait(compute, *done_);
}

void DdpEngine::collective(Stream& compute, float* data, std::size_t count, ReduceOp op) {
  backend_.record(*collective_ready_, compute);
  backend_.stream_wait(*comm_stream_, *collective_ready_);
  comm_.all_reduce(*comm_stream_, data, count, op);
  backend_.record(*collective_done_, *comm_stream_);
  backend_.stream_wait(compute, *collective_done_);
}

}  // namespace pinfeed::trainer
