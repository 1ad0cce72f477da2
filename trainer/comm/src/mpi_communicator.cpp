// MpiCommunicator: one CPU rank per process under mpirun. Collectives run on
// the rank's comm stream (a CpuBackend worker thread) while barrier() runs
// on the calling thread, so MPI is initialized with MPI_THREAD_MULTIPLE.
//
// MPI has no timeouts, and a blocking collective busy-polls: a stopped or
// lost peer would keep this rank at 100% of a core forever. So every
// collective is non-blocking (MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier)
// and is waited for by wait(): MPI_Test back to back for the first 100 ms
// (a healthy collective's latency is untouched), then with sleeps growing
// to 1 ms, and to 10 ms after a second (a long wait costs <1% of a core:
// MPI_Test itself runs Open MPI's progress engine), and at CommConfig::timeout
// every rank is aborted with a message saying which collective did not
// complete.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <thread>

#include "mpi_init.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "pinfeed/trainer/launch_channel.hpp"

namespace pinfeed::trainer {
namespace {

void check(int rc, int rank, const char* op, std::size_t bytes) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(rank, op, bytes,
                  fmt::format("MPI error {}: {}", rc, std::string(text, static_cast<std::size_t>(len))));
}

}  // namespace

namespace detail {
void mpi_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized != 0) return;
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
      throw ConfigError("MPI_Init_thread failed (run under mpirun, or use --devices cpu:N in one process)");
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      throw ConfigError(fmt::format("MPI provides thread level {}, pinfeed needs MPI_THREAD_MULTIPLE", provided));
    }
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized == 0) MPI_Finalize();
    });
  });
}
void mpi_abort(int rank, const std::string& why) noexcept {
  pinfeed::detail::log().error("rank {}: aborting every MPI rank: {}", rank, why);
  pinfeed::detail::log().flush();
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; if it did, this process still must not go on
}
}  // namespace detail

namespace {

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(CpuBackend& backend, CommConfig config) : backend_(&backend), timeout_(config.timeout) {
    detail::mpi_init();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    // Barriers run on the caller's thread while collectives run on the
    // comm stream's: on one communicator their order could differ between
    // ranks, which MPI forbids. Each gets its own (as Gloo's two meshes).
    check(MPI_Comm_dup(MPI_COMM_WORLD, &barriers_), rank_, "comm dup", 0);
  }
  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] std::string name() const override { return "mpi"; }

  void all_reduce(Stream& s, float* data, std::size_t count, ReduceOp op) override {
    backend_->enqueue(s, [this, data, count, op] {
      const std::size_t bytes = count * sizeof(float);
      MPI_Request r = MPI_REQUEST_NULL;
      check(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r), rank_,
            "all_reduce", bytes);
      wait(r, "all_reduce", bytes);
      if (op == ReduceOp::average) {
        for (std::size_t i = 0; i < count; ++i) data[i] /= static_cast<float>(size_);
      }
    });
  }
  void broadcast(Stream& s, float* data, std::size_t count, int root) override {
    if (root < 0 || root >= size_) throw ConfigError(fmt::format("broadcast root {} is not a rank of {}", root, size_));
    backend_->enqueue(s, [this, data, count, root] {
      MPI_Request r = MPI_REQUEST_NULL;
      check(MPI_Ibcast(data, static_cast<int>(count), MPI_FLOAT, root, MPI_COMM_WORLD, &r), rank_, "broadcast",
            count * sizeof(float));
      wait(r, "broadcast", count * sizeof(float));
    });
  }
  void barrier() override {
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(barriers_, &r), rank_, "barrier", 0);
    wait(r, "barrier", 0);
  }
  void abort(const std::string& why) noexcept override { detail::mpi_abort(rank_, why); }

 private:
  /// Until `r` completes (see the top of this file); past the timeout,
  /// every rank is aborted.
  void wait(MPI_Request& r, const char* op, std::size_t bytes) const {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto deadline = start + timeout_;
    std::chrono::microseconds pause{0};
    for (;;) {
      int done = 0;
      check(MPI_Test(&r, &done, MPI_STATUS_IGNORE), rank_, op, bytes);
      if (done != 0) return;
      const auto now = Clock::now();
      if (now >= deadline) {
        detail::mpi_abort(rank_, fmt::format("{} of {} bytes {}", op, bytes, timeout_reason(timeout_)));
      }
      const auto waited = now - start;
      if (waited < std::chrono::milliseconds(100)) continue;
      const std::chrono::microseconds cap{waited < std::chrono::seconds(1) ? 1000 : 10000};
      pause = std::clamp(pause * 2, std::chrono::microseconds(10), cap);
      std::this_thread::sleep_for(pause);
    }
  }

  CpuBackend* backend_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
  MPI_Comm barriers_ = MPI_COMM_NULL;  // not freed: the process may be past MPI_Finalize when this goes
};

/// MPI_COMM_WORLD as a launch channel (Note in launch_channel.hpp).
class MpiChannel final : public LaunchChannel {
 public:
  MpiChannel() {
    detail::mpi_init();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  std::vector<char> share_from_rank0(const std::string& key, const std::vector<char>& bytes) override {
    std::uint64_t n = rank_ == 0 ? bytes.size() : 0;
    check(MPI_Bcast(&n, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD), rank_, "MPI_Bcast(size of shared bytes)", sizeof n);
    if (n > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
      throw CommError(rank_, fmt::format("MPI_Bcast({})", key), n, "more bytes than one MPI_Bcast carries (INT_MAX)");
    }
    std::vector<char> out = rank_ == 0 ? bytes : std::vector<char>(n);
    const std::string op = fmt::format("MPI_Bcast({})", key);
    check(MPI_Bcast(out.data(), static_cast<int>(n), MPI_BYTE, 0, MPI_COMM_WORLD), rank_, op.c_str(), n);
    return out;
  }
  [[noreturn]] void end_launch(const std::string& why) noexcept override { detail::mpi_abort(rank_, why); }

 private:
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<LaunchChannel> open_mpi_channel(const LaunchEnv& /*env*/, std::chrono::milliseconds /*timeout*/) {
  return std::make_unique<MpiChannel>();
}

bool mpi_compiled() noexcept { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(DeviceBackend& backend, CommConfig config) {
  auto* cpu = dynamic_cast<CpuBackend*>(&backend);
  if (cpu == nullptr) throw ConfigError(fmt::format("mpi communicator: {} is not a CPU backend", backend.name()));
  return std::make_unique<MpiCommunicator>(*cpu, config);
}

}  // namespace pinfeed::trainer
