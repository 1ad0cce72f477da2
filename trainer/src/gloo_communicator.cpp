// GlooCommunicator: one CPU rank per process under torchrun, without MPI.
// Gloo (Debian's libgloo) does the collectives over TCP; the ranks find each
// other through torchrun's rendezvous store (tcp_store.hpp). Why Gloo: it is
// the CPU backend PyTorch's own DDP uses under torchrun, it is packaged by
// Debian, it needs no launcher daemon (MPI would need mpirun), and it brings
// ring all-reduce and broadcast that work over plain TCP between hosts.
//
// Collectives run on the rank's comm stream (a CpuBackend worker thread);
// barrier() runs on the calling thread. Each has its own Gloo context (its
// own full mesh of connections), so a barrier never interleaves with a
// collective in flight on the stream.
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include "pinfeed/log.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "tcp_store.hpp"

namespace pinfeed::trainer {
namespace {

/// Gloo's rendezvous over pinfeed's store.
class StoreAdaptor final : public gloo::rendezvous::Store {
 public:
  explicit StoreAdaptor(detail::TcpStore& store) : store_(store) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_.set(key, data); }
  std::vector<char> get(const std::string& key) override { return store_.get(key); }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys, store_.options().timeout); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_.wait(keys, timeout);
  }

 private:
  detail::TcpStore& store_;
};

/// The TCP device: GLOO_SOCKET_IFNAME's interface when set (as PyTorch's
/// gloo backend reads it), else this host's name, else the loopback.
std::shared_ptr<gloo::transport::Device> make_device() {
  gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface != nullptr && *iface != '\0') {
    attr.iface = iface;
    return gloo::transport::tcp::CreateDevice(attr);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0) {
    try {
      attr.hostname = host;
      return gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      pinfeed::detail::log().debug("gloo: host name '{}' is not usable ({}); using 127.0.0.1", host, e.what());
    }
  }
  attr.hostname = "127.0.0.1";
  return gloo::transport::tcp::CreateDevice(attr);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(CpuBackend& backend, const LaunchEnv& env, CommConfig config)
      : backend_(&backend), rank_(env.rank), size_(env.world_size), timeout_(config.timeout) {
    try {
      store_ = detail::connect_launch_store(env, config.timeout);
      StoreAdaptor adaptor(*store_);
      auto device = make_device();
      const auto mesh = [&](const char* name) {
        gloo::rendezvous::PrefixStore prefixed(name, adaptor);
        auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
        context->setTimeout(config.timeout);
        context->connectFullMesh(prefixed, device);
        return context;
      };
      collectives_ = mesh("gloo/collectives");
      barriers_ = mesh("gloo/barrier");
      // Every rank has its meshes before rank 0 may take the store down.
      store_->barrier("gloo/ready", size_);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(rank_, "gloo connect", 0, fmt::format("{} ranks: {}", size_, e.what()));
    }
  }
  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] std::string name() const override { return "gloo"; }

  void all_reduce(Stream& s, float* data, std::size_t count, ReduceOp op) override {
    backend_->enqueue(s, [this, data, count, op] {
      run("all_reduce", count * sizeof(float), [&] {
        gloo::AllreduceOptions o(collectives_);
        o.setOutput(data, count);
        o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, std::size_t)>(&gloo::sum<float>));
        o.setTag(next_tag());
        o.setTimeout(timeout_);
        gloo::allreduce(o);
      });
      if (op == ReduceOp::average) {
        for (std::size_t i = 0; i < count; ++i) data[i] /= static_cast<float>(size_);
      }
    });
  }
  void broadcast(Stream& s, float* data, std::size_t count, int root) override {
    if (root < 0 || root >= size_) throw ConfigError(fmt::format("broadcast root {} is not a rank of {}", root, size_));
    backend_->enqueue(s, [this, data, count, root] {
      run("broadcast", count * sizeof(float), [&] {
        gloo::BroadcastOptions o(collectives_);
        o.setOutput(data, count);
        o.setRoot(root);
        o.setTag(next_tag());
        o.setTimeout(timeout_);
        gloo::broadcast(o);
      });
    });
  }
  void barrier() override {
    run("barrier", 0, [&] {
      gloo::BarrierOptions o(barriers_);
      o.setTimeout(timeout_);
      gloo::barrier(o);
    });
  }
  /// Ends this process, as MPI_Abort does for an mpirun launch: the other
  /// ranks' connections to it close, so their collectives fail at once
  /// instead of at the timeout, and torchrun stops the rest.
  void abort(const std::string& why) noexcept override {
    pinfeed::detail::log().error("rank {}: ending this process so that every rank stops: {}", rank_, why);
    pinfeed::detail::log().flush();
    std::fflush(nullptr);
    std::_Exit(1);
  }

 private:
  /// Collectives are enqueued in the same order on every rank, on one
  /// stream: the same tag sequence everywhere.
  std::uint32_t next_tag() noexcept { return tag_++ & 0x7fffffffU; }

  template <typename F>
  void run(const char* op, std::size_t bytes, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw CommError(rank_, op, bytes, fmt::format("gloo: {}", e.what()));
    }
  }

  CpuBackend* backend_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<detail::TcpStore> store_;
  std::shared_ptr<gloo::Context> collectives_, barriers_;
  std::uint32_t tag_ = 0;
};

}  // namespace

bool gloo_compiled() noexcept { return true; }

std::unique_ptr<Communicator> make_gloo_communicator(DeviceBackend& backend, const LaunchEnv& env, CommConfig config) {
  auto* cpu = dynamic_cast<CpuBackend*>(&backend);
  if (cpu == nullptr) throw ConfigError(fmt::format("gloo communicator: {} is not a CPU backend", backend.name()));
  return std::make_unique<GlooCommunicator>(*cpu, env, config);
}

}  // namespace pinfeed::trainer
