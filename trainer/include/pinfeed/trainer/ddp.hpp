#pragma once
// DdpEngine: PyTorch DDP's gradient synchronization over a Communicator.
//
// - broadcast_parameters(): rank 0's parameters to every rank, before training.
// - Gradients are grouped into buckets in reverse parameter order (the order
//   backward produces them), each at most `bucket_cap_bytes` (the first one
//   `first_bucket_bytes`, small so communication starts early). Because the
//   model keeps parameters in one flat buffer in forward order, a bucket is a
//   contiguous range and is all-reduced in place.
// - As soon as every gradient of a bucket is ready (grad_ready() from the
//   model's backward), the comm stream waits for the compute stream's event
//   and all-reduces the bucket (average over the world) while backward goes
//   on: a comm stream on a GPU, a comm worker thread on the CPU backend.
// - finish_backward() makes the compute stream wait for the last bucket, so the
//   optimizer step sees averaged gradients.
// - no_sync: with sync=false, backward only accumulates locally (gradient
//   accumulation); the next synchronized backward reduces the sum.
//
// Every rank issues the same all-reduces in the same order (buckets are
// launched strictly in bucket order), so the collectives always match.
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/device_backend.hpp"
#include "pinfeed/trainer/model.hpp"

namespace pinfeed::trainer {

struct DdpConfig {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20U;   ///< PyTorch's default, 25 MiB
  std::size_t first_bucket_bytes = std::size_t{1} << 20U;  ///< PyTorch's first bucket, 1 MiB
  void validate() const;
};

struct Bucket {
  std::size_t first_param = 0, last_param = 0;  ///< parameter indices, first_param >= last_param (reverse order)
  std::size_t offset = 0, count = 0;            ///< floats in the flat gradient buffer
};

class DdpEngine {
 public:
  DdpEngine(DeviceBackend& backend, Communicator& comm, const std::vector<ParamInfo>& params, float* weights,
            float* grads, DdpConfig config = {});

  [[nodiscard]] const std::vector<Bucket>& buckets() const noexcept { return buckets_; }
  [[nodiscard]] Stream& comm_stream() noexcept { return *comm_stream_; }

  /// Rank 0's weights to every rank; `compute` waits for them.
  void broadcast_parameters(Stream& compute);
  /// Starts a backward pass; sync=false is no_sync (accumulate locally).
  void begin_backward(bool sync);
  /// Parameter `param`'s gradient is complete on `compute`'s timeline.
  void grad_ready(std::size_t param, Stream& compute);
  /// `compute` waits until every bucket is reduced (a no-op under no_sync).
  /// Throws Error if a parameter reported no gradient.
  void finish_backward(Stream& compute);
  /// `count` floats of device memory reduced in place over every rank: after
  /// `compute`'s work so far and before its later work, on the comm stream,
  /// in one order with the buckets on every rank (SyncBN's statistics, the
  /// running statistics before evaluation).
  void collective(Stream& compute, float* data, std::size_t count, ReduceOp op);
  /// Profiling marks on the comm stream: before the first bucket's
  /// all-reduce and after the last one, in synchronized backwards.
  void set_comm_hooks(std::function<void(Stream&)> first, std::function<void(Stream&)> last) {
    first_hook_ = std::move(first);
    last_hook_ = std::move(last);
  }

 private:
  void launch_ready(Stream& compute);

  DeviceBackend& backend_;
  Communicator& comm_;
  std::vector<ParamInfo> params_;
  float* weights_;
  float* grads_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;  // param -> bucket
  std::vector<std::size_t> pending_;    // per bucket: gradients not yet ready in this backward
  std::size_t next_launch_ = 0;         // buckets are launched strictly in order
  bool sync_ = true;
  std::unique_ptr<Stream> comm_stream_;
  std::vector<std::shared_ptr<Event>> ready_events_;  // per bucket, recorded on compute
  std::shared_ptr<Event> done_;                       // recorded on the comm stream after the last bucket
  std::function<void(Stream&)> first_hook_, last_hook_;
  std::shared_ptr<Event> collective_ready_, collective_done_;  // reused: a wait takes the latest recording
};

}  // namespace pinfeed::trainer
