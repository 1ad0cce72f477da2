// ThreadCommunicator: results, determinism, mismatched calls, timeouts and
// abort; the solo communicator.
#include <gtest/gtest.h>

#include <thread>

#include "pinfeed/trainer/communicator.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"

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

TEST(ThreadCommunicatorTest, AllReduceSumsAndAveragesInRankOrder) {
  for (const int ranks : {1, 2, 3, 4}) {
    Group g(ranks);
    const std::size_t n = 1001;  // not divisible by the rank count: uneven chunks
    std::vector<std::vector<float>> data(static_cast<std::size_t>(ranks), std::vector<float>(n));
    for (int r = 0; r < ranks; ++r) {
      for (std::size_t i = 0; i < n; ++i) data[static_cast<std::size_t>(r)][i] = 0.1F * static_cast<float>(r + 1) + 1e-7F * static_cast<float>(i);
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
      g.comms[static_cast<std::size_t>(r)]->all_reduce(s, data[static_cast<std::size_t>(r)].data(), n, ReduceOp::average);
      b.synchronize(s);
    });
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(data[static_cast<std::size_t>(r)], expect) << ranks << " ranks, rank " << r;
  }
}

TEST(ThreadCommunicatorTest, BroadcastCopiesTheRootsBuffer) {
  Group g(3);
  std::vector<std::vector<float>> data{{1, 2, 3}, {4, 5, 6}, {7, 8, 9}};
  g.each([&](int r) {
    g.comms[static_cast<std::size_t>(r)]->broadcast(*g.streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)].data(), 3, 1);
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

}  // namespace
}  // namespace pinfeed::trainer
