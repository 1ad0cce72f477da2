#pragma once
// The rendezvous store's server (Note [TCPStore protocol] in tcp_store.cpp):
// what rank 0 serves when torchrun's agent does not. One thread runs an
// event loop (poll) over every connection, so a client costs a socket and
// its buffers, never a thread, and everything it may hold is capped:
//
//   connections      max_connections; one more is accepted and closed at once
//   stored bytes     keys + values held, max_bytes; a SET over it is dropped
//   buffered bytes   every buffer at its capacity (half-received requests,
//                    unsent answers) + pending
//                    WAITs, max_bytes too; the connection that would pass it
//                    is dropped
//   one request      a key 64 KiB, a value 16 MiB, a WAIT/CHECK 4096 keys and
//                    1 MiB of keys in all
//   silence          a connection that sends no complete request within
//                    `first_request`, or stalls mid-request or mid-answer for
//                    `stall`, is dropped; one that has spoken may stay idle
//                    (the ranks keep theirs for the whole run)
//
// A dropped client is logged (the first few, then a count) and the server
// goes on; the ranks' own connections are never affected by another's.
//
// Trust: like torch's TCPStore, the store has no authentication. Anyone who
// can reach the port can read and change keys, so it listens only on the
// addresses MASTER_ADDR resolves to (loopback for a single-host launch) and
// must be on a trusted network (README, "What the store trusts").
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pinfeed::trainer::detail {

struct StoreLimits {
  std::size_t max_connections = 64;
  std::size_t max_bytes = std::size_t{64} << 20U;
  std::chrono::milliseconds first_request{std::chrono::seconds(30)};
  std::chrono::milliseconds stall{std::chrono::seconds(30)};
};

/// What the server has done, for tests and the debug log.
struct StoreServerStats {
  std::uint64_t accepted = 0;
  std::uint64_t refused = 0;    ///< over max_connections
  std::uint64_t dropped = 0;    ///< malformed, over a cap, silent or stalled
  std::size_t connections = 0;  ///< open now
  std::size_t stored_bytes = 0;
  std::size_t buffered_bytes = 0;
};

class TcpStoreServer {
 public:
  /// Listens on `port` at every address `bind_host` resolves to ("0.0.0.0"
  /// or "::": every interface). ConfigError when none can be bound.
  TcpStoreServer(const std::string& bind_host, int port, StoreLimits limits = {});
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  /// An address it listens on, for this process's own client.
  [[nodiscard]] const std::string& local_address() const noexcept;
  [[nodiscard]] StoreServerStats stats() const;

 private:
  class Loop;
  std::unique_ptr<Loop> loop_;
};

}  // namespace pinfeed::trainer::detail
