// The communicator contract every communicator passes (a typed test: solo,
// threads, Gloo over a real store on loopback, MPI under mpirun), then the
// thread group's own promises (determinism, mismatched calls, timeouts,
// abort) and the solo communicator's.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>

#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "pinfeed/trainer/launch_channel.hpp"

namespace pinfeed::trainer {
namespace {

/// `ranks` CPU backends, a comm stream each, and their thread group.
struct Group {
  explicit Group(int ranks, CommConfig cfg = {}) {
    std::vector<DeviceBackend*> raw;
    for (int r = 0; r < ranks; ++r) {
      backends.push_back(std::make_unique<CpuBackend>(CpuBackendConfig{r, {}, 4096}));
      raw.push_back(backends.back().get());
    }
    comms = make_thread_group(raw, cfg);
    for (auto& b : backends) streams.push_back(b->create_stream());
  }
  /// Runs fn(rank) on one host thread per rank.
  template <class F>
  void each(F&& fn) {
    std::vector<std::jthread> t;
    for (int r = 0; r < static_cast<int>(comms.size()); ++r) t.emplace_back([&, r] { fn(r); });
  }
  std::vector<std::unique_ptr<CpuBackend>> backends;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Stream>> streams;
};

// ---------------------------------------------------------------------------
// The contract. Each kind makes this process's ranks of a world (all of
// them for solo, threads and Gloo; one per process under mpirun), and every
// test reads ranks and sizes from the communicators, so the same test runs
// unchanged in one process or across several. What is not shared is left
// out: abort() ends the process for MPI and Gloo (the other ranks then fail
// at once), and only the thread group can name a missing rank.

/// This process's ranks: a CPU backend, a comm stream and a communicator each.
struct Ranks {
  std::vector<std::unique_ptr<CpuBackend>> backends;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Stream>> streams;
  void add_backends(int n) {
    for (int r = 0; r < n; ++r) backends.push_back(std::make_unique<CpuBackend>(CpuBackendConfig{r, {}, 4096}));
  }
  void add_streams() {
    for (auto& b : backends) streams.push_back(b->create_stream());
  }
  /// fn(i) on one host thread per local rank i.
  template <class F>
  void each(F&& fn) {
    std::vector<std::jthread> t;
    for (std::size_t i = 0; i < comms.size(); ++i) t.emplace_back([&, i] { fn(i); });
  }
};

constexpr CommConfig kContractConfig{std::chrono::seconds(60)};

struct SoloKind {
  static constexpr const char* kName = "solo";
  static void make(Ranks& r) {
    r.add_backends(1);
    r.comms.push_back(make_solo_communicator());
    r.add_streams();
  }
};

struct ThreadsKind {
  static constexpr const char* kName = "threads";
  static void make(Ranks& r) {
    r.add_backends(3);
    std::vector<DeviceBackend*> raw;
    for (auto& b : r.backends) raw.push_back(b.get());
    r.comms = make_thread_group(raw, kContractConfig);
    r.add_streams();
  }
};

/// A loopback port nobody listens on now.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

/// fn(env) on one thread per rank of a torchrun-style launch of `world`
/// ranks in this process (MASTER_ADDR/MASTER_PORT: a free loopback port,
/// rank 0 serves the store); each rank's exception message, "" if none.
template <class F>
std::vector<std::string> as_torchrun_ranks(int world, F&& fn) {
  const int port = free_port();
  if (port == 0) return {"no free loopback port"};
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  {
    std::vector<std::jthread> t;
    for (int k = 0; k < world; ++k) {
      t.emplace_back([&, k] {
        LaunchEnv env;
        env.rank = k;
        env.world_size = world;
        env.local_rank = k;
        env.local_size = world;
        env.launcher = "torchrun";
        try {
          fn(env);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(k)] = e.what();
        }
      });
    }
  }
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
  return errors;
}

/// Three torchrun-style ranks as threads of this process: rank 0 serves the
/// rendezvous store on loopback, and Gloo's meshes are real TCP connections.
struct GlooKind {
  static constexpr const char* kName = "gloo";
  static void make(Ranks& r) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    GTEST_SKIP() << "Gloo's own threads and allocations are not instrumented (the release build runs this)";
#endif
    if (!gloo_compiled()) GTEST_SKIP() << "built without Gloo";
    constexpr int kWorld = 3;
    r.add_backends(kWorld);
    r.comms.resize(kWorld);
    const auto errors = as_torchrun_ranks(kWorld, [&](const LaunchEnv& env) {
      const auto k = static_cast<std::size_t>(env.rank);
      r.comms[k] = make_gloo_communicator(*r.backends[k], env, kContractConfig);
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    r.add_streams();
  }
};

/// One rank per process, under `mpirun -np 2` (ctest's
/// CommunicatorContract.UnderMpirun runs this binary so).
struct MpiKind {
  static constexpr const char* kName = "mpi";
  static void make(Ranks& r) {
    const LaunchEnv env = read_launch_env();
    if (!mpi_compiled() || env.launcher != "mpi")
      GTEST_SKIP() << "run under mpirun (ctest's CommunicatorContract.UnderMpirun does)";
    ASSERT_EQ(launch_bootstrap(env).cpu_communicator, "mpi");
    r.add_backends(1);
    r.comms.push_back(launch_bootstrap(env).make_cpu(*r.backends[0], kContractConfig, env));
    r.add_streams();
  }
};

template <class Kind>
class CommunicatorContract : public ::testing::Test {
 protected:
  void SetUp() override { Kind::make(ranks_); }
  Ranks ranks_;
};

struct KindNames {
  template <class Kind>
  static std::string GetName(int /*index*/) {
    std::string n = Kind::kName;
    n[0] = static_cast<char>(n[0] - 'a' + 'A');
    return n;
  }
};
using Kinds = ::testing::Types<SoloKind, ThreadsKind, GlooKind, MpiKind>;
TYPED_TEST_SUITE(CommunicatorContract, Kinds, KindNames);

template <class... Kind>
std::set<std::string> kind_names(::testing::Types<Kind...>* /*list*/) {
  return {Kind::kName...};
}

// The list of kinds above is written by hand: a launch bootstrap whose CPU
// communicator is not in it would never be held to the contract.
TEST(CommunicatorContractCoverage, EveryLaunchBootstrapsCommunicatorIsAKind) {
  const std::set<std::string> kinds = kind_names(static_cast<Kinds*>(nullptr));
  for (const LaunchBootstrap& b : launch_bootstraps()) {
    EXPECT_TRUE(kinds.contains(std::string(b.cpu_communicator))) << b.name << "'s " << b.cpu_communicator;
  }
}

TYPED_TEST(CommunicatorContract, EveryRankKnowsItsPlaceAndTheWorld) {
  Ranks& g = this->ranks_;
  const int world = g.comms.front()->size();
  std::vector<int> seen;
  for (const auto& c : g.comms) {
    EXPECT_EQ(c->size(), world);
    EXPECT_EQ(c->name(), TypeParam::kName);
    EXPECT_GE(c->rank(), 0);
    EXPECT_LT(c->rank(), world);
    seen.push_back(c->rank());
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "two local ranks share a number";
}

// Sums and averages over every rank, three collectives of different sizes
// queued back to back on each stream before one synchronize: each lands on
// its own buffer, in order. The values are small whole numbers, so any
// summation order gives the same exact sum.
TYPED_TEST(CommunicatorContract, AllReduceSumsAndAveragesOverEveryRankInQueueOrder) {
  Ranks& g = this->ranks_;
  const int world = g.comms.front()->size();
  const std::vector<std::size_t> sizes{1, 1001, 65537};
  std::vector<std::vector<std::vector<float>>> data(g.comms.size());
  g.each([&](std::size_t i) {
    const int rank = g.comms[i]->rank();
    for (const std::size_t n : sizes) {
      auto& v = data[i].emplace_back(n);
      for (std::size_t k = 0; k < n; ++k) v[k] = static_cast<float>(rank + 1) + static_cast<float>(k % 7);
    }
    Stream& s = *g.streams[i];
    g.comms[i]->all_reduce(s, data[i][0].data(), sizes[0], ReduceOp::sum);
    g.comms[i]->all_reduce(s, data[i][1].data(), sizes[1], ReduceOp::average);
    g.comms[i]->all_reduce(s, data[i][2].data(), sizes[2], ReduceOp::sum);
    g.backends[i]->synchronize(s);
  });
  const float rank_sum = static_cast<float>(world * (world + 1) / 2);
  for (std::size_t i = 0; i < g.comms.size(); ++i) {
    for (std::size_t j = 0; j < sizes.size(); ++j) {
      for (std::size_t k = 0; k < sizes[j]; k += 97) {
        const float sum = rank_sum + static_cast<float>(world) * static_cast<float>(k % 7);
        const float want = j == 1 ? sum / static_cast<float>(world) : sum;
        ASSERT_FLOAT_EQ(data[i][j][k], want)
            << "rank " << g.comms[i]->rank() << ", collective " << j << ", element " << k;
      }
      ASSERT_FLOAT_EQ(data[i][j].back(),
                      (j == 1 ? 1.0F / static_cast<float>(world) : 1.0F) *
                          (rank_sum + static_cast<float>(world) * static_cast<float>((sizes[j] - 1) % 7)));
    }
  }
}

TYPED_TEST(CommunicatorContract, BroadcastGivesEveryRankTheRootsBuffer) {
  Ranks& g = this->ranks_;
  const int world = g.comms.front()->size();
  for (int root = 0; root < world; ++root) {
    std::vector<std::vector<float>> data(g.comms.size());
    g.each([&](std::size_t i) {
      const int rank = g.comms[i]->rank();
      data[i].assign(513, 0.0F);
      for (std::size_t k = 0; k < data[i].size(); ++k)
        data[i][k] = static_cast<float>(rank * 1000) + 0.5F * static_cast<float>(k);
      g.comms[i]->broadcast(*g.streams[i], data[i].data(), data[i].size(), root);
      g.backends[i]->synchronize(*g.streams[i]);
    });
    for (std::size_t i = 0; i < g.comms.size(); ++i) {
      for (std::size_t k = 0; k < data[i].size(); ++k) {
        ASSERT_EQ(data[i][k], static_cast<float>(root * 1000) + 0.5F * static_cast<float>(k))
            << "root " << root << ", rank " << g.comms[i]->rank() << ", element " << k;
      }
    }
  }
}

TYPED_TEST(CommunicatorContract, ABarrierReleasesNoRankBeforeEveryRankArrives) {
  Ranks& g = this->ranks_;
  std::atomic<int> arrived{0};
  std::vector<int> seen(g.comms.size(), -1);
  for (int round = 0; round < 3; ++round) {
    g.each([&](std::size_t i) {
      arrived.fetch_add(1);
      g.comms[i]->barrier();
      seen[i] = arrived.load();
    });
    for (std::size_t i = 0; i < g.comms.size(); ++i) {
      EXPECT_GE(seen[i], static_cast<int>(g.comms.size()) * (round + 1)) << "local rank " << i << " left early";
    }
  }
}

TYPED_TEST(CommunicatorContract, ARootOutsideTheWorldIsAConfigErrorBeforeAnythingIsSent) {
  Ranks& g = this->ranks_;
  const int world = g.comms.front()->size();
  std::vector<float> v(4, 1.0F);
  for (std::size_t i = 0; i < g.comms.size(); ++i) {
    EXPECT_THROW(g.comms[i]->broadcast(*g.streams[i], v.data(), v.size(), world), ConfigError);
    EXPECT_THROW(g.comms[i]->broadcast(*g.streams[i], v.data(), v.size(), -1), ConfigError);
  }
  // Nothing was queued: the group still works.
  g.each([&](std::size_t i) {
    std::vector<float> one{1.0F};
    g.comms[i]->all_reduce(*g.streams[i], one.data(), 1, ReduceOp::sum);
    g.backends[i]->synchronize(*g.streams[i]);
    EXPECT_EQ(one[0], static_cast<float>(world));
  });
}

// ---------------------------------------------------------------------------
// The thread group's own promises.

TEST(ThreadCommunicatorTest, AllReduceSumsAndAveragesInRankOrder) {
  for (const int ranks : {1, 2, 3, 4}) {
    Group g(ranks);
    const std::size_t n = 1001;  // not divisible by the rank count: uneven chunks
    std::vector<std::vector<float>> data(static_cast<std::size_t>(ranks), std::vector<float>(n));
    for (int r = 0; r < ranks; ++r) {
      for (std::size_t i = 0; i < n; ++i)
        data[static_cast<std::size_t>(r)][i] = 0.1F * static_cast<float>(r + 1) + 1e-7F * static_cast<float>(i);
    }
    auto expect = data[0];
    for (std::size_t i = 0; i < n; ++i) {
      float s = 0;
      for (int r = 0; r < ranks; ++r) s += data[static_cast<std::size_t>(r)][i];  // rank order, as documented
      expect[i] = s / static_cast<float>(ranks);
    }
    g.each([&](int r) {
      auto& b = *g.backends[static_cast<std::size_t>(r)];
      auto& s = *g.streams[static_cast<std::size_t>(r)];
      g.comms[static_cast<std::size_t>(r)]->all_reduce(s, data[static_cast<std::size_t>(r)].data(), n,
                                                       ReduceOp::average);
      b.synchronize(s);
    });
    for (int r = 0; r < ranks; ++r)
      EXPECT_EQ(data[static_cast<std::size_t>(r)], expect) << ranks << " ranks, rank " << r;
  }
}

TEST(ThreadCommunicatorTest, BroadcastCopiesTheRootsBuffer) {
  Group g(3);
  std::vector<std::vector<float>> data{{1, 2, 3}, {4, 5, 6}, {7, 8, 9}};
  g.each([&](int r) {
    g.comms[static_cast<std::size_t>(r)]->broadcast(*g.streams[static_cast<std::size_t>(r)],
                                                    data[static_cast<std::size_t>(r)].data(), 3, 1);
    g.backends[static_cast<std::size_t>(r)]->synchronize(*g.streams[static_cast<std::size_t>(r)]);
  });
  for (const auto& d : data) EXPECT_EQ(d, (std::vector<float>{4, 5, 6}));
  EXPECT_THROW(g.comms[0]->broadcast(*g.streams[0], data[0].data(), 3, 3), ConfigError);
}

TEST(ThreadCommunicatorTest, MismatchedCollectivesFailOnEveryRank) {
  Group g(2);
  std::vector<float> a(8), b(9);
  std::vector<std::string> errors(2);
  g.each([&](int r) {
    auto& s = *g.streams[static_cast<std::size_t>(r)];
    g.comms[static_cast<std::size_t>(r)]->all_reduce(s, r == 0 ? a.data() : b.data(), r == 0 ? 8 : 9, ReduceOp::sum);
    try {
      g.backends[static_cast<std::size_t>(r)]->synchronize(s);
    } catch (const CommError& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("ranks disagree"), std::string::npos) << e;
  }
}

TEST(ThreadCommunicatorTest, AMissingRankTimesOutNamingIt) {
  CommConfig cfg;
  cfg.timeout = std::chrono::milliseconds(200);
  Group g(3, cfg);
  std::vector<float> x(4);
  std::string error;
  // Ranks 0 and 1 call; rank 2 never does.
  g.each([&](int r) {
    if (r == 2) return;
    auto& s = *g.streams[static_cast<std::size_t>(r)];
    g.comms[static_cast<std::size_t>(r)]->all_reduce(s, x.data(), 4, ReduceOp::sum);
    try {
      g.backends[static_cast<std::size_t>(r)]->synchronize(s);
    } catch (const CommError& e) {
      if (r == 0) error = e.what();
      EXPECT_EQ(e.bytes(), 16U);
    }
  });
  EXPECT_NE(error.find("rank(s) 2"), std::string::npos) << error;
}

TEST(ThreadCommunicatorTest, AbortReleasesRanksWaitingInACollective) {
  Group g(2);
  std::vector<float> x(4);
  auto& s = *g.streams[0];
  g.comms[0]->all_reduce(s, x.data(), 4, ReduceOp::sum);  // rank 1 never joins
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  g.comms[1]->abort("rank 1 failed to decode its batch");
  try {
    g.backends[0]->synchronize(s);
    FAIL() << "the waiting collective must fail";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 failed to decode"), std::string::npos) << e.what();
  }
}

// The NCCL communicator's abort must not wait for a rank blocked in a
// collective either (it only tries the enqueue lock); its CPU twin: a rank
// blocked in barrier() is released by another rank's abort, promptly.
TEST(ThreadCommunicatorTest, AbortReleasesARankBlockedInABarrier) {
  Group g(2);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  std::thread blocked([&] {
    try {
      g.comms[0]->barrier();  // rank 1 never comes
    } catch (const CommError& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  g.comms[1]->abort("rank 1 lost its GPU");
  blocked.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(error.find("rank 1 lost its GPU"), std::string::npos) << error;
}

TEST(SoloCommunicatorTest, AWorldOfOneIsTheIdentityAndAbortFailsLaterCalls) {
  CpuBackend b;
  auto s = b.create_stream();
  auto comm = make_solo_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->name(), "solo");
  std::vector<float> data{1.5F, -2.0F, 3.25F};
  const auto before = data;
  comm->all_reduce(*s, data.data(), data.size(), ReduceOp::sum);
  comm->all_reduce(*s, data.data(), data.size(), ReduceOp::average);
  comm->broadcast(*s, data.data(), data.size(), 0);
  comm->barrier();
  b.synchronize(*s);
  EXPECT_EQ(data, before);
  EXPECT_THROW(comm->broadcast(*s, data.data(), 3, 1), ConfigError);
  comm->abort("rank 0 failed");
  try {
    comm->all_reduce(*s, data.data(), data.size(), ReduceOp::sum);
    FAIL() << "an aborted communicator accepted a collective";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("aborted: rank 0 failed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm->barrier(), CommError);
}

// The launch channels NCCL bootstraps through: rank 0's bytes reach every
// rank. The store's, as three torchrun-style ranks (threads) on loopback.
TEST(LaunchChannelTest, TheStoreSharesRank0sBytesWithEveryRank) {
  constexpr int kWorld = 3;
  std::vector<std::vector<char>> got(kWorld);
  std::vector<std::unique_ptr<LaunchChannel>> channels(kWorld);  // outlive every get (rank 0 serves)
  const auto errors = as_torchrun_ranks(kWorld, [&](const LaunchEnv& env) {
    const auto i = static_cast<std::size_t>(env.rank);
    channels[i] = open_store_channel(env, std::chrono::seconds(30));
    EXPECT_EQ(channels[i]->rank(), env.rank);
    EXPECT_EQ(channels[i]->size(), kWorld);
    got[i] = channels[i]->share_from_rank0(
        "test/id", env.rank == 0 ? std::vector<char>{'i', 'd', '\0', 'x'} : std::vector<char>{'n', 'o'});
  });
  for (int k = 0; k < kWorld; ++k) {
    EXPECT_EQ(errors[static_cast<std::size_t>(k)], "") << "rank " << k;
    EXPECT_EQ(got[static_cast<std::size_t>(k)], (std::vector<char>{'i', 'd', '\0', 'x'})) << "rank " << k;
  }
}

// MPI_COMM_WORLD's, one rank per process (ctest's
// CommunicatorContract.UnderMpirun runs it); without MPI, the row says so.
TEST(LaunchChannelTest, MpiSharesRank0sBytesWithEveryRank) {
  const LaunchEnv env = read_launch_env();
  if (!mpi_compiled()) {
    LaunchEnv two;
    two.world_size = 2;
    two.launcher = "mpi";
    EXPECT_THROW((void)open_mpi_channel(two, std::chrono::seconds(1)), ConfigError);
    return;
  }
  if (env.launcher != "mpi") GTEST_SKIP() << "run under mpirun (ctest's CommunicatorContract.UnderMpirun does)";
  const auto channel = launch_bootstrap(env).open_channel(env, std::chrono::seconds(30));
  EXPECT_EQ(channel->rank(), env.rank);
  EXPECT_EQ(channel->size(), env.world_size);
  const std::vector<char> mine(static_cast<std::size_t>(100 + channel->rank()),
                               static_cast<char>('a' + channel->rank()));
  EXPECT_EQ(channel->share_from_rank0("test/id", mine), std::vector<char>(100, 'a'));
}

}  // namespace
}  // namespace pinfeed::trainer
