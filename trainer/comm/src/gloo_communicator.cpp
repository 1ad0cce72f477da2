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
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string_view>
#include <utility>

#include "pinfeed/env.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "tcp_store.hpp"

namespace pinfeed::trainer {
namespace {

/// Gloo's rendezvous over pinfeed's store. Gloo trusts what it reads: a
/// peer's address record of the wrong size fails deep inside it ("enforce
/// fail ... address.cc"). So every value read is checked against the shape
/// of the one this rank wrote for the same mesh (each rank writes its
/// listening addresses, one record per peer, under its rank's number), and
/// a malformed one is an error naming the key and the rank it belongs to.
class StoreAdaptor final : public gloo::rendezvous::Store {
 public:
  StoreAdaptor(detail::TcpStore& store, int rank, int size) : store_(store), rank_(rank), size_(size) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    if (const auto [mesh, r] = split(key); r == rank_) written_[mesh] = data.size();
    store_.set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    std::vector<char> v = store_.get(key);
    check(key, v);
    return v;
  }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys, store_.options().timeout); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_.wait(keys, timeout);
  }

 private:
  /// "gloo/collectives/3" -> ("gloo/collectives/", 3); no rank: -1.
  static std::pair<std::string, int> split(const std::string& key) {
    const auto slash = key.find_last_of('/');
    const std::string_view tail = std::string_view(key).substr(slash == std::string::npos ? 0 : slash + 1);
    int r = -1;
    const auto [end, ec] = std::from_chars(tail.data(), tail.data() + tail.size(), r);
    if (ec != std::errc() || end != tail.data() + tail.size() || tail.empty()) return {key, -1};
    return {key.substr(0, key.size() - tail.size()), r};
  }
  void check(const std::string& key, const std::vector<char>& v) {
    // Not a structured binding: the lambda below captures the rank, and
    // clang 14 (the fuzz build) cannot capture a binding.
    const std::pair<std::string, int> parts = split(key);
    const int r = parts.second;
    const auto mine = written_.find(parts.first);
    if (r < 0 || mine == written_.end()) return;
    const std::string full = store_.options().prefix + key;
    const auto bad = [&](const std::string& why) {
      return CommError(rank_, "gloo connect", 0,
                       fmt::format("the store key '{}' (rank {}'s peer addresses) is malformed: {}; something other "
                                   "than rank {} wrote it (a stray process on MASTER_PORT, or two runs with the same "
                                   "TORCHELASTIC_RUN_ID?)",
                                   full, r, why, r));
    };
    if (r >= size_ || r == rank_) throw bad(fmt::format("rank {} is not a peer in a world of {}", r, size_));
    if (v.size() != mine->second) {
      throw bad(fmt::format("{} bytes where every rank writes {}", v.size(), mine->second));
    }
    const std::size_t peers = static_cast<std::size_t>(size_ - 1);
    if (peers == 0 || v.size() % peers != 0) return;
    const std::size_t record = v.size() / peers;
    for (std::size_t i = 0; i + sizeof(sa_family_t) <= v.size(); i += record) {
      sa_family_t family = 0;
      std::memcpy(&family, v.data() + i, sizeof family);
      if (family != AF_INET && family != AF_INET6) {
        throw bad(fmt::format("record {} has address family {}, not IPv4 or IPv6", i / record, family));
      }
    }
    // Where rank r listens: to name it when a connection to it fails.
    if (record >= sizeof(sockaddr_storage)) {
      sockaddr_storage ss{};
      std::memcpy(&ss, v.data(), sizeof ss);
      char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
      const socklen_t len = ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
      if (::getnameinfo(reinterpret_cast<const sockaddr*>(&ss), len, host, sizeof host, port, sizeof port,
                        NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
        where_[r] = {host, port};
      }
    }
  }

 public:
  /// rank -> (address, port) of every peer whose record was read.
  [[nodiscard]] const std::map<int, std::pair<std::string, std::string>>& peers() const noexcept { return where_; }

 private:
  std::map<int, std::pair<std::string, std::string>> where_;

  detail::TcpStore& store_;
  int rank_, size_;
  std::map<std::string, std::size_t> written_;  // mesh prefix -> the size this rank wrote
};

/// The local address that reaches `host` (the route the kernel picks for
/// it), numeric; empty when it cannot be found.
std::string address_toward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return {};
  std::string local;
  for (addrinfo* a = found; a != nullptr && local.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage me{};
    socklen_t len = sizeof me;
    char text[NI_MAXHOST] = {};
    // A UDP connect sends nothing: it only picks the route and source.
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&me), len, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0) {
      local = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return local;
}

/// The TCP device: GLOO_SOCKET_IFNAME's interface when set (as PyTorch's
/// gloo backend reads it), else the local address of the route to the
/// store's host (MASTER_ADDR), which every peer can reach if the store's
/// host can, else the loopback. Not the host name: on many hosts it
/// resolves to 127.0.1.1 or to an interface the peers cannot reach.
std::shared_ptr<gloo::transport::Device> make_device(const detail::TcpStore& store) {
  gloo::transport::tcp::attr attr;
  if (const std::optional<std::string> iface = pinfeed::env::get("GLOO_SOCKET_IFNAME")) {
    attr.iface = *iface;
    return gloo::transport::tcp::CreateDevice(attr);
  }
  std::string local = address_toward(store.options().host, store.options().port);
  if (local.empty()) local = "127.0.0.1";
  pinfeed::detail::log().debug("gloo: listening on {} (the route to MASTER_ADDR {})", local, store.options().host);
  attr.hostname = local;
  return gloo::transport::tcp::CreateDevice(attr);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(CpuBackend& backend, const LaunchEnv& env, CommConfig config)
      : backend_(&backend), rank_(env.rank), size_(env.world_size), timeout_(config.timeout) {
    try {
      store_ = detail::connect_launch_store(env, config.timeout);
      StoreAdaptor adaptor(*store_, rank_, size_);
      auto device = make_device(*store_);
      const auto mesh = [&](const char* name) {
        gloo::rendezvous::PrefixStore prefixed(name, adaptor);
        auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
        context->setTimeout(config.timeout);
        context->connectFullMesh(prefixed, device);
        return context;
      };
      collectives_ = mesh("gloo/collectives");
      barriers_ = mesh("gloo/barrier");
      peers_ = adaptor.peers();
      // Every rank has its meshes before rank 0 may take the store down.
      store_->barrier("gloo/ready", size_);
    } catch (const CommError&) {
      throw;
    } catch (const ConfigError&) {
      throw;  // MASTER_PORT and friends: the operator's to fix (exit 2)
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
    pinfeed::detail::log().error("ending this process so that every rank stops: {}", why);
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
      const std::string_view what = e.what();
      // A timeout says so as MpiCommunicator's and the thread group's do.
      const std::string timed_out =
          what.find("imed out") != std::string_view::npos ? timeout_reason(timeout_) + "; " : std::string();
      throw CommError(rank_, op, bytes, fmt::format("{}gloo: {}{}", timed_out, what, lost_ranks(what)));
    }
  }

  /// " (rank 2 or 3 at 10.0.0.2: ...)" when Gloo's message names a peer's
  /// address ("Connection closed by peer [10.0.0.2]:51234"; the port is
  /// the connection's, not the rank's): which ranks were lost, stopped or
  /// failed, not only where.
  std::string lost_ranks(std::string_view what) const {
    std::map<std::string, std::vector<int>> by_host;
    for (const auto& [r, at] : peers_) by_host[at.first].push_back(r);
    std::vector<std::string> named;
    for (const auto& [host, ranks] : by_host) {
      if (what.find("[" + host + "]") == std::string_view::npos) continue;
      named.push_back(fmt::format("{} {} at {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, " or "), host));
    }
    if (named.empty()) return {};
    return fmt::format(" (the peer is {}: lost, stopped or failed)", fmt::join(named, "; "));
  }

  CpuBackend* backend_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<detail::TcpStore> store_;
  std::shared_ptr<gloo::Context> collectives_, barriers_;
  std::map<int, std::pair<std::string, std::string>> peers_;
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
