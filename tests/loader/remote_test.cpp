// Remote shards' naming, addressing and cache, with pipe: shards (a real
// command's output, no server needed). HTTP, S3 and faults against real
// servers: tests/python/test_remote.py.
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <fmt/format.h>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <thread>
#include <vector>

#include "fixtures.hpp"
#include "image_fixtures.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/dataset_kinds.hpp"
#include "pinfeed/loader/remote.hpp"
#include "pinfeed/loader/streamed.hpp"
#include "pinfeed/memory/memory_snapshot.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"

namespace pinfeed::loader {
namespace {

namespace fs = std::filesystem;

TEST(RemoteTest, SchemesAreRecognisedAndNamedByTheirFile) {
  EXPECT_TRUE(is_remote_url("http://h/a.tar"));
  EXPECT_TRUE(is_remote_url("https://h/a.tar"));
  EXPECT_TRUE(is_remote_url("s3://b/k.tar"));
  EXPECT_TRUE(is_remote_url("pipe:cat x.tar"));
  EXPECT_FALSE(is_remote_url("/data/http/a.tar"));
  EXPECT_FALSE(is_remote_url("file.tar"));
  EXPECT_EQ(remote_shard_name("https://h/p/train-000001.tar?X-Amz-Signature=abc"), "train-000001.tar");
  EXPECT_EQ(remote_shard_name("s3://bucket/p/q/train-000002.tar"), "train-000002.tar");
  EXPECT_EQ(remote_shard_name("pipe:aws s3 cp s3://b/train-000003.tar -"), "train-000003.tar");
  EXPECT_EQ(remote_shard_name("pipe:curl -s 'https://h/x/train-000004.tar'"), "train-000004.tar");
  EXPECT_TRUE(remote_shard_name("pipe:make-a-shard").starts_with("pipe-"));
  EXPECT_THROW((void)remote_shard_name("https://host/"), ConfigError);
}

TEST(RemoteTest, S3UrlsGoToTheEndpointOrToAws) {
  ::setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/", 1);
  EXPECT_EQ(http_url("s3://bucket/a/b.tar"), "http://127.0.0.1:9000/bucket/a/b.tar");
  // The key as it is, sent percent-encoded (the path's '/' kept).
  EXPECT_EQ(http_url("s3://bucket/odd key%/x+y.tar"), "http://127.0.0.1:9000/bucket/odd%20key%25/x%2By.tar");
  ::unsetenv("AWS_ENDPOINT_URL");
  ::setenv("AWS_REGION", "eu-west-3", 1);
  EXPECT_EQ(http_url("s3://bucket/a/b.tar"), "https://bucket.s3.eu-west-3.amazonaws.com/a/b.tar");
  ::unsetenv("AWS_REGION");
  EXPECT_EQ(http_url("https://h/x.tar"), "https://h/x.tar");
  EXPECT_THROW((void)http_url("s3:///key.tar"), ConfigError);
}

class RemoteCacheTest : public ::testing::Test {
 protected:
  testing::TempDir dir_;
  testing::SmallDataset data_ = testing::make_small_dataset(dir_.path(), 3, 4);
  std::vector<std::string> pipes() const {
    std::vector<std::string> out;
    for (const fs::path& p : expand_shard_pattern(data_.shards)) out.push_back("pipe:cat " + p.string());
    return out;
  }
};

TEST_F(RemoteCacheTest, PipeShardsReadAsTheLocalShardsAndKeepTheirFingerprint) {
  const auto local = open_dataset(data_.shards);
  std::string spec;
  for (const std::string& u : pipes()) spec += (spec.empty() ? "" : ",") + u;
  const auto remote = open_dataset(spec);
  ASSERT_EQ(remote->size(), local->size());
  std::vector<std::byte> a, b;
  for (std::size_t i = 0; i < local->size(); ++i) {
    local->read(i, a);
    remote->read(i, b);
    EXPECT_EQ(a, b);
    EXPECT_EQ(remote->label(i), local->label(i));
  }
  EXPECT_EQ(fingerprint(*remote).hash, fingerprint(*local).hash);
  EXPECT_TRUE(remote->describe(0).starts_with("pipe:cat ")) << remote->describe(0);
}

TEST_F(RemoteCacheTest, AFailingCommandIsARemoteErrorNamingIt) {
  RemoteConfig config;
  config.retries = 1;
  config.backoff = 0.01;
  try {
    (void)open_dataset("pipe:exit 3; x.tar", {}, kDefaultMaxClasses, config);
    FAIL() << "no error";
  } catch (const RemoteError& e) {
    EXPECT_NE(
        std::string(e.what()).find("pipe:exit \u2026 x.tar: the command exited with status 3 (gave up after 2 tries)"),
        std::string::npos)
        << e.what();
  }
}

TEST_F(RemoteCacheTest, OutputThatIsNotAWholeTarIsNeverCached) {
  RemoteConfig config;
  config.retries = 1;
  config.backoff = 0.01;
  config.cache_dir = dir_.path() / "cache";
  // An error page where a shard should be (curl without -f prints it, exit 0).
  try {
    (void)stage_shards({"pipe:printf '<html>503 Service Unavailable</html>' # x.tar"}, config);
    FAIL() << "no error";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("not a tar shard"), std::string::npos) << e.what();
  }
  for (const auto& f : fs::recursive_directory_iterator(config.cache_dir)) {
    EXPECT_NE(f.path().extension(), ".meta") << f.path();
    EXPECT_NE(f.path().filename(), "x.tar") << f.path();
  }
}

TEST(RemoteTest, UrlsAreShownWithoutSecrets) {
  EXPECT_EQ(redact_url("https://user:pw@h/p/a.tar?X-Amz-Signature=s&X-Amz-Security-Token=t"), "https://h/p/a.tar");
  EXPECT_EQ(redact_url("s3://b/k.tar"), "s3://b/k.tar");
  EXPECT_EQ(redact_url("pipe:cat a.tar"), "pipe:cat a.tar");
  EXPECT_EQ(redact_url("pipe:curl -s -H 'Authorization: Bearer T0KEN' https://u:pw@h/a.tar?s=1"),
            "pipe:curl \u2026 https://h/a.tar");
  EXPECT_EQ(redact_url("pipe:AWS_SECRET_ACCESS_KEY=s3cr3t aws s3 cp s3://b/x.tar -"), "pipe:aws \u2026 s3://b/x.tar");
  // Quotes and a '/' in a value (half of AWS secret keys have one) hide nothing.
  EXPECT_EQ(redact_url("pipe:AUTH='Bearer T0K' KEY=ab/cd curl -s \"https://h/a.tar\""),
            "pipe:curl \u2026 https://h/a.tar");
  EXPECT_EQ(redact_spec("https://u:pw@h/s-{0..3}.tar?t=X,/data/a.tar,s3://b/c.tar"),
            "https://h/s-{0..3}.tar,/data/a.tar,s3://b/c.tar");
  const RemoteError e("https://h/a.tar?sig=secret", 403, "HTTP status 403");
  EXPECT_EQ(std::string(e.what()).find("secret"), std::string::npos) << e.what();
  EXPECT_EQ(e.url(), "https://h/a.tar");
}

TEST_F(RemoteCacheTest, ACachedShardIsReusedAndATornOneIsFetchedAgain) {
  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  const auto urls = pipes();
  StagedShards first = stage_shards(urls, config);
  EXPECT_GT(first.fetched_bytes, 0U);
  EXPECT_EQ(first.reused_bytes, 0U);
  first.keep.reset();
  StagedShards second = stage_shards(urls, config);
  EXPECT_EQ(second.fetched_bytes, 0U);
  EXPECT_EQ(second.reused_bytes, first.fetched_bytes);
  ASSERT_EQ(second.local, first.local);
  second.keep.reset();
  fs::resize_file(first.local[1], 512);  // torn: the sidecar says another size
  StagedShards third = stage_shards(urls, config);
  EXPECT_EQ(third.fetched_bytes, fs::file_size(third.local[1]));
  EXPECT_NE(fs::file_size(third.local[1]), 512U);
}

TEST_F(RemoteCacheTest, EvictionPassesOverShardsInUse) {
  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  auto urls = pipes();
  ASSERT_EQ(urls.size(), 2U);
  urls.push_back(urls[0] + " # the same bytes, another URL: another cache entry");
  StagedShards held = stage_shards({urls[0]}, config);  // stays open
  const std::uint64_t one = fs::file_size(held.local[0]);
  config.cache_limit = one;  // room for one shard only
  StagedShards next = stage_shards({urls[1]}, config);
  EXPECT_TRUE(fs::exists(held.local[0])) << "evicted while a dataset holds it";
  EXPECT_TRUE(fs::exists(next.local[0]));
  next.keep.reset();
  StagedShards third = stage_shards({urls[2]}, config);  // the unheld, older one goes
  EXPECT_FALSE(fs::exists(next.local[0]));
  EXPECT_TRUE(fs::exists(held.local[0]));
}

TEST_F(RemoteCacheTest, APrivateFolderGoesWithTheDataset) {
  StagedShards s = stage_shards(pipes(), RemoteConfig{});
  const fs::path root = s.local[0].parent_path().parent_path();
  ASSERT_TRUE(fs::exists(root));
  s.keep.reset();
  EXPECT_FALSE(fs::exists(root));
}

TEST_F(RemoteCacheTest, WhatKilledProcessesLeftIsSweptAndNothingElse) {
  // A private folder of a process that is gone (a real, reaped child's pid),
  // one of a live process (ours), and a .part nobody fetches in a cache_dir.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  const fs::path tmp = dir_.path() / "tmp";
  const fs::path dead = tmp / fmt::format("pinfeed-shards-{}-abcdef", child);
  const fs::path live = tmp / fmt::format("pinfeed-shards-{}-ghijkl", ::getpid());
  fs::create_directories(dead / "x");
  fs::create_directories(live / "x");
  testing::write_bytes(dead / ".owner", {});  // its owner's lock free: gone
  // A PID this process cannot see (another PID namespace sharing /tmp), its
  // owner's lock held: in use, whatever kill(pid, 0) says.
  const fs::path elsewhere = tmp / fmt::format("pinfeed-shards-{}-mnopqr", child);
  fs::create_directories(elsewhere / "x");
  testing::write_bytes(elsewhere / ".owner", {});
  const UniqueFd held(::open((elsewhere / ".owner").c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(held && ::flock(held.get(), LOCK_EX) == 0);
  const char* was = std::getenv("TMPDIR");
  const std::string saved = was != nullptr ? was : "";
  ::setenv("TMPDIR", tmp.c_str(), 1);
  { StagedShards s = stage_shards({pipes()[0]}, RemoteConfig{}); }
  if (was != nullptr)
    ::setenv("TMPDIR", saved.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  EXPECT_FALSE(fs::exists(dead)) << "a gone process's folder stays";
  EXPECT_TRUE(fs::exists(live)) << "a live process's folder was removed";
  EXPECT_TRUE(fs::exists(elsewhere)) << "a folder whose owner holds its lock was removed";

  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  { StagedShards s = stage_shards({pipes()[0]}, config); }  // makes the cache's entry folder
  const fs::path torn = cache_path(pipes()[0], config).parent_path() / "train-000009.tar.part";
  testing::write_bytes(torn, std::as_bytes(std::span("half a shard")));
  { StagedShards s = stage_shards({pipes()[0]}, config); }
  EXPECT_FALSE(fs::exists(torn)) << "a killed fetch's .part stays";
}

// ---------------------------------------------------------------- the cache owns only its own files

TEST_F(RemoteCacheTest, SweepAndEvictionTouchNothingTheCacheDidNotMake) {
  // cache_dir is a folder people use ($HOME, a scratch): their files look
  // like ours by name, and one folder is even named like an entry.
  RemoteConfig config;
  config.cache_dir = dir_.path() / "home";
  const auto plant = [&](const fs::path& rel) {
    fs::create_directories((config.cache_dir / rel).parent_path());
    testing::write_bytes(config.cache_dir / rel, std::as_bytes(std::span("someone else's bytes, a few of them")));
  };
  const std::vector<fs::path> theirs = {"downloads/movie.mkv.part",
                                        "backup/x.tar",
                                        "backup/x.tar.meta",
                                        "pinfeed-0123456789abcdef/y.tar",
                                        "pinfeed-0123456789abcdef/y.tar.meta",
                                        "pinfeed-0123456789abcdef/z.tar.part",
                                        "a.tar.part"};
  for (const fs::path& p : theirs) plant(p);
  for (const fs::path& p : expand_shard_pattern(data_.shards)) {  // room for the largest shard: evict all it may
    config.cache_limit = std::max<std::uint64_t>(config.cache_limit, fs::file_size(p));
  }
  { StagedShards s = stage_shards(pipes(), config); }
  { StagedShards s = stage_shards({pipes()[0]}, config); }
  for (const fs::path& p : theirs) EXPECT_TRUE(fs::exists(config.cache_dir / p)) << p << " was removed";
  EXPECT_FALSE(fs::exists(cache_path(pipes()[1], config))) << "the cache's own unheld shard was not evicted";
}

TEST_F(RemoteCacheTest, APlantedLinkIsRefusedNamingItNeverFollowed) {
  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  const fs::path elsewhere = dir_.path() / "elsewhere";
  fs::create_directories(elsewhere);
  const fs::path entry = cache_path(pipes()[0], config).parent_path();
  fs::create_directories(config.cache_dir);
  fs::create_directory_symlink(elsewhere, entry);  // the entry folder, linked away
  try {
    (void)stage_shards({pipes()[0]}, config);
    ADD_FAILURE() << "a linked entry folder was used";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(entry.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(elsewhere)) << "wrote through the link";
  fs::remove(entry);

  // Inside a real entry: a dangling .lock link (would create a file outside)
  // and a .meta.tmp linked to a victim (would overwrite it).
  { StagedShards s = stage_shards({pipes()[0]}, config); }
  const fs::path shard = cache_path(pipes()[0], config);
  const fs::path victim = dir_.path() / "victim.txt";
  testing::write_bytes(victim, std::as_bytes(std::span("precious")));
  fs::remove(shard.string() + ".lock");
  fs::create_symlink(dir_.path() / "created-outside", shard.string() + ".lock");
  EXPECT_THROW((void)stage_shards({pipes()[0]}, config), DataError);
  EXPECT_FALSE(fs::exists(dir_.path() / "created-outside"));
  fs::remove(shard.string() + ".lock");
  fs::remove(shard.string() + ".meta");  // fetched again: the sidecar is written anew
  fs::create_symlink(victim, shard.string() + ".meta.tmp");
  { StagedShards s = stage_shards({pipes()[0]}, config); }
  EXPECT_EQ(fs::file_size(victim), 9U) << "the victim was written through a planted .meta.tmp";
  EXPECT_TRUE(fs::exists(shard.string() + ".meta"));
}

TEST_F(RemoteCacheTest, APipeCommandsSecretsNeverReachTheCache) {
  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  const std::string secret = "pipe:TOKEN=s3cr3t cat " + pipes()[0].substr(9);
  { StagedShards s = stage_shards({secret}, config); }
  const fs::path meta = cache_path(secret, config).string() + ".meta";
  std::string text(fs::file_size(meta), '\0');
  std::FILE* f = std::fopen(meta.c_str(), "rb");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(std::fread(text.data(), 1, text.size(), f), text.size());
  std::fclose(f);
  EXPECT_EQ(text.find("s3cr3t"), std::string::npos) << text;
  EXPECT_EQ(fs::status(meta).permissions() & (fs::perms::group_all | fs::perms::others_all), fs::perms::none);
}

// ---------------------------------------------------------------- bounded waits and bytes

TEST_F(RemoteCacheTest, ACommandsWholeProcessGroupIsKilledAtItsByteBudget) {
  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  config.cache_limit = 1 << 20;
  config.retries = 3;
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)stage_shards({"pipe:sleep 97.531 & cat /dev/zero # endless.tar"}, config);
    ADD_FAILURE() << "an endless command was cached";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("cache_limit"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "retried a bound";
  // SIGKILL is sent before staging returns; the kernel ends the process a moment later.
  bool gone = false;
  for (int k = 0; k < 40 && !gone; ++k) {
    gone = std::system("pgrep -f 'sleep 97[.]531' >/dev/null") != 0;
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(gone) << "the command's child outlived it";
  for (const auto& f : fs::recursive_directory_iterator(config.cache_dir)) {
    EXPECT_NE(f.path().extension(), ".part") << f.path() << " stays";
  }
}

TEST_F(RemoteCacheTest, AStalledCommandIsKilledAndAnotherProcesssLockIsWaitedForBoundedNamingIt) {
  RemoteConfig config;
  config.cache_dir = dir_.path() / "cache";
  config.read_timeout = 0.3;
  config.retries = 0;
  try {
    (void)stage_shards({"pipe:sleep 86.421 # stalled.tar"}, config);
    ADD_FAILURE() << "no error";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("remote_min_rate"), std::string::npos) << e.what();
  }
  EXPECT_NE(std::system("pgrep -f 'sleep 86[.]421' >/dev/null"), 0) << "the stalled command still runs";

  // Another process holds NAME.fetch (stopped in a debugger): a bounded
  // wait, then an error naming it.
  { StagedShards s = stage_shards({pipes()[0]}, config); }
  const std::string fetch = cache_path(pipes()[0], config).string() + ".fetch";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t holder = ::fork();
  if (holder == 0) {
    const int fd = ::open(fetch.c_str(), O_RDWR);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(1);
    (void)!::write(ready[1], "x", 1);
    ::pause();
    ::_exit(0);
  }
  ::close(ready[1]);  // a holder that fails closes the pipe: the read ends
  ready[1] = -1;
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)stage_shards({pipes()[0]}, config);
    ADD_FAILURE() << "no error";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("process {}", holder)), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ::kill(holder, SIGKILL);
  ::waitpid(holder, nullptr, 0);
  ::close(ready[0]);
}

TEST_F(RemoteCacheTest, StagingIsCancelledWithinAMoment) {
  RemoteConfig config;
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  config.cancel = cancel;
  std::jthread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cancel->store(true);
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)stage_shards({"pipe:sleep 75.319 # slow.tar", pipes()[0]}, config), Cancelled);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_NE(std::system("pgrep -f 'sleep 75[.]319' >/dev/null"), 0);
}

// ---------------------------------------------------------------- streamed shards' index

TEST_F(RemoteCacheTest, AnIndexSidecarIsTheIndexTheHeadersGive) {
  for (const fs::path& tar : expand_shard_pattern(data_.shards)) {
    const fs::path sidecar = write_shard_index(tar);
    EXPECT_EQ(sidecar, fs::path(tar.string() + ".index.json"));
    std::string text(fs::file_size(sidecar), '\0');
    std::FILE* f = std::fopen(sidecar.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(std::fread(text.data(), 1, text.size(), f), text.size());
    std::fclose(f);
    const ShardIndex index = parse_shard_index(text, sidecar.string(), kDefaultMaxClasses);
    const auto headers = TarShards::index(tar);
    EXPECT_EQ(index.size, fs::file_size(tar));
    ASSERT_EQ(index.samples.size(), headers.size());
    for (std::size_t k = 0; k < headers.size(); ++k) {
      EXPECT_EQ(index.samples[k].key, headers[k].key);
      EXPECT_EQ(index.samples[k].offset, headers[k].offset);
      EXPECT_EQ(index.samples[k].size, headers[k].size);
      EXPECT_EQ(index.samples[k].label, headers[k].label);
      EXPECT_EQ(index.samples[k].header_sum, headers[k].header_sum);
    }
  }
}

TEST_F(RemoteCacheTest, StreamedShardsOnDiskReadAsTarShardsWithTheirFingerprint) {
  // Local shards through the streamed reader: the same samples, bytes,
  // labels and fingerprint as TarShards, and no remote transfer at all.
  const auto local = open_dataset(data_.shards);
  std::vector<std::string> paths;
  for (const fs::path& p : expand_shard_pattern(data_.shards)) paths.push_back(p.string());
  const auto streamed = StreamedShards::open(paths, kDefaultMaxClasses, RemoteConfig{});
  ASSERT_NE(streamed, nullptr);
  ASSERT_EQ(streamed->size(), local->size());
  std::vector<std::size_t> order(local->size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  streamed->plan(order);
  std::vector<std::byte> a, b;
  for (const std::size_t i : order) {
    local->read(i, a);
    streamed->read(i, b);
    EXPECT_EQ(a, b);
    EXPECT_EQ(streamed->label(i), local->label(i));
    EXPECT_EQ(streamed->relative_name(i), local->relative_name(i));
  }
  EXPECT_EQ(fingerprint(*streamed).hash, fingerprint(*local).hash);
  EXPECT_EQ(streamed->stream_stats()->requests, 0U);
}

TEST(RemoteTest, ABrokenIndexIsRefusedNamingItAndTheSample) {
  const auto refused = [](const std::string& text, const std::string& says) {
    try {
      (void)parse_shard_index(text, "s3://b/train-000000.tar.index.json", 10);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("train-000000.tar.index.json"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  const std::string head = R"({"format":"pinfeed-shard-index","version":1,"size":4096,"samples":)";
  refused(R"({"format":"other","version":1,"size":1,"samples":[]})", "not a pinfeed shard index");
  refused(head + R"([["a.jpg",3584,1024,0,1]]})", "outside the 4096-byte shard");
  refused(head + R"([["a.jpg",100,10,0,1]]})", "outside");  // no room for its header
  refused(head + R"([["a.jpg",512,10,10,1]]})", "label 10 is not in 0..9");
  refused(head + R"([["a.jpg",512]]})", "not a readable shard index");
  refused("{", "not a readable shard index");
  // Entries a tar cannot have: on a block boundary, one member each, no
  // overlap, under the sample limit, whole numbers.
  refused(head + R"([["a.jpg",700,10,0,1]]})", "512-byte block");
  refused(head + R"([["a.jpg",512.5,10,0,1]]})", "fractional");
  refused(head + R"([["a.jpg",512,10,0,1],["a.jpg",1536,10,0,1]]})", "listed twice");
  refused(head + R"([["a.jpg",512,1000,0,1],["b.jpg",1024,10,0,1]]})", "overlap");
  refused(head + R"([["a.jpg",512,10,0,1],["b.jpg",512,20,0,1]]})", "overlap");
  // A hard link: another name for the same member (offset, size, checksum).
  EXPECT_EQ(parse_shard_index(head + R"([["a.jpg",512,10,0,1],["b.jpg",512,10,1,1]]})", "l.json", 10).samples.size(),
            2U);
  refused(head + "[[],[],[]]}", "0 fields");
  refused(R"({"format":"pinfeed-shard-index","version":1,"size":9000000000,"samples":[["a.jpg",512,8589934592,0,1]]})",
          "over the");
}

TEST(RemoteTest, ASidecarIsReadInBoundedMemory) {
  // 16 MiB of "[]," was a document tree of 5.6 million arrays (+440 MiB):
  // read by the SAX reader, it stops at the first, its memory the text's.
  std::string text = R"({"format":"pinfeed-shard-index","version":1,"size":4096,"samples":[)";
  while (text.size() < (16U << 20U)) text += "[],";
  text += "[]]}";
  EXPECT_THROW((void)parse_shard_index(text, "big.tar.index.json", 10), DataError);
  // A well-formed large one parses into its entries and nothing more.
  std::string good = R"({"format":"pinfeed-shard-index","version":1,"size":1048576000,"samples":[)";
  for (int k = 0; k < 100000; ++k)
    good += fmt::format(R"({}["k{}.jpg",{},100,0,1])", k == 0 ? "" : ",", k, 512 + 1024 * k);
  good += "]}";
  EXPECT_EQ(parse_shard_index(good, "good.tar.index.json", 10).samples.size(), 100000U);
}

TEST_F(RemoteCacheTest, TheReadAheadBoundFollowsThePressureLevel) {
  // The bound's rule (a unit test: the monitor is stepped with readings);
  // tests/pressure/remote_readahead.py holds it to a real memory cgroup.
  std::vector<std::string> paths;
  for (const fs::path& p : expand_shard_pattern(data_.shards)) paths.push_back(p.string());
  RemoteConfig config;
  config.readahead = 64ULL << 20U;
  auto streamed = StreamedShards::open(paths, kDefaultMaxClasses, config);
  ASSERT_NE(streamed, nullptr);
  memory::PressureMonitor::Config mc;
  mc.kernel_events = false;
  auto monitor = std::make_shared<memory::PressureMonitor>(mc);
  streamed->follow(monitor);
  EXPECT_EQ(streamed->stream_stats()->readahead_limit, 64ULL << 20U);
  memory::MemorySnapshot s;
  s.mem_total = 8ULL << 30U;
  s.mem_available = 100ULL << 20U;  // under 5%: critical
  s.taken_at = std::chrono::steady_clock::now();
  (void)monitor->step(s);
  ASSERT_EQ(monitor->level(), memory::PressureLevel::critical);
  EXPECT_EQ(streamed->stream_stats()->readahead_limit, 4ULL << 20U);
  streamed.reset();  // unsubscribes before the monitor goes
}

}  // namespace
}  // namespace pinfeed::loader
