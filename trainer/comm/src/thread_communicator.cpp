// ThreadCommunicator: CPU ranks as threads of one process. Each collective is
// a rendezvous of every rank's comm stream: all ranks publish their buffers,
// then each rank reduces one disjoint chunk of the elements across every
// buffer (in rank order, so the result is the same whatever the chunking),
// writes the result into every buffer, and all meet again before anyone
// returns (nobody's buffer is still being written when its owner goes on).
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"

namespace pinfeed::trainer {

namespace {

struct Call {
  std::string op;
  std::size_t count = 0;
  int root = 0;
  float* data = nullptr;
};

class Group {
 public:
  Group(int size, CommConfig config)
      : size_(size),
        config_(config),
        calls_(static_cast<std::size_t>(size)),
        arrived_(static_cast<std::size_t>(size), false) {}

  void all_reduce(int rank, float* data, std::size_t count, ReduceOp op) {
    const Call c{op == ReduceOp::sum ? "all_reduce(sum)" : "all_reduce(average)", count, 0, data};
    publish(rank, c);
    const auto n = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank);
    const std::size_t lo = count * r / n, hi = count * (r + 1) / n;
    for (std::size_t i = lo; i < hi; ++i) {
      float sum = 0;
      for (std::size_t k = 0; k < n; ++k) sum += calls_[k].data[i];
      if (op == ReduceOp::average) sum /= static_cast<float>(size_);
      for (std::size_t k = 0; k < n; ++k) calls_[k].data[i] = sum;
    }
    meet(rank, c);
  }

  void broadcast(int rank, float* data, std::size_t count, int root) {
    const Call c{"broadcast", count, root, data};
    publish(rank, c);
    if (rank != root) std::memcpy(data, calls_[static_cast<std::size_t>(root)].data, count * sizeof(float));
    meet(rank, c);
  }

  void barrier(int rank) {
    const Call c{"barrier", 0, 0, nullptr};
    publish(rank, c);
    meet(rank, c);
  }

  void abort(const std::string& why) noexcept {
    {
      const std::scoped_lock lock(mutex_);
      if (aborted_.empty()) aborted_ = why.empty() ? std::string("aborted") : why;
    }
    cv_.notify_all();
  }

 private:
  /// Stores this rank's call and waits for all; then checks they agree.
  void publish(int rank, const Call& c) {
    {
      const std::scoped_lock lock(mutex_);
      calls_[static_cast<std::size_t>(rank)] = c;
    }
    meet(rank, c);
    for (int k = 0; k < size_; ++k) {
      const Call& o = calls_[static_cast<std::size_t>(k)];
      if (o.op != c.op || o.count != c.count || o.root != c.root) {
        const std::string why = fmt::format(
            "ranks disagree: rank {} called {} of {} floats (root {}), rank {} called {} of {} floats (root {})", rank,
            c.op, c.count, c.root, k, o.op, o.count, o.root);
        abort(why);
        throw CommError(rank, c.op, c.count * sizeof(float), why);
      }
    }
  }

  /// A generation barrier with a timeout and abort.
  void meet(int rank, const Call& c) {
    std::unique_lock lock(mutex_);
    if (!aborted_.empty()) throw CommError(rank, c.op, c.count * sizeof(float), "group aborted: " + aborted_);
    const std::uint64_t gen = generation_;
    arrived_[static_cast<std::size_t>(rank)] = true;
    if (++count_ == size_) {
      count_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), false);
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool done = cv_.wait_for(lock, config_.timeout, [&] { return generation_ != gen || !aborted_.empty(); });
    if (generation_ != gen) return;
    if (done) throw CommError(rank, c.op, c.count * sizeof(float), "group aborted: " + aborted_);
    std::string missing;
    for (int k = 0; k < size_; ++k) {
      if (!arrived_[static_cast<std::size_t>(k)]) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", k);
    }
    const std::string why = fmt::format("{} (waiting for rank(s) {})", timeout_reason(config_.timeout), missing);
    aborted_ = fmt::format("rank {}: {} {}", rank, c.op, why);
    cv_.notify_all();
    throw CommError(rank, c.op, c.count * sizeof(float), why);
  }

  const int size_;
  const CommConfig config_;
  std::mutex mutex_;  // guards everything below; calls_[k] is read unlocked between two meets
  std::condition_variable cv_;
  std::vector<Call> calls_;
  std::vector<bool> arrived_;
  int count_ = 0;
  std::uint64_t generation_ = 0;
  std::string aborted_;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Group> group, int rank, int size, CpuBackend* backend)
      : group_(std::move(group)), rank_(rank), size_(size), backend_(backend) {}

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] std::string name() const override { return "threads"; }

  void all_reduce(Stream& s, float* data, std::size_t count, ReduceOp op) override {
    backend_->enqueue(s, [g = group_, r = rank_, data, count, op] { g->all_reduce(r, data, count, op); });
  }
  void broadcast(Stream& s, float* data, std::size_t count, int root) override {
    if (root < 0 || root >= size_) throw ConfigError(fmt::format("broadcast root {} is not a rank of {}", root, size_));
    backend_->enqueue(s, [g = group_, r = rank_, data, count, root] { g->broadcast(r, data, count, root); });
  }
  void barrier() override { group_->barrier(rank_); }
  void abort(const std::string& why) noexcept override { group_->abort(fmt::format("rank {}: {}", rank_, why)); }

 private:
  std::shared_ptr<Group> group_;
  int rank_, size_;
  CpuBackend* backend_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_group(const std::vector<DeviceBackend*>& devices,
                                                             CommConfig config) {
  if (devices.empty()) throw ConfigError("thread communicator: no ranks");
  std::vector<CpuBackend*> backends;
  for (DeviceBackend* d : devices) {
    auto* cpu = dynamic_cast<CpuBackend*>(d);
    if (cpu == nullptr) throw ConfigError(fmt::format("thread communicator: {} is not a CPU backend", d->name()));
    backends.push_back(cpu);
  }
  const auto size = static_cast<int>(backends.size());
  auto group = std::make_shared<Group>(size, config);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) {
    out.push_back(std::make_unique<ThreadCommunicator>(group, r, size, backends[static_cast<std::size_t>(r)]));
  }
  return out;
}

}  // namespace pinfeed::trainer
