// pinfeed-delay-proxy: a TCP proxy that holds every byte for --delay-ms in
// each direction (a round trip of twice that), for benchmarks of remote
// shards over a long link where `tc netem` is not available (this machine's
// kernel has no sch_netem, nor sch_fq for an eBPF departure time). Bytes are
// forwarded in order, unthrottled: latency only, like netem's `delay`.
//
//   pinfeed-delay-proxy --to 127.0.0.1:8080 --delay-ms 10    # prints the port it listens on
//
// Each connection gets a reader and a writer thread per direction; a writer
// sends a chunk when its time comes. --reset-one-in N resets a connection
// (RST to both sides) before about one in N chunks from the server, as a
// flaky link or a middlebox does. On exit (SIGTERM) it prints its CPU
// seconds and the resets, so a benchmark can say what the proxy cost the
// machine and a test that the faults happened. Packet loss is not emulated:
// TCP retransmits it out of sight, which only adds delay.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace {

using Clock = std::chrono::steady_clock;

struct Chunk {
  Clock::time_point due;
  std::vector<char> bytes;  ///< empty: the other side closed
};

struct Pipe {
  std::mutex m;
  std::condition_variable cv;
  std::deque<Chunk> q;
};

std::atomic<std::uint64_t> g_resets{0};

/// Whether to reset before this chunk: about one in `one_in` (0: never).
bool draw_reset(unsigned one_in) {
  static std::mutex m;
  static std::mt19937 rng{12345};
  if (one_in == 0) return false;
  const std::scoped_lock lock(m);
  return std::uniform_int_distribution<unsigned>(1, one_in)(rng) == 1;
}

/// RST to the peer: linger 0, then close's shutdown.
void reset(int fd) {
  const linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  ::shutdown(fd, SHUT_RDWR);
}

void pump(int from, int to, std::chrono::microseconds delay, unsigned reset_one_in = 0) {
  auto pipe = std::make_shared<Pipe>();
  std::thread writer([pipe, to] {
    for (;;) {
      Chunk c;
      {
        std::unique_lock lock(pipe->m);
        pipe->cv.wait(lock, [&] { return !pipe->q.empty(); });
        c = std::move(pipe->q.front());
        pipe->q.pop_front();
      }
      std::this_thread::sleep_until(c.due);
      if (c.bytes.empty()) {
        ::shutdown(to, SHUT_WR);
        return;
      }
      std::size_t done = 0;
      while (done < c.bytes.size()) {
        const ssize_t w = ::send(to, c.bytes.data() + done, c.bytes.size() - done, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          ::shutdown(to, SHUT_RDWR);
          return;
        }
        done += static_cast<std::size_t>(w);
      }
    }
  });
  std::vector<char> buf(1 << 16);
  for (;;) {
    const ssize_t r = ::recv(from, buf.data(), buf.size(), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r > 0 && draw_reset(reset_one_in)) {
      ++g_resets;
      reset(to);    // the client sees "connection reset by peer"
      reset(from);  // and the server's side goes too
      Chunk end{Clock::now(), {}};
      {
        const std::scoped_lock lock(pipe->m);
        pipe->q.push_back(std::move(end));
      }
      pipe->cv.notify_one();
      break;
    }
    Chunk c{Clock::now() + delay, {}};
    if (r > 0) c.bytes.assign(buf.data(), buf.data() + r);
    {
      const std::scoped_lock lock(pipe->m);
      pipe->q.push_back(std::move(c));
    }
    pipe->cv.notify_one();
    if (r <= 0) break;
  }
  writer.join();
}

int connect_to(const std::string& host, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::atomic<bool> g_stop{false};

void on_term(int) { g_stop = true; }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pinfeed-delay-proxy: a TCP proxy adding a fixed delay each way (a long link on loopback)"};
  std::string to;
  int listen_port = 0;
  double delay_ms = 10;
  unsigned reset_one_in = 0;
  app.add_option("--to", to, "HOST:PORT to forward to (IPv4)")->required();
  app.add_option("--listen", listen_port, "port on 127.0.0.1 (0: any free one, printed)")->check(CLI::Range(0, 65535));
  app.add_option("--delay-ms", delay_ms, "milliseconds each byte is held, each way (round trip: twice)")
      ->check(CLI::Range(0.0, 10000.0));
  app.add_option("--reset-one-in", reset_one_in,
                 "reset a connection before about one in N chunks from the server "
                 "(0: never)");
  CLI11_PARSE(app, argc, argv);
  const auto colon = to.rfind(':');
  if (colon == std::string::npos) {
    fmt::print(stderr, "pinfeed-delay-proxy: --to '{}': HOST:PORT\n", to);
    return 2;
  }
  const std::string host = to.substr(0, colon);
  const int port = std::stoi(to.substr(colon + 1));
  const auto delay = std::chrono::microseconds(static_cast<long long>(delay_ms * 1000));

  const int ls = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(listen_port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(ls, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 || ::listen(ls, 512) != 0) {
    fmt::print(stderr, "pinfeed-delay-proxy: cannot listen on 127.0.0.1:{}: {}\n", listen_port, std::strerror(errno));
    return 1;
  }
  socklen_t len = sizeof a;
  ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  fmt::print("{}\n", ntohs(a.sin_port));
  std::fflush(stdout);
  struct sigaction sa {};
  sa.sa_handler = on_term;  // no SA_RESTART: accept() returns EINTR
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  while (!g_stop) {
    const int c = ::accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    std::thread([c, host, port, delay, reset_one_in] {
      const int s = connect_to(host, port);
      if (s < 0) {
        ::close(c);
        return;
      }
      const int nodelay = 1;
      for (const int fd : {c, s}) ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof nodelay);
      std::thread back([s, c, delay, reset_one_in] { pump(s, c, delay, reset_one_in); });
      pump(c, s, delay);
      back.join();
      ::close(c);
      ::close(s);
    }).detach();
  }
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  fmt::print(stderr, "pinfeed-delay-proxy: {:.2f} CPU seconds (user {:.2f}, system {:.2f}), {} resets\n",
             static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
                 static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6,
             static_cast<double>(u.ru_utime.tv_sec) + static_cast<double>(u.ru_utime.tv_usec) * 1e-6,
             static_cast<double>(u.ru_stime.tv_sec) + static_cast<double>(u.ru_stime.tv_usec) * 1e-6, g_resets.load());
  return 0;
}
