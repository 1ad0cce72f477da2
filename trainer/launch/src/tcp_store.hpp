#pragma once
// A key-value store for bootstrapping a multi-process launch without MPI:
// torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT). It speaks the wire
// protocol of torch.distributed's TCPStore in both dialects (torch < 2.1 and
// >= 2.1, told apart by a probe; see Note [TCPStore protocol] in
// tcp_store.cpp), so it can be a client of the store torchrun's agent
// already serves (TORCHELASTIC_USE_AGENT_STORE=True: static rendezvous, and
// every torchrun of torch >= 2.3), or serve it itself from rank 0 (torch
// 1.13's torchrun --standalone, where the workers' rank 0 hosts the store,
// as init_process_group does).
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pinfeed/launch_env.hpp"
#include "tcp_store_server.hpp"

namespace pinfeed::trainer::detail {

class TcpStore {
 public:
  /// torch.distributed's TCPStore protocol: v1 before torch 2.1, v2 (a
  /// VALIDATE first, the codes shifted by one) since.
  enum class Dialect { automatic, v1, v2 };
  struct Options {
    std::string host = "127.0.0.1";
    int port = 29500;
    bool serve = false;  ///< this process hosts the store on `port`, listening where `host` resolves
    std::string bind;    ///< where to listen instead of `host` ("::": everywhere); PINFEED_STORE_BIND wins
    StoreLimits limits;  ///< the server's caps (tcp_store_server.hpp)
    std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< connect and wait limit
    /// A line in the log this often while connecting or waiting.
    std::chrono::milliseconds progress{std::chrono::seconds(15)};
    std::string prefix;                    ///< put before every key (torch's "/" included)
    Dialect dialect = Dialect::automatic;  ///< as a client; the server speaks both
    int rank = -1;                         ///< this process's rank, for messages
  };
  explicit TcpStore(Options options);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  /// Waits for `key` (up to the timeout), then returns its value.
  std::vector<char> get(const std::string& key);
  /// Adds `delta` to the counter `key` (missing: 0) and returns the sum.
  std::int64_t add(const std::string& key, std::int64_t delta);
  /// Waits until every key exists; CommError after `timeout`.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  /// Every one of `world` ranks calls it with the same `name`: returns once
  /// all have (a counter and a key the last one sets).
  void barrier(const std::string& name, int world);

  [[nodiscard]] const Options& options() const noexcept { return options_; }
  /// The dialect the client speaks (v1 or v2 once connected).
  [[nodiscard]] Dialect dialect() const noexcept { return dialect_; }
  /// The server this process hosts (serve), else null.
  [[nodiscard]] const TcpStoreServer* server() const noexcept { return server_.get(); }

 private:
  void send_bytes(const void* data, std::size_t n);
  void send_string(const std::string& s);
  void recv_bytes(void* data, std::size_t n, const char* op);
  [[noreturn]] void recv_error(const char* op, int e) const;
  std::vector<char> recv_vector(const char* op);
  bool check(const std::vector<std::string>& keys);
  void probe_dialect();
  void handshake();
  [[nodiscard]] std::string where() const;

  Options options_;
  std::unique_ptr<TcpStoreServer> server_;
  int fd_ = -1;
  Dialect dialect_ = Dialect::v1;
};

/// The rendezvous store of a torchrun launch, from MASTER_ADDR/MASTER_PORT:
/// a client of torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True),
/// else hosted by rank 0. Keys are kept apart per run and restart
/// (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT) under "pinfeed/".
/// ConfigError naming the variable when MASTER_ADDR/MASTER_PORT are missing
/// or malformed.
std::unique_ptr<TcpStore> connect_launch_store(const LaunchEnv& env, std::chrono::milliseconds timeout);

}  // namespace pinfeed::trainer::detail
