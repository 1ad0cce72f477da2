// MpiCommunicator: one CPU rank per process under mpirun. Collectives run on
// the rank's comm stream (a CpuBackend worker thread) while barrier() runs
// on the calling thread, so MPI is initialized with MPI_THREAD_MULTIPLE.
#include <fmt/format.h>
#include <mpi.h>

#include <cstdlib>
#include <mutex>

#include "mpi_init.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"

namespace pinfeed::trainer {
namespace {

void check(int rc, int rank, const char* op, std::size_t bytes) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(rank, op, bytes, fmt::format("MPI error {}: {}", rc, std::string(text, static_cast<std::size_t>(len))));
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
  explicit MpiCommunicator(CpuBackend& backend) : backend_(&backend) {
    detail::mpi_init();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] std::string name() const override { return "mpi"; }

  void all_reduce(Stream& s, float* data, std::size_t count, ReduceOp op) override {
    backend_->enqueue(s, [this, data, count, op] {
      const std::size_t bytes = count * sizeof(float);
      check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), rank_,
            "all_reduce", bytes);
      if (op == ReduceOp::average) {
        for (std::size_t i = 0; i < count; ++i) data[i] /= static_cast<float>(size_);
      }
    });
  }
  void broadcast(Stream& s, float* data, std::size_t count, int root) override {
    if (root < 0 || root >= size_) throw ConfigError(fmt::format("broadcast root {} is not a rank of {}", root, size_));
    backend_->enqueue(s, [this, data, count, root] {
      check(MPI_Bcast(data, static_cast<int>(count), MPI_FLOAT, root, MPI_COMM_WORLD), rank_, "broadcast",
            count * sizeof(float));
    });
  }
  void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), rank_, "barrier", 0); }
  void abort(const std::string& why) noexcept override { detail::mpi_abort(rank_, why); }

 private:
  CpuBackend* backend_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool mpi_compiled() noexcept { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(DeviceBackend& backend, CommConfig /*config*/) {
  auto* cpu = dynamic_cast<CpuBackend*>(&backend);
  if (cpu == nullptr) throw ConfigError(fmt::format("mpi communicator: {} is not a CPU backend", backend.name()));
  return std::make_unique<MpiCommunicator>(*cpu);
}

}  // namespace pinfeed::trainer
