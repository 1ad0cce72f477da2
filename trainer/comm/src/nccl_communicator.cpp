// NcclCommunicator: NCCL loaded with dlopen (libnccl.so.2), one communicator
// per GPU. Collectives are enqueued on the caller's CUDA stream and return at
// once; a watchdog thread follows each one through an event recorded after
// it, and a collective still running after the configured timeout is
// reported (with ncclCommGetAsyncError's verdict) and the communicator
// aborted, so the streams waiting on it fail instead of hanging. Later calls
// throw CommError naming the rank, the operation and the bytes.
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

#include "cuda_backend_impl.hpp"
#include "dynamic_library.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/collective_gate.hpp"
#include "pinfeed/trainer/cuda_backend.hpp"
#include "pinfeed/trainer/launch_channel.hpp"
#include "pinfeed/trainer/nccl_communicator.hpp"
namespace pinfeed::trainer {
namespace {

struct Nccl {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;
  decltype(&ncclCommInitAll) init_all = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string error;

  static const Nccl& get() {
    static const Nccl lib = load();
    return lib;
  }

 private:
  static Nccl load() {
    Nccl n;
    detail::DynamicLibrary lib("NCCL", {"libnccl.so.2"});
    lib.bind(n.get_unique_id, "ncclGetUniqueId");
    lib.bind(n.init_rank, "ncclCommInitRank");
    lib.bind(n.init_all, "ncclCommInitAll");
    lib.bind(n.all_reduce, "ncclAllReduce");
    lib.bind(n.broadcast, "ncclBroadcast");
    lib.bind(n.group_start, "ncclGroupStart");
    lib.bind(n.group_end, "ncclGroupEnd");
    lib.bind(n.destroy, "ncclCommDestroy");
    lib.bind(n.abort, "ncclCommAbort");
    lib.bind(n.async_error, "ncclCommGetAsyncError");
    lib.bind(n.error_string, "ncclGetErrorString");
    n.error = lib.error();
    return n;
  }
};

const Nccl& nccl() {
  const Nccl& n = Nccl::get();
  if (!n.error.empty()) throw CudaError(n.error);
  return n;
}

/// Set at exit: destructors then make no NCCL calls (the library may be gone).
std::atomic<bool> g_exiting{false};

class NcclCommunicator final : public Communicator {
 public:
  /// `channel`: the launch's (one rank per process under mpirun, srun or
  /// torchrun), kept while the communicator lives; abort() then ends every
  /// process through it (ncclCommAbort reaches this process only). Null for
  /// a group of ranks in one process.
  NcclCommunicator(ncclComm_t comm, int rank, int size, DeviceBackend& backend, CommConfig config,
                   std::unique_ptr<LaunchChannel> channel = nullptr)
      : comm_(comm),
        rank_(rank),
        size_(size),
        channel_(std::move(channel)),
        backend_(backend),
        config_(config),
        barrier_stream_(backend.create_copy_stream()),
        barrier_value_(backend.allocate(sizeof(float))),
        watchdog_([this](const std::stop_token& st) { watch(st); }) {
    static std::once_flag once;
    std::call_once(once, [] { std::atexit([] { g_exiting = true; }); });
  }
  ~NcclCommunicator() override {
    watchdog_.request_stop();
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    // Only a communicator nobody destroyed or aborted explicitly gets here
    // with a live handle; at process exit, leave it to the driver.
    if (comm_ != nullptr && !g_exiting) (void)nccl().destroy(comm_);
  }

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] std::string name() const override { return "nccl"; }

  // An enqueue holds enqueue_mutex_ across the NCCL call, and takes mutex_
  // only around it: the call itself may wait for peers (a first collective
  // connects its channels), and neither the watchdog nor another thread's
  // abort() may block behind it. They must not free comm_ while NCCL uses it
  // either (ncclCommAbort frees it): whoever cannot take enqueue_mutex_
  // marks the abort pending, and the enqueuer carries it out as soon as its
  // call returns (the failing rank's own abort closes its connections, which
  // is what releases a peer stuck connecting).
  void all_reduce(Stream& s, float* data, std::size_t count, ReduceOp op) override {
    const char* what = op == ReduceOp::sum ? "all_reduce(sum)" : "all_reduce(average)";
    // In flight for the pool's registrations from here until it completes
    // (Note [Registration outside collectives], collective_gate.hpp).
    auto ticket = memory::CollectiveGate::process().enter();
    enqueue(what, count, [&](ncclComm_t comm) {
      return nccl().all_reduce(data, data, count, ncclFloat, op == ReduceOp::sum ? ncclSum : ncclAvg, comm,
                               detail::cuda(s).get());
    });
    ticket.track(follow(s, what, count));
  }
  void broadcast(Stream& s, float* data, std::size_t count, int root) override {
    if (root < 0 || root >= size_) throw ConfigError(fmt::format("broadcast root {} is not a rank of {}", root, size_));
    auto ticket = memory::CollectiveGate::process().enter();
    enqueue("broadcast", count, [&](ncclComm_t comm) {
      return nccl().broadcast(data, data, count, ncclFloat, root, comm, detail::cuda(s).get());
    });
    ticket.track(follow(s, "broadcast", count));
  }
  void barrier() override {
    // An all-reduce of one float, waited for; its stream and buffer were made
    // with the communicator (Note [No allocation during collectives]).
    all_reduce(*barrier_stream_, barrier_value_.as<float>(), 1, ReduceOp::sum);
    backend_.synchronize(*barrier_stream_);
  }
  void abort(const std::string& why) noexcept override {
    {
      // Never blocks behind an enqueue that waits for peers (see all_reduce).
      std::unique_lock<std::mutex> enqueue(enqueue_mutex_, std::try_to_lock);
      const std::scoped_lock lock(mutex_);
      if (comm_ != nullptr && !abort_pending_) {
        pinfeed::detail::log().error("nccl rank {}: aborting: {}", rank_, why);
        if (failure_.empty()) failure_ = "aborted: " + why;
        abort_locked(enqueue.owns_lock());
      }
    }
    // The other processes' ranks sit in collectives that only their own
    // watchdogs would end, after the timeout: the launch ends them now
    // (MPI_Abort; under torchrun this process ends, and torchrun ends the rest).
    if (channel_ != nullptr && size_ > 1) channel_->end_launch(why);
  }

 private:
  struct Pending {
    std::shared_ptr<Event> done;
    std::chrono::steady_clock::time_point deadline;
    std::string op;
    std::size_t bytes;
  };

  void check(ncclResult_t r, const char* op, std::size_t count) {
    if (r == ncclSuccess) return;
    throw CommError(rank_, op, count * sizeof(float), fmt::format("NCCL: {}", nccl().error_string(r)));
  }
  /// One NCCL enqueue on comm_ (see all_reduce): enqueue_mutex_ across the
  /// call, mutex_ only to read comm_ and, after it, to carry out an abort
  /// that came meanwhile.
  template <class Call>
  void enqueue(const char* what, std::size_t count, Call&& call) {
    const std::scoped_lock enqueue(enqueue_mutex_);
    ncclComm_t comm = nullptr;
    {
      const std::scoped_lock lock(mutex_);
      check_alive(what, count);
      comm = comm_;
    }
    const ncclResult_t r = call(comm);
    {
      const std::scoped_lock lock(mutex_);
      if (abort_pending_) abort_locked(true);
      check_alive(what, count);
    }
    check(r, what, count);
  }
  /// Aborts comm_ (mutex_ held) when this thread holds enqueue_mutex_ or no
  /// enqueue can be running; else marks it pending for the enqueuer.
  void abort_locked(bool no_enqueue_running) {
    if (comm_ == nullptr) return;
    if (!no_enqueue_running) {
      abort_pending_ = true;
      return;
    }
    (void)Nccl::get().abort(comm_);
    comm_ = nullptr;
    abort_pending_ = false;
    pending_.clear();
  }
  /// Called with mutex_ held.
  void check_alive(const char* op, std::size_t count) {
    if (!failure_.empty()) throw CommError(rank_, op, count * sizeof(float), failure_);
    if (comm_ == nullptr || abort_pending_) {
      throw CommError(rank_, op, count * sizeof(float), "the communicator was aborted");
    }
  }
  /// Records an event after the collective for the watchdog. Events come
  /// back to `spare_` once complete: none is made per collective.
  std::shared_ptr<Event> follow(Stream& s, const char* op, std::size_t count) {
    std::shared_ptr<Event> ev;
    {
      const std::scoped_lock lock(mutex_);
      if (!spare_.empty()) {
        ev = std::move(spare_.back());
        spare_.pop_back();
      }
    }
    if (!ev) ev = backend_.create_event();
    backend_.record(*ev, s);
    {
      const std::scoped_lock lock(mutex_);
      pending_.push_back(Pending{ev, std::chrono::steady_clock::now() + config_.timeout, op, count * sizeof(float)});
    }
    watch_cv_.notify_one();
    return ev;
  }
  void watch(const std::stop_token& stop) {
    try {
      backend_.make_current();  // this thread's CUDA calls go to the communicator's GPU, no other context
    } catch (const std::exception& e) {
      pinfeed::detail::log().error("nccl rank {}: watchdog cannot select its device: {}", rank_, e.what());
    }
    std::unique_lock lock(mutex_);
    while (!stop.stop_requested()) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
      while (!pending_.empty() && pending_.front().done->ready()) {
        spare_.push_back(std::move(pending_.front().done));
        pending_.pop_front();
      }
      if (comm_ == nullptr) continue;
      if (abort_pending_) {  // an abort() that found an enqueue running: carried out once it returns
        const std::unique_lock<std::mutex> enqueue(enqueue_mutex_, std::try_to_lock);
        abort_locked(enqueue.owns_lock());
        continue;
      }
      // Every tick, not only past a deadline: a peer's failure (a network
      // error, a remote abort) shows here long before the timeout.
      ncclResult_t async = ncclSuccess;
      (void)Nccl::get().async_error(comm_, &async);
      const bool broken = async != ncclSuccess && async != ncclInProgress;
      if (!broken && (pending_.empty() || std::chrono::steady_clock::now() < pending_.front().deadline)) continue;
      if (broken) {
        failure_ = fmt::format("NCCL reported an asynchronous error: {}; communicator aborted",
                               Nccl::get().error_string(async));
      } else {
        const Pending& p = pending_.front();
        failure_ = fmt::format("{} of {} bytes {} (NCCL async state: {}); communicator aborted", p.op, p.bytes,
                               timeout_reason(config_.timeout), Nccl::get().error_string(async));
      }
      pinfeed::detail::log().error("nccl rank {}: {}", rank_, failure_);
      // try_lock: mutex_ is held, and an enqueue takes enqueue_mutex_ first.
      const std::unique_lock<std::mutex> enqueue(enqueue_mutex_, std::try_to_lock);
      abort_locked(enqueue.owns_lock());
    }
  }

  ncclComm_t comm_;  // guarded by mutex_ once the watchdog runs
  int rank_, size_;
  std::unique_ptr<LaunchChannel> channel_;  // null in a one-process group
  DeviceBackend& backend_;
  CommConfig config_;
  std::mutex enqueue_mutex_;    // held across an NCCL enqueue; taken before mutex_, or only tried
  std::mutex mutex_;            // guards comm_, failure_, pending_, abort_pending_
  bool abort_pending_ = false;  // an abort found an enqueue running: the enqueuer carries it out
  std::condition_variable watch_cv_;
  std::deque<Pending> pending_;
  std::vector<std::shared_ptr<Event>> spare_;  // completed events, recorded again by follow()
  std::string failure_;
  std::unique_ptr<Stream> barrier_stream_;
  DeviceBuffer barrier_value_;
  std::jthread watchdog_;  // last: starts after the fields it uses
};

}  // namespace

bool nccl_available() noexcept { return Nccl::get().error.empty(); }

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<DeviceBackend*>& backends,
                                                           CommConfig config) {
  const Nccl& n = nccl();
  std::vector<int> devices;
  for (DeviceBackend* b : backends) {
    if (b->cuda_device() < 0) throw ConfigError(fmt::format("nccl: {} is not a CUDA device", b->name()));
    devices.push_back(b->cuda_device());
  }
  std::vector<ncclComm_t> comms(backends.size());
  const ncclResult_t r = n.init_all(comms.data(), static_cast<int>(comms.size()), devices.data());
  if (r != ncclSuccess) {
    throw CommError(0, "ncclCommInitAll", 0, fmt::format("{} devices: {}", devices.size(), n.error_string(r)));
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (std::size_t i = 0; i < comms.size(); ++i) {
    out.push_back(std::make_unique<NcclCommunicator>(comms[i], static_cast<int>(i), static_cast<int>(comms.size()),
                                                     *backends[i], config));
  }
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator_launched(DeviceBackend& backend, CommConfig config,
                                                              const LaunchEnv& env) {
  const Nccl& n = nccl();
  if (backend.cuda_device() < 0) throw ConfigError(fmt::format("nccl: {} is not a CUDA device", backend.name()));
  // Rank 0's unique id reaches every rank through the launch's own channel
  // (MPI_COMM_WORLD, torchrun's store: the bootstrap table's row).
  std::unique_ptr<LaunchChannel> channel = launch_bootstrap(env).open_channel(env, config.timeout);
  const int rank = channel->rank(), size = channel->size();
  ncclUniqueId id{};
  std::vector<char> mine;
  if (rank == 0) {
    const ncclResult_t r = n.get_unique_id(&id);
    if (r != ncclSuccess) throw CommError(rank, "ncclGetUniqueId", 0, n.error_string(r));
    mine.assign(id.internal, id.internal + sizeof id.internal);
  }
  const std::vector<char> bytes = channel->share_from_rank0("nccl/id", mine);
  if (bytes.size() != sizeof id.internal) {
    throw CommError(rank, "share(nccl id)", bytes.size(),
                    fmt::format("the NCCL unique id rank 0 shared under 'nccl/id' is {} bytes, not {}: another "
                                "program wrote it, or another pinfeed version",
                                bytes.size(), sizeof id.internal));
  }
  std::copy(bytes.begin(), bytes.end(), id.internal);
  backend.make_current();
  ncclComm_t comm = nullptr;
  const ncclResult_t r = n.init_rank(&comm, size, id, rank);
  if (r != ncclSuccess)
    throw CommError(rank, "ncclCommInitRank", 0, fmt::format("{} ranks: {}", size, n.error_string(r)));
  // ncclCommInitRank returns once every rank has joined, so every rank has
  // read the id; the channel stays with the communicator all the same (rank
  // 0's store server must outlive the others' last request, and abort()
  // ends the launch through it).
  return std::make_unique<NcclCommunicator>(comm, rank, size, backend, config, std::move(channel));
}

}  // namespace pinfeed::trainer
