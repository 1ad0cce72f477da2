#include "tcp_store.hpp"

// Note [TCPStore protocol]
// The subset of torch.distributed's TCPStore wire protocol pinfeed uses, in
// both of its dialects. A request is a u8 query type followed by its
// fields; a string is a u64 length (host byte order) and its bytes; numbers
// are raw i64. No framing.
//                         v1 (torch < 2.1)   v2 (torch >= 2.1)
//   VALIDATE u32 magic          -             0   (first, no answer)
//   SET key, value              0             1   -> (nothing)
//   COMPARE_SET key, exp, new   1             2   -> value
//   GET key                     2             3   -> value (clients WAIT first)
//   ADD key, i64 delta          3             4   -> i64 sum (kept as decimal text)
//   CHECK u64 n, n keys         4             5   -> u8 0 ready / 1 not ready
//   WAIT u64 n, n keys          5             6   -> u8 0 once every key exists
//   GETNUMKEYS                  6             7   -> i64
//   DELETE_KEY key              8             8   -> i64 deleted
//   PING u32 nonce              -             13  -> the nonce
// A v2 server drops a connection whose first request is not VALIDATE with
// the magic 0x3C85F7CE. Nothing tells a client which dialect a server
// speaks, so the client probes: a v1 SET of a fresh key and its DELETE,
// which a v1 server answers with 1 (deleted). A v2 server reads the SET's
// code 0 as VALIDATE and the key's length as the magic, which is wrong, and
// closes the connection; then the client connects again in v2. A server
// that neither answers nor closes is taken as v2 after 2 s.
// PINFEED_STORE_DIALECT=v1|v2 skips the probe. The server here speaks
// both, per connection: a first byte 0 followed by the magic is v2, a 0
// followed by anything else a v1 SET (a key length whose low half is the
// magic would be a 1 GiB key), other codes v1. torch's clients put "/" before every
// key and ADD 1 to "init/" (no prefix) when they start; pinfeed's do too.
// Waiting is the client's (SO_RCVTIMEO, and CHECK polled with back-off,
// logged every `progress`); the server answers at once or holds a WAIT, and
// drops silent or stalled clients (tcp_store_server.hpp, with its caps).
// Sizes are capped on both sides (keys 64 KiB, values 16 MiB, 4096 keys a
// request), so a stray client or server cannot make the other allocate
// without bound. A server that is not a TCPStore is told within seconds: the
// first ADD ("init/") must be answered within 10 s with a plausible count.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string_view>
#include <thread>
#include <utility>

#include "pinfeed/env.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/comm_error.hpp"
#include "pinfeed/trainer/launch_channel.hpp"
#include "tcp_store_protocol.hpp"

namespace pinfeed::trainer::detail {
namespace {

using Clock = std::chrono::steady_clock;
using namespace wire;
using std::chrono::milliseconds;

/// A request code of `dialect` for the v1 code `q`.
std::uint8_t wire_code(TcpStore::Dialect dialect, std::uint8_t q) {
  return dialect == TcpStore::Dialect::v2 ? v2_code(q) : q;
}

std::string errno_text(int e) { return std::strerror(e); }

long long seconds(Clock::duration d) { return std::chrono::duration_cast<std::chrono::seconds>(d).count(); }

/// Every byte of `data` to `fd`; false when the peer is gone.
bool write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

/// Exactly `n` bytes from `fd`: 0 when done, else the errno (ECONNRESET for
/// a closed peer, EAGAIN for a receive timeout).
int read_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return ECONNRESET;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return 0;
}

/// Closes a socket unless released.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
  int release() noexcept { return std::exchange(fd, -1); }
};

/// connect(2) with a limit: the socket non-blocking until connected, so an
/// address that drops SYNs costs `limit`, not the kernel's minutes.
/// 0 when connected, else the errno.
int connect_within(int fd, const sockaddr* addr, socklen_t len, milliseconds limit) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int e = 0;
  if (::connect(fd, addr, len) != 0) {
    e = errno;
    if (e == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int rc = 0;
      do {
        rc = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(1, limit.count())));
      } while (rc < 0 && errno == EINTR);
      if (rc == 0) {
        e = ETIMEDOUT;
      } else {
        socklen_t n = sizeof e;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &n);
      }
    }
  }
  ::fcntl(fd, F_SETFL, flags);
  return e;
}

void set_receive_timeout(int fd, milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

/// "rank N" or "this process" (a rank not known yet).
std::string who(int rank) { return rank >= 0 ? fmt::format("rank {}", rank) : std::string("this process"); }

/// A line every `every` while something is awaited.
class Progress {
 public:
  explicit Progress(milliseconds every) : start_(Clock::now()), every_(every), next_(start_ + every) {}
  /// True (and the next line scheduled) when a line is due.
  bool due() {
    const auto now = Clock::now();
    if (now < next_) return false;
    next_ = now + every_;
    return true;
  }
  [[nodiscard]] long long elapsed_s() const { return seconds(Clock::now() - start_); }

 private:
  Clock::time_point start_;
  milliseconds every_;
  Clock::time_point next_;
};

/// Whether a connected TCP socket's two ends are the same address and port.
bool connected_to_itself(int fd) {
  sockaddr_storage me{}, peer{};
  socklen_t a = sizeof me, b = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &a) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &b) != 0) {
    return false;
  }
  return a == b && std::memcmp(&me, &peer, a) == 0;
}

/// A connected socket to host:port, retrying refused connections (the
/// server may not listen yet) and unanswered name lookups until `timeout`,
/// with a line every `progress` saying so.
int connect_to(const TcpStore::Options& o, const std::string& host) {
  const auto deadline = Clock::now() + o.timeout;
  Progress progress(o.progress);
  std::string last = "no address";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(o.port).c_str(), &hints, &found);
    if (rc == EAI_AGAIN) {
      last = fmt::format("the name lookup of '{}' did not answer: {}", host, ::gai_strerror(rc));
    } else if (rc != 0) {
      throw ConfigError(
          fmt::format("rendezvous store: MASTER_ADDR '{}' does not resolve: {}", host, ::gai_strerror(rc)));
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      FdGuard fd{::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol)};
      if (fd.fd < 0) continue;
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      const int e =
          connect_within(fd.fd, a->ai_addr, a->ai_addrlen, std::clamp(left, milliseconds(1), milliseconds(10000)));
      if (e == 0 && connected_to_itself(fd.fd)) {
        // MASTER_PORT in the ephemeral range, nobody listening yet: the
        // kernel may pick the port itself and "connect" the socket to itself.
        last = "connected to itself (MASTER_PORT is in the ephemeral port range and nothing listens yet)";
        continue;
      }
      if (e == 0) {
        ::freeaddrinfo(found);
        const int one = 1;
        ::setsockopt(fd.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        // Sends are bounded too: a server that stops reading cannot hold a
        // rank in send() forever.
        const auto t = std::max(o.timeout, milliseconds(1000));
        timeval tv{static_cast<time_t>(t.count() / 1000), static_cast<suseconds_t>((t.count() % 1000) * 1000)};
        ::setsockopt(fd.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        return fd.release();
      }
      last = errno_text(e);
    }
    if (found != nullptr) ::freeaddrinfo(found);
    if (Clock::now() >= deadline) {
      throw CommError(
          o.rank, "rendezvous connect", 0,
          fmt::format("cannot reach the rendezvous store at {}:{} (MASTER_ADDR:MASTER_PORT) within {} s: {}. "
                      "Rank 0 (or torchrun's agent) serves it: did it start, and do MASTER_ADDR and "
                      "MASTER_PORT name its host and port?",
                      host, o.port, o.timeout.count() / 1000, last));
    }
    if (progress.due()) {
      pinfeed::detail::log().warn(
          "rendezvous: {} cannot reach the store at {}:{} yet ({}), {} s of {} s; rank 0 (or "
          "torchrun's agent) serves it",
          who(o.rank), host, o.port, last, progress.elapsed_s(), o.timeout.count() / 1000);
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
}

/// How an answer that is not a TCPStore's looks, for the message.
std::string not_a_store(const void* bytes, std::size_t n) {
  const std::string_view text(static_cast<const char*>(bytes), n);
  if (text.starts_with("HTTP") || text.starts_with("<")) return "it answered like a web server";
  if (text.starts_with("SSH-")) return "it answered like an SSH server";
  return "its answer is not a TCPStore's";
}

}  // namespace

TcpStore::TcpStore(Options options) : options_(std::move(options)) {
  if (options_.port < 1 || options_.port > 65535) {
    throw ConfigError(fmt::format("rendezvous store: port {} is not a port (1..65535)", options_.port));
  }
  if (options_.serve) {
    const std::string where =
        pinfeed::env::get("PINFEED_STORE_BIND").value_or(options_.bind.empty() ? options_.host : options_.bind);
    server_ = std::make_unique<TcpStoreServer>(where, options_.port, options_.limits);
  }
  dialect_ = options_.dialect;
  if (dialect_ == Dialect::automatic) {
    // An operator who knows the server skips the probe (and its wait on a
    // server that neither answers nor closes).
    if (const std::optional<std::string> forced = pinfeed::env::get("PINFEED_STORE_DIALECT")) {
      const std::string_view f(*forced);
      if (f == "v1") {
        dialect_ = Dialect::v1;
      } else if (f == "v2") {
        dialect_ = Dialect::v2;
      } else if (f != "auto") {
        throw ConfigError(
            fmt::format("PINFEED_STORE_DIALECT='{}': expected v1 (torch < 2.1), v2 (torch >= 2.1) or auto", f));
      }
    }
  }
  try {
    fd_ = connect_to(options_, server_ ? server_->local_address() : options_.host);
    if (dialect_ != Dialect::v2) probe_dialect();
    handshake();
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    throw;
  }
}

/// The probe (Note [TCPStore protocol]): a v1 SET of a fresh key, then its
/// DELETE_KEY. A v1 server answers 1 (deleted); a v2 server reads the SET's
/// code as VALIDATE, the key's length as a wrong magic, and closes the
/// connection; one that says nothing is given kProbeWait.
void TcpStore::probe_dialect() {
  constexpr milliseconds kProbeWait{2000};
  set_receive_timeout(fd_, dialect_ == Dialect::automatic ? std::min(options_.timeout, kProbeWait) : options_.timeout);
  std::random_device entropy;
  const std::uint64_t nonce = (std::uint64_t{entropy()} << 32U) ^ entropy();
  const std::string probe = fmt::format("pinfeed/dialect/{}-{:016x}", ::getpid(), nonce);
  const std::uint64_t n = probe.size(), empty = 0;
  // One write: a server that answers the first bytes and closes (a web
  // server) must not turn the rest of the probe into a reset that hides
  // its answer.
  std::string request;
  request.push_back(static_cast<char>(kSet));
  request.append(reinterpret_cast<const char*>(&n), sizeof n).append(probe);
  request.append(reinterpret_cast<const char*>(&empty), sizeof empty);
  request.push_back(static_cast<char>(kDelete));
  request.append(reinterpret_cast<const char*>(&n), sizeof n).append(probe);
  std::int64_t deleted = 0;
  const bool sent = write_all(fd_, request.data(), request.size());
  const int e = sent ? read_all(fd_, &deleted, sizeof deleted) : ECONNRESET;
  if (e == 0 && deleted == 1) {
    dialect_ = Dialect::v1;
    return;
  }
  if (e == 0) {
    throw CommError(options_.rank, "rendezvous connect", 0,
                    fmt::format("{} answered, but it is not a TCPStore: {} (is another service on MASTER_PORT?)",
                                where(), not_a_store(&deleted, sizeof deleted)));
  }
  if (dialect_ == Dialect::v1) recv_error("probe", e);
  const bool silent = e == EAGAIN || e == EWOULDBLOCK;
  pinfeed::detail::log().info(
      "rendezvous: the store at {} {} a torch < 2.1 request; speaking torch 2.1's "
      "protocol (PINFEED_STORE_DIALECT=v2 skips this probe)",
      where(), silent ? "did not answer (2 s) to" : "closed the connection on");
  ::close(fd_);
  fd_ = -1;
  fd_ = connect_to(options_, server_ ? server_->local_address() : options_.host);
  dialect_ = Dialect::v2;
}

/// VALIDATE (v2), then the ADD of "init/" torch's clients make: a TCPStore
/// answers at once with a small count; anything else is not one.
void TcpStore::handshake() {
  constexpr milliseconds kAnswerWait{10000};
  set_receive_timeout(fd_, std::min(options_.timeout, kAnswerWait));
  // One write, as the probe's: VALIDATE (v2), then ADD "init/" 1 (as
  // torch's clients: no prefix).
  std::string request;
  if (dialect_ == Dialect::v2) {
    request.push_back(static_cast<char>(kV2Validate));
    request.append(reinterpret_cast<const char*>(&kV2Magic), sizeof kV2Magic);
  }
  const std::string key = "init/";
  const std::uint64_t key_size = key.size();
  const std::int64_t one = 1;
  request.push_back(static_cast<char>(wire_code(dialect_, kAdd)));
  request.append(reinterpret_cast<const char*>(&key_size), sizeof key_size).append(key);
  request.append(reinterpret_cast<const char*>(&one), sizeof one);
  std::int64_t count = 0;
  const int e = write_all(fd_, request.data(), request.size()) ? read_all(fd_, &count, sizeof count) : ECONNRESET;
  if (e == EAGAIN || e == EWOULDBLOCK) {
    throw CommError(options_.rank, "rendezvous connect", 0,
                    fmt::format("{} accepted the connection but did not answer a TCPStore request within {} s, so it "
                                "is not a TCPStore (is another service on MASTER_PORT?)",
                                where(), std::min(options_.timeout, kAnswerWait).count() / 1000));
  }
  if (e != 0) recv_error("connect", e);
  if (count < 1 || count > (std::int64_t{1} << 40)) {
    throw CommError(options_.rank, "rendezvous connect", 0,
                    fmt::format("{} answered, but it is not a TCPStore: {} (is another service on MASTER_PORT?)",
                                where(), not_a_store(&count, sizeof count)));
  }
  set_receive_timeout(fd_, options_.timeout);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::where() const {
  return fmt::format("{}:{} (MASTER_ADDR:MASTER_PORT)", options_.host, options_.port);
}

void TcpStore::send_bytes(const void* data, std::size_t n) {
  if (!write_all(fd_, data, n)) {
    throw CommError(options_.rank, "rendezvous store", n,
                    fmt::format("the store at {} closed the connection", where()));
  }
}
void TcpStore::send_string(const std::string& s) {
  const std::uint64_t n = s.size();
  send_bytes(&n, sizeof n);
  send_bytes(s.data(), s.size());
}
void TcpStore::recv_bytes(void* data, std::size_t n, const char* op) {
  const int e = read_all(fd_, data, n);
  if (e != 0) recv_error(op, e);
}
void TcpStore::recv_error(const char* op, int e) const {
  if (e == EAGAIN || e == EWOULDBLOCK) {
    throw CommError(
        options_.rank, fmt::format("rendezvous {}", op), 0,
        fmt::format("the store at {} did not answer within {} s", where(), options_.timeout.count() / 1000));
  }
  throw CommError(options_.rank, fmt::format("rendezvous {}", op), 0,
                  fmt::format("the store at {}: {}", where(), errno_text(e)));
}
std::vector<char> TcpStore::recv_vector(const char* op) {
  std::uint64_t n = 0;
  recv_bytes(&n, sizeof n, op);
  if (n > kMaxValue) {
    throw CommError(
        options_.rank, fmt::format("rendezvous {}", op), 0,
        fmt::format("the store at {} sent a value of {} bytes (more than {}): not a TCPStore", where(), n, kMaxValue));
  }
  std::vector<char> v(n);
  if (n > 0) recv_bytes(v.data(), n, op);
  return v;
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) {
  const std::uint8_t q = wire_code(dialect_, kSet);
  send_bytes(&q, 1);
  send_string(options_.prefix + key);
  send_string(std::string(value.begin(), value.end()));
}

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, options_.timeout);
  const std::uint8_t q = wire_code(dialect_, kGet);
  send_bytes(&q, 1);
  send_string(options_.prefix + key);
  return recv_vector("get");
}

std::int64_t TcpStore::add(const std::string& key, std::int64_t delta) {
  const std::uint8_t q = wire_code(dialect_, kAdd);
  send_bytes(&q, 1);
  send_string(options_.prefix + key);
  send_bytes(&delta, sizeof delta);
  std::int64_t sum = 0;
  recv_bytes(&sum, sizeof sum, "add");
  return sum;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  const std::uint8_t q = wire_code(dialect_, kCheck);
  send_bytes(&q, 1);
  const std::uint64_t n = keys.size();
  send_bytes(&n, sizeof n);
  for (const auto& k : keys) send_string(options_.prefix + k);
  std::uint8_t ready = 1;
  recv_bytes(&ready, 1, "check");
  return ready == 0;
}

void TcpStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  // WAIT's answer comes when the keys exist; this polls CHECK instead
  // (backing off to 100 ms, so a long wait costs no CPU), so the connection
  // never carries a late answer to an abandoned WAIT.
  const auto deadline = Clock::now() + timeout;
  Progress progress(options_.progress);
  milliseconds pause{1};
  const std::string first = keys.empty() ? std::string() : options_.prefix + keys.front();
  while (!check(keys)) {
    if (Clock::now() >= deadline) {
      throw CommError(options_.rank, "rendezvous wait", 0,
                      fmt::format("key '{}'{} did not appear in the store at {} within {} s (a rank did not start or "
                                  "failed)",
                                  first, keys.size() > 1 ? fmt::format(" (or one of {} more)", keys.size() - 1) : "",
                                  where(), timeout.count() / 1000));
    }
    if (progress.due()) {
      pinfeed::detail::log().warn(
          "rendezvous: {} has waited {} s of {} s for key '{}' in the store at {} (written by "
          "a rank that has not got there yet)",
          who(options_.rank), progress.elapsed_s(), timeout.count() / 1000, first, where());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(100));
  }
}

void TcpStore::barrier(const std::string& name, int world) {
  if (add(name + "/count", 1) == world) {
    set(name + "/done", {'1'});
    return;
  }
  // As wait(), but what it says is how many ranks have arrived.
  const auto deadline = Clock::now() + options_.timeout;
  Progress progress(options_.progress);
  milliseconds pause{1};
  while (!check({name + "/done"})) {
    if (Clock::now() >= deadline) {
      throw CommError(
          options_.rank, "rendezvous barrier", 0,
          fmt::format("only {} of {} ranks reached '{}' in the store at {} within {} s", add(name + "/count", 0), world,
                      options_.prefix + name, where(), options_.timeout.count() / 1000));
    }
    if (progress.due()) {
      pinfeed::detail::log().warn("rendezvous: {} has waited {} s of {} s at '{}': {} of {} ranks arrived",
                                  who(options_.rank), progress.elapsed_s(), options_.timeout.count() / 1000,
                                  options_.prefix + name, add(name + "/count", 0), world);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(100));
  }
}

// ---- torchrun's store --------------------------------------------------------

namespace {
/// True when every address `host` resolves to is a loopback one.
bool resolves_to_loopback_only(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool loopback = found != nullptr;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      loopback = loopback && (ntohl(in->sin_addr.s_addr) >> 24U) == 127;
    } else if (a->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      loopback = loopback && IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
    }
  }
  ::freeaddrinfo(found);
  return loopback;
}
}  // namespace

std::unique_ptr<TcpStore> connect_launch_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const std::optional<std::string> addr = pinfeed::env::get("MASTER_ADDR");
  const std::optional<std::string> port_text = pinfeed::env::get("MASTER_PORT");
  if (!addr || !port_text) {
    throw ConfigError(
        fmt::format("{} launched {} processes, but MASTER_ADDR and MASTER_PORT (the rendezvous store) are "
                    "not set: launch with torchrun, or with mpirun on a build with MPI",
                    env.launcher, env.world_size));
  }
  int port = 0;
  const std::string_view pt(*port_text);
  const auto [end, ec] = std::from_chars(pt.data(), pt.data() + pt.size(), port);
  if (ec != std::errc() || end != pt.data() + pt.size() || port < 1 || port > 65535) {
    throw ConfigError(fmt::format("environment variable MASTER_PORT='{}' is not a port (1..65535)", pt));
  }
  const std::optional<std::string> agent = pinfeed::env::get("TORCHELASTIC_USE_AGENT_STORE");
  const std::string run = pinfeed::env::get("TORCHELASTIC_RUN_ID").value_or("run");
  const std::string restart = pinfeed::env::get("TORCHELASTIC_RESTART_COUNT").value_or("0");
  TcpStore::Options o;
  o.host = *addr;
  o.port = port;
  o.serve = agent != "True" && env.rank == 0;
  o.timeout = timeout;
  o.rank = env.rank;
  // A launch over several hosts whose MASTER_ADDR resolves to loopback
  // here (Debian maps the host's own name to 127.0.1.1) would listen where
  // no other host can reach: then every interface, as torch's store does.
  if (o.serve && env.world_size > std::max(env.local_size, 1) && resolves_to_loopback_only(o.host)) {
    pinfeed::detail::log().warn(
        "rendezvous: MASTER_ADDR '{}' resolves to loopback on rank 0's host, but the launch spans "
        "{} ranks of which {} are here: the store listens on every interface (set MASTER_ADDR "
        "to this host's address, or PINFEED_STORE_BIND)",
        o.host, env.world_size, env.local_size);
    o.bind = "::";
  }
  // A few connections per rank (pinfeed's own, and torch's when a script
  // shares the store), and room for tools that look at it.
  o.limits.max_connections = 4 * static_cast<std::size_t>(std::max(env.world_size, 1)) + 16;
  if (const std::optional<std::string> every = pinfeed::env::get("PINFEED_WAIT_LOG_S")) {
    const std::string_view e(*every);
    int s = 0;
    const auto [last, bad] = std::from_chars(e.data(), e.data() + e.size(), s);
    if (bad != std::errc() || last != e.data() + e.size() || s < 1 || s > 3600) {
      throw ConfigError(
          fmt::format("environment variable PINFEED_WAIT_LOG_S='{}' is not a number of seconds (1..3600)", e));
    }
    o.progress = std::chrono::seconds(s);
  }
  o.prefix = fmt::format("/pinfeed/{}/{}/", run, restart);
  pinfeed::detail::log().debug("rendezvous: {} the store at {}:{}", o.serve ? "serving" : "using", o.host, o.port);
  return std::make_unique<TcpStore>(std::move(o));
}

}  // namespace pinfeed::trainer::detail

namespace pinfeed::trainer {
namespace {

/// torchrun's rendezvous store as a launch channel (launch_channel.hpp). It
/// is kept while the communicator lives: on rank 0 it is the server the
/// other ranks may still be reading.
class StoreChannel final : public LaunchChannel {
 public:
  StoreChannel(const LaunchEnv& env, std::chrono::milliseconds timeout)
      : rank_(env.rank), size_(env.world_size), store_(detail::connect_launch_store(env, timeout)) {}
  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  std::vector<char> share_from_rank0(const std::string& key, const std::vector<char>& bytes) override {
    if (rank_ == 0) {
      store_->set(key, bytes);
      return bytes;
    }
    return store_->get(key);
  }
  [[noreturn]] void end_launch(const std::string& why) noexcept override {
    pinfeed::detail::log().error("rank {}: ending this process so that every rank stops (torchrun ends the rest): {}",
                                 rank_, why);
    pinfeed::detail::log().flush();
    std::fflush(nullptr);
    std::_Exit(1);
  }

 private:
  int rank_, size_;
  std::unique_ptr<detail::TcpStore> store_;
};

}  // namespace

std::unique_ptr<LaunchChannel> open_store_channel(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  return std::make_unique<StoreChannel>(env, timeout);
}

}  // namespace pinfeed::trainer
