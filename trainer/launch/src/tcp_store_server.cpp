#include "tcp_store_server.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "tcp_store_protocol.hpp"

namespace pinfeed::trainer::detail {
namespace {

using Clock = std::chrono::steady_clock;
using namespace wire;

constexpr std::size_t kReadChunk = 64U << 10U;
/// Requests of a connection wait while more than this of its answers is unsent.
constexpr std::size_t kOutHigh = 64U << 10U;
/// The largest legal request (COMPARE_SET: a key and two values).
constexpr std::size_t kMaxRequest = 1 + 3 * 8 + kMaxKey + 2 * kMaxValue;
/// What a key costs beyond its bytes (the map's node), so that many tiny
/// keys count too.
constexpr std::size_t kKeyOverhead = 64;
/// A connection buffering more than this counts against max_bytes.
constexpr std::size_t kSmallRequest = 1U << 20U;

enum class Parse { incomplete, bad, ok };

struct Request {
  std::uint8_t code = kNone;  ///< a v1 code, or kV2Validate / kV2Ping with `control`
  bool control = false;       ///< VALIDATE or PING (v2 only)
  std::uint32_t number = 0;   ///< VALIDATE's magic, PING's nonce
  std::string key, expected, value;
  std::vector<std::string> keys;
  std::int64_t delta = 0;
};

/// Fields from the front of a connection's input: each read is incomplete
/// when bytes are missing, bad when a length is over its cap.
class Cursor {
 public:
  explicit Cursor(std::string_view in) : in_(in) {}
  [[nodiscard]] std::size_t used() const noexcept { return at_; }

  template <typename T>
  Parse raw(T& out) {
    if (in_.size() - at_ < sizeof out) return Parse::incomplete;
    std::memcpy(&out, in_.data() + at_, sizeof out);
    at_ += sizeof out;
    return Parse::ok;
  }
  Parse string(std::string& out, std::uint64_t limit, std::uint64_t* budget = nullptr) {
    std::uint64_t n = 0;
    if (const Parse p = raw(n); p != Parse::ok) return p;
    if (n > limit || (budget != nullptr && n > *budget)) return Parse::bad;
    if (budget != nullptr) *budget -= n;
    if (in_.size() - at_ < n) return Parse::incomplete;
    out.assign(in_.data() + at_, n);
    at_ += n;
    return Parse::ok;
  }

 private:
  std::string_view in_;
  std::size_t at_ = 0;
};

#define PINFEED_PARSE(expr)                                  \
  do {                                                       \
    if (const Parse p_ = (expr); p_ != Parse::ok) return p_; \
  } while (false)

/// One request from `c`'s fields, in the v1 code `code`.
Parse parse_body(Cursor& c, std::uint8_t code, Request& r) {
  r.code = code;
  switch (code) {
    case kSet: PINFEED_PARSE(c.string(r.key, kMaxKey)); return c.string(r.value, kMaxValue);
    case kCompareSet:
      PINFEED_PARSE(c.string(r.key, kMaxKey));
      PINFEED_PARSE(c.string(r.expected, kMaxValue));
      return c.string(r.value, kMaxValue);
    case kGet:
    case kDelete: return c.string(r.key, kMaxKey);
    case kAdd: PINFEED_PARSE(c.string(r.key, kMaxKey)); return c.raw(r.delta);
    case kCheck:
    case kWait: {
      std::uint64_t n = 0;
      PINFEED_PARSE(c.raw(n));
      if (n > kMaxKeys) return Parse::bad;
      r.keys.resize(n);
      std::uint64_t budget = kMaxKeyListBytes;
      for (auto& k : r.keys) PINFEED_PARSE(c.string(k, kMaxKey, &budget));
      return Parse::ok;
    }
    case kNumKeys: return Parse::ok;
    default: return Parse::bad;
  }
}
#undef PINFEED_PARSE

std::string describe(const sockaddr* a) {
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  if (::getnameinfo(a, a->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in), host, sizeof host, port,
                    sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  return a->sa_family == AF_INET6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

struct Connection {
  int fd = -1;
  std::string peer;
  std::string in;
  std::string out;
  std::size_t sent = 0;  ///< of `out`
  bool v2 = false;
  bool spoke = false;    ///< a complete request came
  bool first = true;     ///< no request yet (v2's VALIDATE comes first)
  bool closing = false;  ///< the peer closed its side
  Clock::time_point accepted;
  Clock::time_point progress;        ///< accepted, or the last byte moved
  std::vector<std::string> waiting;  ///< WAIT's keys, until all exist
  std::size_t waiting_bytes = 0;

  [[nodiscard]] std::size_t unsent() const noexcept { return out.size() - sent; }
  [[nodiscard]] bool blocked() const noexcept { return !waiting.empty() || unsent() > kOutHigh; }
  /// The memory the connection holds: a large buffer at its capacity (one
  /// that held a 16 MiB request keeps its size until trim() releases it), a
  /// small one at what it holds (every connection keeps a read chunk's
  /// worth, which must not count against the cap a thousand times), and its
  /// WAIT's keys.
  [[nodiscard]] std::size_t held() const noexcept {
    const auto cost = [](const std::string& b) { return b.capacity() > 2 * kReadChunk ? b.capacity() : b.size(); };
    return cost(in) + cost(out) + waiting_bytes;
  }

  /// Gives back what the buffers no longer need: the sent front of `out`
  /// (a client that always leaves a little unread never lets `out` empty),
  /// and the capacity of a buffer that held a large request or answer.
  void trim() {
    // Erased once half of it is sent: each byte moves at most once more.
    if (sent > 0 && (sent == out.size() || (sent >= kOutHigh && 2 * sent >= out.size()))) {
      out.erase(0, sent);
      sent = 0;
    }
    for (std::string* b : {&in, &out}) {
      if (b->capacity() > 2 * kReadChunk && b->size() < b->capacity() / 4) b->shrink_to_fit();
    }
  }
};

}  // namespace

class TcpStoreServer::Loop {
 public:
  Loop(const std::string& bind_host, int port, StoreLimits limits) : limits_(limits) {
    listen_on(bind_host, port);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_ < 0) {
      for (const int fd : listeners_) ::close(fd);
      throw Error(fmt::format("rendezvous store: eventfd: {}", std::strerror(errno)));
    }
    thread_ = std::thread([this] { run(); });
  }
  ~Loop() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = ::write(wake_, &one, sizeof one);
    thread_.join();
    for (auto& c : connections_) ::close(c.fd);
    for (const int fd : listeners_) ::close(fd);
    ::close(wake_);
  }
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  [[nodiscard]] const std::string& local_address() const noexcept { return local_address_; }
  [[nodiscard]] StoreServerStats stats() const {
    const std::scoped_lock lock(stats_mutex_);
    return published_;
  }

 private:
  // ---- listening -----------------------------------------------------------

  void listen_on(const std::string& host, int port) {
    const bool any = host.empty() || host == "*" || host == "0.0.0.0" || host == "::";
    addrinfo hints{};
    hints.ai_family = host == "0.0.0.0" ? AF_INET : AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(port);
    if (const int rc = ::getaddrinfo(any ? nullptr : host.c_str(), service.c_str(), &hints, &found); rc != 0) {
      throw ConfigError(
          fmt::format("rendezvous store: cannot resolve '{}' to listen on: {}", host, ::gai_strerror(rc)));
    }
    std::vector<std::string> failures;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      const std::string where = describe(a->ai_addr);
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) {
        failures.push_back(fmt::format("{}: {}", where, std::strerror(errno)));
        continue;
      }
      const int one = 1, zero = 0;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      // The IPv6 wildcard also takes IPv4 (then the IPv4 wildcard's bind
      // fails, which is fine).
      if (a->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, any ? &zero : &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
        listeners_.push_back(fd);
        if (local_address_.empty()) local_address_ = any ? std::string("127.0.0.1") : numeric_host(a->ai_addr);
        pinfeed::detail::log().debug("rendezvous store: listening on {}", where);
        continue;
      }
      failures.push_back(fmt::format("{}: {}", where, std::strerror(errno)));
      ::close(fd);
    }
    ::freeaddrinfo(found);
    if (listeners_.empty()) {
      throw ConfigError(fmt::format(
          "rendezvous store: rank 0 serves the store at MASTER_ADDR:MASTER_PORT, but cannot listen on port {} at any "
          "address '{}' resolves to ({}); MASTER_ADDR must be an address of rank 0's host and MASTER_PORT a free port",
          port, host, fmt::join(failures, "; ")));
    }
  }

  static std::string numeric_host(const sockaddr* a) {
    char host[NI_MAXHOST] = {};
    ::getnameinfo(a, a->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in), host, sizeof host, nullptr,
                  0, NI_NUMERICHOST);
    return host;
  }

  // ---- the loop ------------------------------------------------------------

  void run() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_, POLLIN, 0});
      // Out of descriptors, a pending connection stays readable: the
      // listeners rest a tick instead of waking the loop every turn.
      const bool accepting = Clock::now() >= accept_again_;
      for (const int fd : listeners_) fds.push_back({fd, static_cast<short>(accepting ? POLLIN : 0), 0});
      for (auto& c : connections_) {
        // A closing connection is only written to (RDHUP is level-triggered:
        // asked for, it would wake every turn).
        short events = c.closing ? 0 : POLLRDHUP;
        if (!c.blocked() && !c.closing) events = static_cast<short>(events | POLLIN);
        if (c.unsent() > 0) events = static_cast<short>(events | POLLOUT);
        fds.push_back({c.fd, events, 0});
      }
      const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(tick().count()));
      if (rc < 0 && errno != EINTR) {
        pinfeed::detail::log().error("rendezvous store: poll: {}; the store stops", std::strerror(errno));
        return;
      }
      if (fds[0].revents != 0) return;
      for (std::size_t i = 0; i < listeners_.size(); ++i) {
        if (fds[1 + i].revents != 0) accept_all(listeners_[i]);
      }
      // The connections polled are the list's first ones (accepted ones are
      // appended; closed ones stay, fd -1, until expire()).
      std::size_t i = 1 + listeners_.size();
      for (auto it = connections_.begin(); i < fds.size(); ++it, ++i) on_events(*it, fds[i].revents);
      release_waiters();
      expire();
      publish_stats();
    }
  }

  /// How long poll may sleep: the nearest silence deadline, at most 1 s.
  [[nodiscard]] std::chrono::milliseconds tick() const {
    return std::min({limits_.first_request, limits_.stall, std::chrono::milliseconds(1000)});
  }

  void accept_all(int listener) {
    for (;;) {
      sockaddr_storage from{};
      socklen_t len = sizeof from;
      const int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE) {
          note_drop("-", "no file descriptor left for another client");
          accept_again_ = Clock::now() + std::chrono::milliseconds(100);
        }
        return;  // EAGAIN: none left
      }
      const std::string peer = describe(reinterpret_cast<sockaddr*>(&from));
      ++stats_.accepted;
      if (connections_.size() >= limits_.max_connections) {
        ++stats_.refused;
        note_drop(peer, fmt::format("{} connections are open (the cap)", connections_.size()));
        ::close(fd);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Connection c;
      c.fd = fd;
      c.peer = peer;
      c.accepted = c.progress = Clock::now();
      connections_.push_back(std::move(c));
    }
  }

  void on_events(Connection& c, short revents) {
    if (c.fd < 0) return;
    // Closed by the peer (while blocked, too): what it sent before is read
    // to the end and served.
    if ((revents & (POLLIN | POLLHUP | POLLERR | POLLRDHUP)) != 0 && !c.closing) read_from(c);
    if (c.fd >= 0 && (revents & (POLLHUP | POLLERR | POLLRDHUP)) != 0) c.closing = true;
    if (c.fd >= 0 && c.unsent() > 0) write_to(c);
    serve_all(c);
    // Gone: what it sent before closing was served; a partial request is dropped.
    if (c.fd >= 0 && c.closing && (c.unsent() == 0 || (revents & (POLLHUP | POLLERR)) != 0)) close(c);
  }

  void read_from(Connection& c) {
    for (;;) {
      std::size_t room = std::min(kReadChunk, kMaxRequest + 64 - std::min(c.in.size(), kMaxRequest + 64));
      std::size_t left = std::numeric_limits<std::size_t>::max();  // what the cap still allows
      if (c.held() + room > kSmallRequest) {
        const std::size_t total = buffered();
        left = total >= limits_.max_bytes ? 0 : limits_.max_bytes - total;
        room = std::min(room, left);
      }
      if (room == 0) {
        drop(c, fmt::format("the store's buffers are full ({} bytes)", limits_.max_bytes));
        return;
      }
      const std::size_t old = c.in.size();
      if (old + room > c.in.capacity()) {
        // Grown by a quarter, not doubled: what a connection holds is its
        // buffers' capacity (held()), and a 16 MiB SET must not count as 32.
        std::string bigger;
        bigger.reserve(std::max(old + room, std::min(old + old / 4, old + left)));
        bigger.append(c.in);
        c.in.swap(bigger);
      }
      c.in.resize(old + room);
      const ssize_t r = ::recv(c.fd, c.in.data() + old, room, 0);
      c.in.resize(old + static_cast<std::size_t>(std::max<ssize_t>(r, 0)));
      if (r > 0) {
        c.progress = Clock::now();
        if (static_cast<std::size_t>(r) < room) return;
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      c.closing = true;  // orderly close (0) or a reset
      return;
    }
  }

  void write_to(Connection& c) {
    while (c.unsent() > 0) {
      const ssize_t w = ::send(c.fd, c.out.data() + c.sent, c.unsent(), MSG_NOSIGNAL);
      if (w > 0) {
        c.sent += static_cast<std::size_t>(w);
        c.progress = Clock::now();
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      c.in.clear();
      close(c);  // the peer is gone
      return;
    }
    c.trim();
  }

  // ---- requests ------------------------------------------------------------

  /// Every complete request of `c`, until it blocks or its input runs out.
  /// Requests are parsed from a running offset and the served bytes erased
  /// once at the end: erasing per request would move the rest of the
  /// buffer each time (quadratic in a burst of small requests).
  void serve(Connection& c) {
    std::size_t at = 0;
    while (c.fd >= 0 && !c.blocked() && at < c.in.size()) {
      Request r;
      Cursor cur(std::string_view(c.in).substr(at));
      const Parse p = parse(c, cur, r);
      if (p == Parse::incomplete) {
        if (c.in.size() - at > kMaxRequest + 64) drop(c, "a request larger than any legal one");
        break;
      }
      if (p == Parse::bad) {
        drop(c, "a malformed request or one over a size cap");
        return;
      }
      at += cur.used();
      c.first = false;
      c.spoke = true;
      handle(c, r);
    }
    if (c.fd >= 0 && at > 0) {
      c.in.erase(0, at);
      c.trim();
    }
    if (c.fd >= 0 && c.unsent() > 0) write_to(c);
  }

  /// serve() until `c` blocks on an unsent answer or a WAIT, or its input
  /// holds no complete request: requests a client pipelined may all be in
  /// `c.in` already, and no byte more will come to wake the loop for them.
  void serve_all(Connection& c) {
    while (c.fd >= 0) {
      const std::size_t before = c.in.size();
      serve(c);
      if (c.fd < 0 || c.blocked() || c.in.empty() || c.in.size() == before) return;
    }
  }

  /// A request from the front of `c.in`: v2's VALIDATE and PING, or any v1
  /// request in either dialect's codes.
  static Parse parse(const Connection& c, Cursor& cur, Request& r) {
    std::uint8_t q = 0;
    if (const Parse p = cur.raw(q); p != Parse::ok) return p;
    if (c.first && q == kV2Validate) {
      // VALIDATE and v1's SET share the code 0: the magic tells them apart
      // (a v1 key length whose low half is the magic would be 1 GiB).
      Cursor peek = cur;
      std::uint32_t magic = 0;
      if (const Parse p = peek.raw(magic); p != Parse::ok) return p;
      if (magic == kV2Magic) {
        cur = peek;
        r.control = true;
        r.code = kV2Validate;
        return Parse::ok;
      }
    }
    if (c.v2 && q == kV2Ping) {
      r.control = true;
      r.code = kV2Ping;
      return cur.raw(r.number);
    }
    return parse_body(cur, c.v2 ? to_v1(q) : q, r);
  }

  void handle(Connection& c, Request& r) {
    if (r.control) {
      if (r.code == kV2Validate) {
        c.v2 = true;
      } else {
        answer(c, r.number);
      }
      return;
    }
    switch (r.code) {
      case kSet: return on_set(c, r);
      case kCompareSet: return on_compare_set(c, r);
      case kGet: return on_get(c, r);
      case kAdd: return on_add(c, r);
      case kCheck: return answer(c, static_cast<std::uint8_t>(all_present(r.keys) ? 0 : 1));
      case kWait: return on_wait(c, r);
      case kNumKeys: return answer(c, static_cast<std::int64_t>(data_.size()));
      case kDelete: return on_delete(c, r);
      default: drop(c, "an unknown request");
    }
  }

  void on_set(Connection& c, Request& r) {
    if (!store(c, std::move(r.key), std::move(r.value))) return;
  }
  void on_compare_set(Connection& c, Request& r) {
    const auto it = data_.find(r.key);
    std::string current;
    if (it == data_.end()) {
      current = r.expected.empty() ? r.value : r.expected;
      if (r.expected.empty() && !store(c, r.key, r.value)) return;
    } else {
      if (it->second == r.expected && !store(c, r.key, r.value)) return;
      current = data_.find(r.key)->second;
    }
    answer_string(c, current);
  }
  void on_get(Connection& c, const Request& r) {
    const auto it = data_.find(r.key);
    if (it == data_.end()) {
      drop(c, "a GET of a missing key (clients WAIT first)");
      return;
    }
    answer_string(c, it->second);
  }
  void on_add(Connection& c, const Request& r) {
    std::int64_t current = 0;
    if (const auto it = data_.find(r.key); it != data_.end()) {
      const char* end = it->second.data() + it->second.size();
      const auto [last, ec] = std::from_chars(it->second.data(), end, current);
      if (ec != std::errc() || last != end) {
        drop(c, "an ADD to a key whose value is not a number (as torch's store does)");
        return;
      }
    }
    // Wraps like torch's (no undefined behaviour on overflow).
    const auto sum =
        static_cast<std::int64_t>(static_cast<std::uint64_t>(current) + static_cast<std::uint64_t>(r.delta));
    if (!store(c, r.key, std::to_string(sum))) return;
    answer(c, sum);
  }
  void on_wait(Connection& c, Request& r) {
    if (all_present(r.keys)) {
      answer(c, std::uint8_t{0});
      return;
    }
    c.waiting_bytes = 0;
    for (const auto& k : r.keys) c.waiting_bytes += k.size() + sizeof(std::string);
    c.waiting = std::move(r.keys);
  }
  void on_delete(Connection& c, const Request& r) {
    const auto it = data_.find(r.key);
    std::int64_t n = 0;
    if (it != data_.end()) {
      stored_ -= kKeyOverhead + it->first.size() + it->second.size();
      data_.erase(it);
      n = 1;
    }
    answer(c, n);
  }

  /// data_[key] = value within max_bytes; else `c` is dropped (false).
  bool store(Connection& c, std::string key, std::string value) {
    const auto it = data_.find(key);
    const std::size_t old = it == data_.end() ? 0 : kKeyOverhead + key.size() + it->second.size();
    const std::size_t next = stored_ - old + kKeyOverhead + key.size() + value.size();
    if (next > limits_.max_bytes) {
      drop(c, fmt::format("a SET that would make the store hold {} bytes (the cap is {})", next, limits_.max_bytes));
      return false;
    }
    stored_ = next;
    if (it == data_.end()) {
      data_.emplace(std::move(key), std::move(value));
    } else {
      it->second = std::move(value);
    }
    changed_ = true;
    return true;
  }

  [[nodiscard]] bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) != 0; });
  }

  template <typename T>
  void answer(Connection& c, T v) {
    c.out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void answer_string(Connection& c, const std::string& s) {
    // A large answer counts against max_bytes like a large request.
    if (s.size() > kSmallRequest && buffered() + s.size() > limits_.max_bytes) {
      drop(c, fmt::format("an answer of {} bytes while the store's buffers hold {} (the cap is {})", s.size(),
                          buffered(), limits_.max_bytes));
      return;
    }
    answer(c, static_cast<std::uint64_t>(s.size()));
    c.out.append(s);
  }

  /// WAITs whose keys now all exist get their answer, and their
  /// connections' next requests run (which may release more).
  void release_waiters() {
    while (std::exchange(changed_, false)) {
      for (auto& c : connections_) {
        if (c.fd < 0 || c.waiting.empty() || !all_present(c.waiting)) continue;
        c.waiting.clear();
        c.waiting_bytes = 0;
        answer(c, std::uint8_t{0});
        serve_all(c);
      }
    }
  }

  // ---- limits ----------------------------------------------------------------

  [[nodiscard]] std::size_t buffered() const {
    std::size_t n = 0;
    for (const auto& c : connections_) n += c.held();
    return n;
  }

  /// Drops silent and stalled connections, and forgets closed ones.
  void expire() {
    const auto now = Clock::now();
    for (auto& c : connections_) {
      if (c.fd < 0) continue;
      if (!c.spoke && now - c.accepted > limits_.first_request) {
        drop(c, fmt::format("no request within {} ms of connecting", limits_.first_request.count()));
      } else if (((!c.in.empty() && c.waiting.empty()) || c.unsent() > 0) && now - c.progress > limits_.stall) {
        drop(c, fmt::format("a request or answer stalled for {} ms", limits_.stall.count()));
      }
    }
    connections_.remove_if([](const Connection& c) { return c.fd < 0; });
  }

  void drop(Connection& c, const std::string& why) {
    ++stats_.dropped;
    note_drop(c.peer, why);
    close(c);
  }
  void close(Connection& c) {
    if (c.fd >= 0) ::close(c.fd);
    c.fd = -1;
    c.in = {};
    c.out = {};
    c.sent = 0;
    c.waiting = {};
    c.waiting_bytes = 0;
  }
  void note_drop(const std::string& peer, const std::string& why) {
    ++notes_;
    if (notes_ <= 5 || notes_ % 1000 == 0) {
      pinfeed::detail::log().warn("rendezvous store: dropped the client at {}: {}{}", peer, why,
                                  notes_ == 5 ? " (further drops are logged every 1000th)" : "");
    }
  }

  void publish_stats() {
    stats_.connections = 0;
    for (const auto& c : connections_) stats_.connections += c.fd >= 0 ? 1 : 0;
    stats_.stored_bytes = stored_;
    stats_.buffered_bytes = buffered();
    const std::scoped_lock lock(stats_mutex_);
    published_ = stats_;
  }

  StoreLimits limits_;
  std::vector<int> listeners_;
  std::string local_address_;
  int wake_ = -1;
  std::list<Connection> connections_;  // stable addresses across accept
  std::map<std::string, std::string> data_;
  std::size_t stored_ = 0;
  bool changed_ = false;
  Clock::time_point accept_again_{};
  std::uint64_t notes_ = 0;
  StoreServerStats stats_;  // the loop's own
  mutable std::mutex stats_mutex_;
  StoreServerStats published_;
  std::thread thread_;
};

TcpStoreServer::TcpStoreServer(const std::string& bind_host, int port, StoreLimits limits)
    : loop_(std::make_unique<Loop>(bind_host, port, limits)) {}
TcpStoreServer::~TcpStoreServer() = default;
const std::string& TcpStoreServer::local_address() const noexcept { return loop_->local_address(); }
StoreServerStats TcpStoreServer::stats() const { return loop_->stats(); }

}  // namespace pinfeed::trainer::detail
