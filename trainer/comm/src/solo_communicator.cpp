// SoloCommunicator: a world of one rank. Sum and average over one rank are
// its own values and a broadcast from rank 0 to itself moves nothing, so
// every collective is an identity and nothing is enqueued: one GPU trains
// without NCCL (and one CPU worker without the thread rendezvous).
#include <fmt/format.h>

#include <mutex>

#include "pinfeed/trainer/communicator.hpp"

namespace pinfeed::trainer {
namespace {

class SoloCommunicator final : public Communicator {
 public:
  [[nodiscard]] int rank() const noexcept override { return 0; }
  [[nodiscard]] int size() const noexcept override { return 1; }
  [[nodiscard]] std::string name() const override { return "solo"; }

  void all_reduce(Stream& /*s*/, float* /*data*/, std::size_t count, ReduceOp op) override {
    check_alive(op == ReduceOp::sum ? "all_reduce(sum)" : "all_reduce(average)", count);
  }
  void broadcast(Stream& /*s*/, float* /*data*/, std::size_t count, int root) override {
    if (root != 0) throw ConfigError(fmt::format("broadcast root {} is not a rank of 1", root));
    check_alive("broadcast", count);
  }
  void barrier() override { check_alive("barrier", 0); }
  void abort(const std::string& why) noexcept override {
    const std::scoped_lock lock(mutex_);
    if (failure_.empty()) failure_ = "aborted: " + why;
  }

 private:
  void check_alive(const char* op, std::size_t count) {
    const std::scoped_lock lock(mutex_);
    if (!failure_.empty()) throw CommError(0, op, count * sizeof(float), failure_);
  }
  std::mutex mutex_;  // guards failure_
  std::string failure_;
};

}  // namespace

std::unique_ptr<Communicator> make_solo_communicator() { return std::make_unique<SoloCommunicator>(); }

}  // namespace pinfeed::trainer
