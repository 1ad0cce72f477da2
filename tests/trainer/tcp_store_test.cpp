// TcpStore (trainer/launch/src/tcp_store.hpp): the rendezvous store of torchrun
// launches, served and used in one process here. Its interoperation with
// torch's own TCPStore server is covered by DdpLaunchTest.UnderTorchrunAgentStore
// and by ExternalStoreFromTorch, which tests/python/test_launch.py runs
// against a server started by whichever torch is installed (either dialect).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/trainer/communicator.hpp"
#include "tcp_store.hpp"

namespace pinfeed::trainer::detail {
namespace {

using namespace std::chrono_literals;

TcpStore::Options options(int port, bool serve) {
  TcpStore::Options o;
  o.host = "localhost";
  o.port = port;
  o.serve = serve;
  o.timeout = 2s;
  o.prefix = "/test/";
  return o;
}

TEST(TcpStoreTest, SetGetAddWaitAndBarrierAcrossClients) {
  TcpStore server(options(29561, true));
  TcpStore client(options(29561, false));
  // get() waits for a key another client sets later.
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    server.set("id", {'a', '\0', 'b'});
  });
  EXPECT_EQ(client.get("id"), (std::vector<char>{'a', '\0', 'b'}));
  setter.join();
  EXPECT_EQ(client.add("n", 2), 2);
  EXPECT_EQ(server.add("n", 3), 5);
  EXPECT_EQ(server.add("n", 0), 5);
  std::thread other([&] { client.barrier("b", 2); });
  server.barrier("b", 2);
  other.join();
  client.wait({"id", "b/done"}, 1s);
}

TEST(TcpStoreTest, AMissingKeyAndAnAbsentServerAreErrorsNamingTheStore) {
  TcpStore server(options(29562, true));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)server.get("never");
    FAIL() << "a key nobody sets was found";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  try {
    TcpStore lost(options(29563, false));  // nobody serves 29563
    FAIL() << "connected to nothing";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("localhost:29563"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR:MASTER_PORT"), std::string::npos) << e.what();
  }
}

TEST(TcpStoreTest, BothDialectsShareOneServer) {
  TcpStore server(options(29564, true));
  auto o = options(29564, false);
  TcpStore automatic(o);
  EXPECT_EQ(automatic.dialect(), TcpStore::Dialect::v1);  // the probe: this server answers v1
  o.dialect = TcpStore::Dialect::v2;
  TcpStore v2(o);
  EXPECT_EQ(v2.dialect(), TcpStore::Dialect::v2);
  o.dialect = TcpStore::Dialect::v1;
  TcpStore v1(o);
  v2.set("k", {'x', 'y'});
  EXPECT_EQ(v1.get("k"), (std::vector<char>{'x', 'y'}));
  EXPECT_EQ(v1.add("c", 4), 4);
  EXPECT_EQ(v2.add("c", 1), 5);
  std::thread other([&] { v2.barrier("b", 3); });
  std::thread third([&] { automatic.barrier("b", 3); });
  v1.barrier("b", 3);
  other.join();
  third.join();
}

/// A raw connection to 127.0.0.1:`port`.
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  // Generous: a sanitizer build on a loaded 2-core machine serves a 5 MB
  // burst in seconds (a test's own bounds say what is too slow).
  timeval tv{30, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/// The server closed `fd` (an orderly close, or a reset for unread bytes).
bool closed_by_server(int fd) {
  char byte = 0;
  const ssize_t r = ::recv(fd, &byte, 1, 0);
  return r == 0 || (r < 0 && errno == ECONNRESET);
}

TEST(TcpStoreTest, AStrayClientIsDroppedWithoutHarmingTheServer) {
  TcpStore server(options(29565, true));
  // A SET whose key claims a terabyte: dropped, nothing allocated.
  const int fd = raw_connect(29565);
  const std::uint8_t set = 0;
  const std::uint64_t huge = 1ULL << 40U;
  ASSERT_EQ(::send(fd, &set, 1, 0), 1);
  ASSERT_EQ(::send(fd, &huge, sizeof huge, 0), static_cast<ssize_t>(sizeof huge));
  EXPECT_TRUE(closed_by_server(fd));
  ::close(fd);
  // VALIDATE with the wrong magic is read as v1's SET (code 0 too) whose
  // key length begins there: with an absurd length, dropped too.
  const int fd2 = raw_connect(29565);
  const std::uint8_t validate = 0;
  const std::uint32_t wrong = 0x12345678U, high = 1;
  ASSERT_EQ(::send(fd2, &validate, 1, 0), 1);
  ASSERT_EQ(::send(fd2, &wrong, sizeof wrong, 0), static_cast<ssize_t>(sizeof wrong));
  ASSERT_EQ(::send(fd2, &high, sizeof high, 0), static_cast<ssize_t>(sizeof high));
  EXPECT_TRUE(closed_by_server(fd2));
  ::close(fd2);
  TcpStore client(options(29565, false));
  EXPECT_EQ(client.add("still", 1), 1);
}

TEST(TcpStoreTest, AServerThatIsNotAStoreIsAnErrorNotAHang) {
  // Something that accepts and then says nothing (not a TCPStore).
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(29566);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  auto o = options(29566, false);
  o.dialect = TcpStore::Dialect::v1;
  o.timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(TcpStore silent(o), CommError);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  ::close(listener);
}

/// A torch >= 2.1 store as seen by a v1 probe, on 127.0.0.1:`port`: its
/// first connection gets the probe and answers it as `first` says ("close",
/// "silent"; "direct": there is no probe), the next one is a v2
/// client (VALIDATE, then the "init/" ADD, answered 1).
class FakeV2Store {
 public:
  FakeV2Store(int port, std::string first) : first_(std::move(first)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listener_, 4), 0);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeV2Store() {
    thread_.join();
    ::close(listener_);
  }
  FakeV2Store(const FakeV2Store&) = delete;
  FakeV2Store& operator=(const FakeV2Store&) = delete;
  bool validated = false;

 private:
  static bool read_n(int fd, void* p, std::size_t n) {
    auto* c = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t r = ::recv(fd, c, n, 0);
      if (r <= 0) return false;
      c += r;
      n -= static_cast<std::size_t>(r);
    }
    return true;
  }
  void serve() {
    const int probe = first_ == "direct" ? -1 : ::accept(listener_, nullptr, nullptr);
    char byte = 0;
    if (probe >= 0) (void)read_n(probe, &byte, 1);
    if (probe >= 0 && first_ != "silent") ::close(probe);
    const int v2 = ::accept(listener_, nullptr, nullptr);
    std::uint8_t code = 0xff, add = 0xff;
    std::uint32_t magic = 0;
    std::uint64_t n = 0;
    std::int64_t delta = 0;
    validated = read_n(v2, &code, 1) && code == 0 && read_n(v2, &magic, sizeof magic) && magic == 0x3C85F7CEU;
    std::string key;
    if (validated && read_n(v2, &add, 1) && add == 4 && read_n(v2, &n, sizeof n) && n < 64) {
      key.resize(n);
      if (read_n(v2, key.data(), n) && read_n(v2, &delta, sizeof delta)) {
        const std::int64_t sum = delta;
        (void)::send(v2, &sum, sizeof sum, MSG_NOSIGNAL);
      }
    }
    validated = validated && key == "init/";
    EXPECT_TRUE(validated) << first_;
    ::close(v2);
    if (first_ == "silent") ::close(probe);
  }
  int listener_ = -1;
  std::string first_;
  std::thread thread_;
};

TEST(TcpStoreTest, TheProbeTellsATorch2StoreByAClosedConnectionOrNoAnswer) {
  int port = 29567;
  for (const std::string first : {"close", "silent"}) {
    FakeV2Store fake(port, first);
    auto o = options(port++, false);
    o.timeout = 5s;
    const auto t0 = std::chrono::steady_clock::now();
    {
      TcpStore store(o);
      EXPECT_EQ(store.dialect(), TcpStore::Dialect::v2) << first;
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    // Silence costs the probe's 2 s, not the store's timeout.
    EXPECT_LT(took, first == "silent" ? 4s : 1s) << first;
    if (first == "silent") {
      EXPECT_GE(took, 1900ms);
    }
  }
}

TEST(TcpStoreTest, PinfeedStoreDialectSkipsTheProbe) {
  // The fake's first connection must open with VALIDATE: no probe came.
  ::setenv("PINFEED_STORE_DIALECT", "v3", 1);
  EXPECT_THROW(TcpStore bad(options(29570, false)), ConfigError);  // named before connecting
  ::setenv("PINFEED_STORE_DIALECT", "v2", 1);
  {
    FakeV2Store fake(29570, "direct");
    TcpStore store(options(29570, false));
    EXPECT_EQ(store.dialect(), TcpStore::Dialect::v2);
  }
  ::unsetenv("PINFEED_STORE_DIALECT");
}

// Run by tests/python/test_launch.py with a TCPStore server of torch's own
// (either dialect, whichever torch is installed) on PINFEED_TEST_STORE_PORT,
// holding "/interop/from-torch" = "torch"; PINFEED_TEST_STORE_DIALECT names
// the dialect the probe must find.
TEST(TcpStoreTest, ExternalStoreFromTorch) {
  const char* port = std::getenv("PINFEED_TEST_STORE_PORT");
  if (port == nullptr) GTEST_SKIP() << "run by tests/python/test_launch.py against torch's TCPStore";
  TcpStore::Options o;
  o.host = "127.0.0.1";
  o.port = std::atoi(port);
  o.timeout = 3s;
  o.prefix = "/interop/";
  TcpStore store(o);
  if (const char* expected = std::getenv("PINFEED_TEST_STORE_DIALECT"); expected != nullptr) {
    EXPECT_EQ(store.dialect() == TcpStore::Dialect::v2 ? "v2" : "v1", std::string(expected));
  }
  EXPECT_EQ(store.get("from-torch"), (std::vector<char>{'t', 'o', 'r', 'c', 'h'}));
  store.set("from-pinfeed", {'p', 'f'});
  EXPECT_EQ(store.add("counter", 2), 2);
  EXPECT_EQ(store.add("counter", 3), 5);
  EXPECT_THROW((void)store.get("never-set"), CommError);
}

/// Polls `done` for up to 5 s.
template <typename F>
bool eventually(F done) {
  const auto until = std::chrono::steady_clock::now() + 30s;  // generous: CI runs the pressure tests beside this one
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

/// This process's thread count (/proc/self/status).
int threads_now() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

TEST(TcpStoreTest, OneThreadServesEveryConnectionAndTheCapRefusesMore) {
  auto o = options(29571, true);
  o.limits.max_connections = 8;
  TcpStore server(o);  // its own client holds one of the 8
  const int before = threads_now();
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(raw_connect(29571));
  const TcpStoreServer& s = *server.server();
  ASSERT_TRUE(eventually([&] { return s.stats().accepted >= 21; })) << s.stats().accepted;
  EXPECT_EQ(s.stats().connections, 8U);
  EXPECT_EQ(s.stats().refused, 13U);
  EXPECT_EQ(threads_now(), before);  // no thread per connection
  // The ones over the cap were closed; the ones under it stay.
  int closed = 0;
  for (const int fd : idle) {
    timeval tv{0, 200000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char byte = 0;
    closed += ::recv(fd, &byte, 1, 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(closed, 13);
  // 2000 connect/close cycles leave nothing behind.
  for (const int fd : idle) ::close(fd);
  for (int i = 0; i < 2000; ++i) ::close(raw_connect(29571));
  ASSERT_TRUE(eventually([&] { return s.stats().connections == 1; })) << s.stats().connections;
  EXPECT_EQ(threads_now(), before);
  EXPECT_EQ(server.add("alive", 1), 1);
}

TEST(TcpStoreTest, SilentStalledAndOversizedClientsAreDropped) {
  auto o = options(29572, true);
  // Long enough for a real client's first request under a sanitizer on a
  // loaded machine (the big client below must not be taken for a silent one).
  o.limits.first_request = 1000ms;
  o.limits.stall = 1000ms;
  o.limits.max_bytes = 1U << 20U;
  TcpStore server(o);
  const TcpStoreServer& s = *server.server();
  // Says nothing: dropped after first_request.
  const int silent = raw_connect(29572);
  EXPECT_TRUE(closed_by_server(silent));
  ::close(silent);
  // Half a SET, then nothing: dropped after stall.
  const int half = raw_connect(29572);
  const std::uint8_t set = 0;
  const std::uint64_t len = 10;
  ASSERT_EQ(::send(half, &set, 1, 0), 1);
  ASSERT_EQ(::send(half, &len, sizeof len, 0), 8);
  ASSERT_EQ(::send(half, "abc", 3, 0), 3);
  EXPECT_TRUE(closed_by_server(half));
  ::close(half);
  // A SET over the store's byte cap: that client dropped, nothing stored.
  auto co = options(29572, false);
  TcpStore big(co);
  big.set("big", std::vector<char>(2U << 20U, 'x'));
  EXPECT_THROW((void)big.add("after", 1), CommError);
  EXPECT_TRUE(eventually([&] { return s.stats().dropped == 3U; })) << s.stats().dropped;  // published per loop turn
  EXPECT_LT(s.stats().stored_bytes, 1U << 20U);
  // A WAIT that can wait forever holds its keys, not a thread; it goes with
  // its connection.
  const int waiter = raw_connect(29572);
  const std::uint8_t wait = 5;
  const std::uint64_t one = 1, klen = 5;
  ASSERT_EQ(::send(waiter, &wait, 1, 0), 1);
  ASSERT_EQ(::send(waiter, &one, 8, 0), 8);
  ASSERT_EQ(::send(waiter, &klen, 8, 0), 8);
  ASSERT_EQ(::send(waiter, "never", 5, 0), 5);
  std::this_thread::sleep_for(1500ms);  // past first_request and stall: a WAIT is neither
  EXPECT_EQ(s.stats().dropped, 3U);
  ::close(waiter);
  // And the store still serves its own client.
  EXPECT_EQ(server.add("alive", 2), 2);
  EXPECT_TRUE(eventually([&] { return s.stats().connections == 1; }));
}

// What a connection holds is its buffers' real size: a client that set and
// read back a large value and then idles gives the memory back, and a
// client that reads its answers steadily but never quite to the end (the
// next answers queue behind the unread bytes) is served in full within a
// few answers' worth of memory, never the sum of everything it was sent.
TEST(TcpStoreTest, LargeAnswersAreGivenBackAndASlowReaderNeverGrowsTheServer) {
  auto o = options(29577, true);
  o.limits.max_bytes = 16U << 20U;
  TcpStore server(o);
  const TcpStoreServer& s = *server.server();
  TcpStore big(options(29577, false));
  const std::vector<char> value(6U << 20U, 'v');
  big.set("big", value);
  EXPECT_EQ(big.get("big"), value);
  // Idle now: its 6 MiB request and 6 MiB answer are no longer held.
  EXPECT_TRUE(eventually([&] { return s.stats().buffered_bytes < (1U << 20U); })) << s.stats().buffered_bytes;
  server.set("quarter", std::vector<char>(512U << 10U, 'q'));
  (void)server.add("quarter-is-set", 1);  // a SET has no answer: this round trip says it was served
  // 64 GETs of 512 KiB (32 MiB in all, twice the cap) pipelined, read in
  // 100 KiB pieces.
  const int fd = raw_connect(29577);
  const std::string key = "/test/quarter";
  std::string requests;
  for (int i = 0; i < 64; ++i) {
    const std::uint8_t get = 2;
    const std::uint64_t n = key.size();
    requests.append(reinterpret_cast<const char*>(&get), 1);
    requests.append(reinterpret_cast<const char*>(&n), 8);
    requests.append(key);
  }
  ASSERT_EQ(::send(fd, requests.data(), requests.size(), 0), static_cast<ssize_t>(requests.size()));
  const std::size_t expected = 64 * (8 + (512U << 10U));
  std::vector<char> piece(100U << 10U);
  std::size_t got = 0, peak = 0;
  const auto start = std::chrono::steady_clock::now();
  while (got < expected) {
    const ssize_t r = ::recv(fd, piece.data(), std::min(piece.size(), expected - got), 0);
    ASSERT_GT(r, 0) << "dropped after " << got << " of " << expected << " bytes";
    got += static_cast<std::size_t>(r);
    peak = std::max(peak, s.stats().buffered_bytes);
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_LT(peak, 4U << 20U);
  // Not a speed bound: requests already buffered used to wait for the
  // loop's 1 s tick, two answers a second (32 s here).
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "pipelined requests waited for bytes that never come";
  ::close(fd);
  EXPECT_EQ(server.add("alive", 1), 1);
}

TEST(TcpStoreTest, ABurstOfSmallRequestsAndAHalfClosedClientAreServedInFull) {
  TcpStore server(options(29576, true));
  const TcpStoreServer& s = *server.server();
  // 300,000 pipelined SETs of an empty key (5 MB): served in one pass over
  // the buffer, not by moving the rest of it after each request.
  {
    std::string burst;
    const std::uint64_t zero = 0;
    for (int i = 0; i < 300000; ++i) {
      burst.push_back('\0');
      burst.append(reinterpret_cast<const char*>(&zero), 8).append(reinterpret_cast<const char*>(&zero), 8);
    }
    burst.push_back('\x06');  // GETNUMKEYS
    const int fd = raw_connect(29576);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(::send(fd, burst.data(), burst.size(), 0), static_cast<ssize_t>(burst.size()));
    std::int64_t keys = 0;
    ASSERT_EQ(::recv(fd, &keys, sizeof keys, MSG_WAITALL), 8);
    EXPECT_GE(keys, 1);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);  // minutes when quadratic
    ::close(fd);
  }
  // A GET of a 4 MiB value (its answer fills the socket: the connection
  // blocks), a SET behind it, then the client closes its side: the SET is
  // still applied.
  server.set("big", std::vector<char>(4U << 20U, 'b'));
  // A SET has no answer: read it back on the same connection, so the store
  // holds it before the raw client's GET (on another connection) can arrive.
  // Without this the GET sometimes came first and was dropped as a GET of a
  // missing key.
  ASSERT_EQ(server.get("big").size(), 4U << 20U);
  const int fd = raw_connect(29576);
  std::string req;
  const std::string key = "/test/big", key2 = "/test/after";
  const std::uint64_t n = key.size(), n2 = key2.size(), one = 1;
  req.push_back('\x02');
  req.append(reinterpret_cast<const char*>(&n), 8).append(key);
  req.push_back('\0');
  req.append(reinterpret_cast<const char*>(&n2), 8).append(key2);
  req.append(reinterpret_cast<const char*>(&one), 8).push_back('x');
  ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  ::shutdown(fd, SHUT_WR);
  std::vector<char> sink(1U << 20U);
  std::size_t got = 0;
  for (ssize_t r; (r = ::recv(fd, sink.data(), sink.size(), 0)) > 0;) got += static_cast<std::size_t>(r);
  EXPECT_EQ(got, 8U + (4U << 20U));
  ::close(fd);
  EXPECT_EQ(server.get("after"), std::vector<char>{'x'});
  EXPECT_TRUE(eventually([&] { return s.stats().connections == 1; }));
}

TEST(TcpStoreTest, ItListensOnlyWhereTheHostResolves) {
  auto o = options(29573, true);
  o.host = "127.0.0.1";
  TcpStore server(o);
  // 127.0.0.2 is this host's loopback too, but not the address named.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(0x7f000002U);
  a.sin_port = htons(29573);
  EXPECT_NE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(errno, ECONNREFUSED);
  ::close(fd);
  // An address that is not this host's: an error naming it, at once.
  auto far = options(29574, true);
  far.host = "192.0.2.1";  // TEST-NET-1
  try {
    TcpStore bad(far);
    FAIL() << "listened on another host's address";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("192.0.2.1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
  }
  auto zero = options(0, true);
  EXPECT_THROW(TcpStore bad(zero), ConfigError);
}

TEST(TcpStoreTest, AServiceThatIsNotAStoreIsNamedWithinSeconds) {
  // Something on MASTER_PORT that answers like a web server.
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(29575);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  std::thread web([&] {
    for (int i = 0; i < 2; ++i) {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      char buf[256];
      (void)::recv(fd, buf, sizeof buf, 0);
      const char reply[] = "HTTP/1.0 400 Bad Request\r\n\r\n";
      (void)::send(fd, reply, sizeof reply - 1, MSG_NOSIGNAL);
      ::close(fd);
    }
  });
  auto o = options(29575, false);
  o.timeout = 60s;
  o.rank = 1;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    TcpStore http(o);
    FAIL() << "a web server taken for a store";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("not a TCPStore"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("web server"), std::string::npos) << e.what();
    EXPECT_EQ(e.rank(), 1);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  ::shutdown(listener, SHUT_RDWR);
  web.join();
  ::close(listener);
}

TEST(TcpStoreTest, ALaunchWithoutTheStoreVariablesIsAConfigError) {
  LaunchEnv env;
  env.launcher = "torchrun";
  env.world_size = 2;
  if (std::getenv("MASTER_ADDR") != nullptr) GTEST_SKIP() << "MASTER_ADDR is set in this environment";
  EXPECT_THROW((void)connect_launch_store(env, 1s), ConfigError);
}

}  // namespace
}  // namespace pinfeed::trainer::detail
