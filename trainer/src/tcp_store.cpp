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
// Timeouts are the client's (SO_RCVTIMEO); the server never times out. The
// server keeps one thread per connection: a launch has a handful of ranks,
// each with one connection for the bootstrap. Sizes are capped on both
// sides (keys 64 KiB, values 16 MiB, 4096 keys a request), so a stray
// client or server cannot make the other allocate without bound.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <utility>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/trainer/communicator.hpp"

namespace pinfeed::trainer::detail {
namespace {

// The v1 codes; a v2 connection's codes are mapped onto them (to_v1).
enum Query : std::uint8_t { kSet = 0, kCompareSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5, kNumKeys = 6, kDelete = 8 };
constexpr std::uint8_t kV2Validate = 0;
constexpr std::uint8_t kV2Ping = 13;
constexpr std::uint32_t kV2Magic = 0x3C85F7CEU;
constexpr std::uint64_t kMaxKey = 64U << 10U;
constexpr std::uint64_t kMaxValue = 16U << 20U;
constexpr std::uint64_t kMaxKeys = 4096;

/// A request code of `dialect` for the v1 code `q`.
std::uint8_t wire_code(TcpStore::Dialect dialect, std::uint8_t q) {
  if (dialect != TcpStore::Dialect::v2) return q;
  return q == kDelete ? std::uint8_t{kDelete} : static_cast<std::uint8_t>(q + 1);
}
/// The v1 code of a v2 request code (VALIDATE and PING have none: 0xff).
std::uint8_t to_v1(std::uint8_t q) {
  if (q >= 1 && q <= 7) return static_cast<std::uint8_t>(q - 1);
  return q == kDelete ? std::uint8_t{kDelete} : std::uint8_t{0xff};
}

std::string errno_text(int e) { return std::strerror(e); }

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

}  // namespace

// ---- the server ------------------------------------------------------------

class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port) {
    listen_fd_ = listen_on(port);
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  ~TcpStoreServer() {
    {
      const std::scoped_lock lock(mutex_);
      stopping_ = true;
      for (const int fd : clients_) ::shutdown(fd, SHUT_RDWR);
    }
    changed_.notify_all();
    ::shutdown(listen_fd_, SHUT_RDWR);
    accept_thread_.join();
    for (auto& t : threads_) t.join();
    for (const int fd : clients_) ::close(fd);
    ::close(listen_fd_);
  }
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

 private:
  static int listen_on(int port) {
    // Dual-stack IPv6 first, then IPv4, like torch's server.
    for (const int family : {AF_INET6, AF_INET}) {
      const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      const int one = 1, zero = 0;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      int rc = -1;
      if (family == AF_INET6) {
        ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        sockaddr_in6 a{};
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons(static_cast<std::uint16_t>(port));
        rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      } else {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(static_cast<std::uint16_t>(port));
        rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      }
      if (rc == 0 && ::listen(fd, 1024) == 0) return fd;
      const int e = errno;
      ::close(fd);
      if (family == AF_INET) {
        throw ConfigError(fmt::format("rendezvous store: cannot listen on port {} (MASTER_PORT): {}", port, errno_text(e)));
      }
    }
    throw ConfigError(fmt::format("rendezvous store: cannot listen on port {} (MASTER_PORT)", port));
  }

  void accept_loop() {
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // shut down
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      const std::scoped_lock lock(mutex_);
      if (stopping_) {
        ::close(fd);
        return;
      }
      clients_.push_back(fd);
      threads_.emplace_back([this, fd] { serve(fd); });
    }
  }

  static bool read_string(int fd, std::string& out, std::uint64_t limit = kMaxKey) {
    std::uint64_t n = 0;
    if (read_all(fd, &n, sizeof n) != 0 || n > limit) return false;
    out.resize(n);
    return n == 0 || read_all(fd, out.data(), n) == 0;
  }
  bool read_keys(int fd, std::vector<std::string>& keys) {
    std::uint64_t n = 0;
    if (read_all(fd, &n, sizeof n) != 0 || n > kMaxKeys) return false;
    keys.resize(n);
    for (auto& k : keys) {
      if (!read_string(fd, k)) return false;
    }
    return true;
  }
  static bool write_string(int fd, const std::string& s) {
    const std::uint64_t n = s.size();
    return write_all(fd, &n, sizeof n) && write_all(fd, s.data(), s.size());
  }
  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (data_.find(k) == data_.end()) return false;
    }
    return true;
  }

  /// One connection's requests until it closes or the server stops; an
  /// unknown or malformed request drops the connection (as torch's does).
  void serve(int fd) {
    bool v2 = false;
    // A v1 SET's key length of which the first half was read as a magic.
    std::optional<std::uint32_t> low_half;
    for (bool first = true;; first = false) {
      std::uint8_t q = 0;
      if (read_all(fd, &q, 1) != 0) break;
      if (first && q == kV2Validate) {
        std::uint32_t magic = 0;
        if (read_all(fd, &magic, sizeof magic) != 0) break;
        if (magic == kV2Magic) {
          v2 = true;
          continue;
        }
        low_half = magic;  // v1's SET (code 0 too), the probe's: its key length began
      }
      if (v2 && q == kV2Ping) {
        std::uint32_t nonce = 0;
        if (read_all(fd, &nonce, sizeof nonce) != 0 || !write_all(fd, &nonce, sizeof nonce)) break;
        continue;
      }
      if (v2) q = to_v1(q);
      std::string key, value, expected;
      std::vector<std::string> keys;
      bool ok = true;
      switch (q) {
        case kSet:
          if (low_half) {
            std::uint32_t high = 0;
            const std::uint64_t n = read_all(fd, &high, sizeof high) == 0
                                        ? (std::uint64_t{high} << 32U) | *low_half
                                        : std::numeric_limits<std::uint64_t>::max();
            low_half.reset();
            ok = n <= kMaxKey;
            if (ok) key.resize(n);
            ok = ok && (n == 0 || read_all(fd, key.data(), n) == 0) && read_string(fd, value, kMaxValue);
          } else {
            ok = read_string(fd, key) && read_string(fd, value, kMaxValue);
          }
          if (ok) {
            const std::scoped_lock lock(mutex_);
            data_[key] = value;
            changed_.notify_all();
          }
          break;
        case kCompareSet: {
          ok = read_string(fd, key) && read_string(fd, expected, kMaxValue) && read_string(fd, value, kMaxValue);
          if (!ok) break;
          std::string current;
          {
            const std::scoped_lock lock(mutex_);
            const auto it = data_.find(key);
            if (it == data_.end()) {
              if (expected.empty()) data_[key] = value;
              current = expected.empty() ? value : expected;
            } else {
              if (it->second == expected) it->second = value;
              current = it->second;
            }
            changed_.notify_all();
          }
          ok = write_string(fd, current);
          break;
        }
        case kGet: {
          ok = read_string(fd, key);
          if (!ok) break;
          std::string v;
          {
            const std::scoped_lock lock(mutex_);
            const auto it = data_.find(key);
            ok = it != data_.end();
            if (ok) v = it->second;
          }
          ok = ok && write_string(fd, v);
          break;
        }
        case kAdd: {
          std::int64_t delta = 0;
          ok = read_string(fd, key) && read_all(fd, &delta, sizeof delta) == 0;
          if (!ok) break;
          std::int64_t sum = 0;
          {
            const std::scoped_lock lock(mutex_);
            std::string& v = data_[key];
            std::int64_t current = 0;
            std::from_chars(v.data(), v.data() + v.size(), current);
            sum = current + delta;
            v = std::to_string(sum);
            changed_.notify_all();
          }
          ok = write_all(fd, &sum, sizeof sum);
          break;
        }
        case kCheck: {
          ok = read_keys(fd, keys);
          if (!ok) break;
          std::uint8_t ready = 1;
          {
            const std::scoped_lock lock(mutex_);
            ready = all_present(keys) ? 0 : 1;
          }
          ok = write_all(fd, &ready, 1);
          break;
        }
        case kWait: {
          ok = read_keys(fd, keys);
          if (!ok) break;
          {
            std::unique_lock lock(mutex_);
            changed_.wait(lock, [&] { return stopping_ || all_present(keys); });
            if (stopping_) return;
          }
          const std::uint8_t stop_waiting = 0;
          ok = write_all(fd, &stop_waiting, 1);
          break;
        }
        case kNumKeys: {
          std::int64_t n = 0;
          {
            const std::scoped_lock lock(mutex_);
            n = static_cast<std::int64_t>(data_.size());
          }
          ok = write_all(fd, &n, sizeof n);
          break;
        }
        case kDelete: {
          ok = read_string(fd, key);
          if (!ok) break;
          std::int64_t n = 0;
          {
            const std::scoped_lock lock(mutex_);
            n = static_cast<std::int64_t>(data_.erase(key));
          }
          ok = write_all(fd, &n, sizeof n);
          break;
        }
        default:
          ok = false;
      }
      if (!ok) break;
    }
    const std::scoped_lock lock(mutex_);
    if (!stopping_) {
      std::erase(clients_, fd);
      ::close(fd);
    }
  }

  int listen_fd_ = -1;
  std::thread accept_thread_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::map<std::string, std::string> data_;
  std::vector<int> clients_;
  std::vector<std::thread> threads_;
};

// ---- the client ------------------------------------------------------------

namespace {

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
int connect_within(int fd, const sockaddr* addr, socklen_t len, std::chrono::milliseconds limit) {
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

/// A connected socket to host:port, retrying refused connections (the
/// server may not listen yet) and unanswered name lookups until `timeout`.
int connect_to(const std::string& host, int port, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  std::string last = "no address";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (rc == EAI_AGAIN) {
      last = ::gai_strerror(rc);  // the resolver is not answering (yet): retry
    } else if (rc != 0) {
      throw ConfigError(fmt::format("rendezvous store: MASTER_ADDR '{}' does not resolve: {}", host, ::gai_strerror(rc)));
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      FdGuard fd{::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol)};
      if (fd.fd < 0) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      const int e = connect_within(fd.fd, a->ai_addr, a->ai_addrlen,
                                   std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(10000)));
      if (e == 0) {
        ::freeaddrinfo(found);
        const int one = 1;
        ::setsockopt(fd.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return fd.release();
      }
      last = errno_text(e);
    }
    if (found != nullptr) ::freeaddrinfo(found);
    if (Clock::now() >= deadline) {
      throw CommError(-1, "rendezvous connect", 0,
                      fmt::format("cannot reach the rendezvous store at {}:{} (MASTER_ADDR:MASTER_PORT) within {} s: {}",
                                  host, port, timeout.count() / 1000, last));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void set_receive_timeout(int fd, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

}  // namespace

TcpStore::TcpStore(Options options) : options_(std::move(options)) {
  if (options_.serve) server_ = std::make_unique<TcpStoreServer>(options_.port);
  const std::string host = options_.serve ? std::string("127.0.0.1") : options_.host;
  const auto open = [&] {
    FdGuard fd{connect_to(host, options_.port, options_.timeout)};
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd.release();
  };
  dialect_ = options_.dialect;
  if (dialect_ == Dialect::automatic) {
    // An operator who knows the server skips the probe (and its wait on a
    // server that neither answers nor closes).
    if (const char* forced = std::getenv("PINFEED_STORE_DIALECT"); forced != nullptr && *forced != '\0') {
      const std::string_view f(forced);
      if (f == "v1") {
        dialect_ = Dialect::v1;
      } else if (f == "v2") {
        dialect_ = Dialect::v2;
      } else if (f != "auto") {
        throw ConfigError(fmt::format("PINFEED_STORE_DIALECT='{}': expected v1 (torch < 2.1), v2 (torch >= 2.1) or auto", f));
      }
    }
  }
  try {
    open();
    if (dialect_ != Dialect::v2) {
      // The probe (Note [TCPStore protocol]): a v1 SET of a fresh key, then
      // its DELETE_KEY. A v1 server answers 1 (deleted); a v2 server reads
      // the SET's code as VALIDATE, the key's length as a wrong magic, and
      // closes the connection; one that says nothing is given kProbeWait.
      constexpr std::chrono::milliseconds kProbeWait{2000};
      set_receive_timeout(fd_, dialect_ == Dialect::automatic ? std::min(options_.timeout, kProbeWait) : options_.timeout);
      std::random_device entropy;
      const std::uint64_t nonce = (std::uint64_t{entropy()} << 32U) ^ entropy();
      const std::string probe = fmt::format("pinfeed/dialect/{}-{:016x}", ::getpid(), nonce);
      const std::uint8_t set_code = kSet, delete_code = kDelete;
      const std::uint64_t n = probe.size(), empty = 0;
      std::int64_t deleted = 0;
      const bool sent = write_all(fd_, &set_code, 1) && write_all(fd_, &n, sizeof n) &&
                        write_all(fd_, probe.data(), probe.size()) && write_all(fd_, &empty, sizeof empty) &&
                        write_all(fd_, &delete_code, 1) && write_all(fd_, &n, sizeof n) &&
                        write_all(fd_, probe.data(), probe.size());
      const int e = sent ? read_all(fd_, &deleted, sizeof deleted) : ECONNRESET;
      if (e == 0 && deleted == 1) {
        dialect_ = Dialect::v1;
      } else if (dialect_ == Dialect::v1 || e == 0) {
        recv_error("probe", e == 0 ? EPROTO : e);
      } else {
        const bool silent = e == EAGAIN || e == EWOULDBLOCK;
        pinfeed::detail::log().info("rendezvous: the store at {}:{} {} a torch < 2.1 request; speaking torch 2.1's "
                                    "protocol (PINFEED_STORE_DIALECT=v2 skips this probe)",
                                    host, options_.port, silent ? "did not answer (2 s) to" : "closed the connection on");
        open();
        dialect_ = Dialect::v2;
      }
    }
    set_receive_timeout(fd_, options_.timeout);
    if (dialect_ == Dialect::v2) {
      const std::uint8_t q = kV2Validate;
      send_bytes(&q, 1);
      send_bytes(&kV2Magic, sizeof kV2Magic);
    }
    // As torch's clients do: count this worker at the server (no prefix).
    const std::string saved = std::exchange(options_.prefix, std::string());
    add("init/", 1);
    options_.prefix = saved;
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    throw;
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpStore::send_bytes(const void* data, std::size_t n) {
  if (!write_all(fd_, data, n)) {
    throw CommError(-1, "rendezvous store", n, fmt::format("the store at {}:{} closed the connection", options_.host, options_.port));
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
  if (e == EPROTO) {
    throw CommError(-1, fmt::format("rendezvous {}", op), 0,
                    fmt::format("the server at {}:{} does not speak torch's TCPStore protocol", options_.host, options_.port));
  }
  if (e == EAGAIN || e == EWOULDBLOCK) {
    throw CommError(-1, fmt::format("rendezvous {}", op), 0,
                    fmt::format("no answer from the store at {}:{} within {} s (a rank did not start?)", options_.host,
                                options_.port, options_.timeout.count() / 1000));
  }
  throw CommError(-1, fmt::format("rendezvous {}", op), 0,
                  fmt::format("the store at {}:{}: {}", options_.host, options_.port, errno_text(e)));
}
std::vector<char> TcpStore::recv_vector(const char* op) {
  std::uint64_t n = 0;
  recv_bytes(&n, sizeof n, op);
  if (n > kMaxValue) {
    throw CommError(-1, fmt::format("rendezvous {}", op), 0,
                    fmt::format("the store at {}:{} sent a value of {} bytes (more than {}): not a TCPStore", options_.host,
                                options_.port, n, kMaxValue));
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

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  // WAIT's answer comes when the keys exist; a wait longer than the socket's
  // receive timeout polls CHECK instead, so the connection never carries a
  // late answer to an abandoned WAIT.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const std::uint8_t q = wire_code(dialect_, kCheck);
    send_bytes(&q, 1);
    const std::uint64_t n = keys.size();
    send_bytes(&n, sizeof n);
    for (const auto& k : keys) send_string(options_.prefix + k);
    std::uint8_t ready = 1;
    recv_bytes(&ready, 1, "check");
    if (ready == 0) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      throw CommError(-1, "rendezvous wait", 0,
                      fmt::format("key '{}' did not appear in the store at {}:{} within {} s (a rank did not start or "
                                  "failed)",
                                  keys.empty() ? std::string() : keys.front(), options_.host, options_.port,
                                  timeout.count() / 1000));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void TcpStore::barrier(const std::string& name, int world) {
  if (add(name + "/count", 1) == world) set(name + "/done", {'1'});
  wait({name + "/done"}, options_.timeout);
}

// ---- torchrun's store --------------------------------------------------------

bool use_mpi_bootstrap(const LaunchEnv& env) {
  if (!env.mpi_launch()) return false;
  if (mpi_compiled()) return true;
  const char* addr = std::getenv("MASTER_ADDR");
  return addr == nullptr || *addr == '\0' || std::getenv("MASTER_PORT") == nullptr;
}

std::unique_ptr<TcpStore> connect_launch_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port_text = std::getenv("MASTER_PORT");
  if (addr == nullptr || port_text == nullptr || *addr == '\0') {
    throw ConfigError(fmt::format("{} launched {} processes, but MASTER_ADDR and MASTER_PORT (the rendezvous store) are "
                                  "not set: launch with torchrun, or with mpirun on a build with MPI",
                                  env.launcher, env.world_size));
  }
  int port = 0;
  const std::string_view pt(port_text);
  const auto [end, ec] = std::from_chars(pt.data(), pt.data() + pt.size(), port);
  if (ec != std::errc() || end != pt.data() + pt.size() || port < 1 || port > 65535) {
    throw ConfigError(fmt::format("environment variable MASTER_PORT='{}' is not a port (1..65535)", pt));
  }
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const char* run = std::getenv("TORCHELASTIC_RUN_ID");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  TcpStore::Options o;
  o.host = addr;
  o.port = port;
  o.serve = !(agent != nullptr && std::string_view(agent) == "True") && env.rank == 0;
  o.timeout = timeout;
  o.prefix = fmt::format("/pinfeed/{}/{}/", run != nullptr ? run : "run", restart != nullptr ? restart : "0");
  pinfeed::detail::log().debug("rendezvous: {} the store at {}:{}", o.serve ? "serving" : "using", o.host, o.port);
  return std::make_unique<TcpStore>(std::move(o));
}

}  // namespace pinfeed::trainer::detail
