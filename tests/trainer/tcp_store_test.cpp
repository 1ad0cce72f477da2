// TcpStore (trainer/src/tcp_store.hpp): the rendezvous store of torchrun
// launches, served and used in one process here. Its interoperation with
// torch's own TCPStore server is covered by DdpLaunchTest.UnderTorchrunAgentStore.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

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

TEST(TcpStoreTest, ALaunchWithoutTheStoreVariablesIsAConfigError) {
  LaunchEnv env;
  env.launcher = "torchrun";
  env.world_size = 2;
  if (std::getenv("MASTER_ADDR") != nullptr) GTEST_SKIP() << "MASTER_ADDR is set in this environment";
  EXPECT_THROW((void)connect_launch_store(env, 1s), ConfigError);
}

}  // namespace
}  // namespace pinfeed::trainer::detail
