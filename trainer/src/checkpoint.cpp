#include "pinfeed/trainer/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fmt/format.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"

namespace pinfeed::trainer {
namespace {

// Format 02: magic, header length, JSON header, weights, momentum, then
// zlib's CRC-32 of all of it in the last 8 bytes. (01 had a hand-written
// FNV-1a there.)
constexpr char kMagic[8] = {'P', 'F', 'C', 'K', 'P', 'T', '0', '2'};
constexpr char kMagicV1[8] = {'P', 'F', 'C', 'K', 'P', 'T', '0', '1'};

std::uint64_t checksum(const std::byte* p, std::size_t n) {
  return crc32_z(crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(p), n);
}

template <class T>
void put(std::vector<std::byte>& out, const T* p, std::size_t count) {
  const auto* b = reinterpret_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + count * sizeof(T));
}

void write_all(int fd, const std::byte* p, std::size_t n, const std::filesystem::path& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw DataError(path, fmt::format("write failed: {}", std::strerror(errno)));
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

}  // namespace

void save_checkpoint(const std::filesystem::path& path, const Checkpoint& c, const SaveHooks& hooks) {
  if (c.weights.size() != c.momentum.size()) throw ConfigError("checkpoint: weights and momentum differ in size");
  nlohmann::json h;
  h["format"] = 1;
  h["step"] = c.step;
  h["epoch"] = c.epoch;
  h["position"] = c.position;
  h["seed"] = c.seed;
  h["world_size"] = c.world_size;
  h["global_batch"] = c.global_batch;
  h["model"] = {{"image_size", c.model.image_size}, {"pool", c.model.pool}, {"hidden", c.model.hidden},
                {"classes", c.model.classes}, {"spec", c.model.spec()}};
  h["params"] = c.weights.size();
  h["buffers"] = c.buffers.size();
  const std::string header = h.dump();
  std::vector<std::byte> out;
  out.reserve(32 + header.size() + (2 * c.weights.size() + c.buffers.size()) * sizeof(float));
  put(out, kMagic, sizeof kMagic);
  const std::uint64_t len = header.size();
  put(out, &len, 1);
  put(out, header.data(), header.size());
  put(out, c.weights.data(), c.weights.size());
  put(out, c.momentum.data(), c.momentum.size());
  put(out, c.buffers.data(), c.buffers.size());
  const std::uint64_t sum = checksum(out.data(), out.size());
  put(out, &sum, 1);

  const std::filesystem::path dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const std::filesystem::path tmp = dir / fmt::format(".{}.tmp.{}", path.filename().string(), ::getpid());
  try {
    const UniqueFd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!f) throw DataError(tmp, fmt::format("cannot create: {}", std::strerror(errno)));
    write_all(f.get(), out.data(), out.size(), tmp);
    if (::fsync(f.get()) != 0) throw DataError(tmp, fmt::format("fsync failed: {}", std::strerror(errno)));
  } catch (...) {
    ::unlink(tmp.c_str());  // a failed write (disk full) leaves no temporary behind
    throw;
  }
  if (hooks.before_rename) hooks.before_rename();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw DataError(path, fmt::format("cannot rename {} over it: {}", tmp.string(), std::strerror(e)));
  }
  const UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d) (void)::fsync(d.get());  // the rename itself durable; best effort
}

Checkpoint load_checkpoint(const std::filesystem::path& path) {
  std::vector<std::byte> in;  // sized from the file, never from a header field
  read_regular_file(path, "a checkpoint", kMaxCheckpointBytes, in);
  return parse_checkpoint(in, path);
}

Checkpoint parse_checkpoint(std::span<const std::byte> in, const std::filesystem::path& path) {
  if (in.size() >= sizeof kMagicV1 && std::memcmp(in.data(), kMagicV1, sizeof kMagicV1) == 0) {
    throw DataError(path, "checkpoint format 01, written by a pinfeed before 2026-12-01: resume it with that "
                          "version, or start the run again");
  }
  if (in.size() < sizeof kMagic + 16 || std::memcmp(in.data(), kMagic, sizeof kMagic) != 0) {
    throw DataError(path, "not a pinfeed checkpoint (bad magic or too short)");
  }
  std::uint64_t stored = 0;
  std::memcpy(&stored, in.data() + in.size() - 8, 8);
  if (checksum(in.data(), in.size() - 8) != stored) throw DataError(path, "checksum mismatch (truncated or corrupt)");
  std::uint64_t len = 0;
  std::memcpy(&len, in.data() + 8, 8);
  if (len > in.size() - 24) throw DataError(path, "header length past the end of the file");
  Checkpoint c;
  try {
    const auto h = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(in.data() + 16), len));
    if (h.at("format").get<int>() != 1) throw DataError(path, "unknown checkpoint format");
    c.step = h.at("step");
    c.epoch = h.at("epoch");
    c.position = h.at("position");
    c.seed = h.at("seed");
    c.world_size = h.at("world_size");
    c.global_batch = h.at("global_batch");
    c.model.image_size = h.at("model").at("image_size");
    c.model.pool = h.at("model").at("pool");
    c.model.hidden = h.at("model").at("hidden").get<std::vector<int>>();
    c.model.classes = h.at("model").at("classes");
    // Written before the CNN: an MLP, and no buffers.
    if (h.at("model").contains("spec")) {
      try {
        c.model.parse_spec(h.at("model").at("spec").get<std::string>());
      } catch (const ConfigError& e) {
        throw DataError(path, fmt::format("bad model in the header: {}", e.what()));
      }
    }
    const std::uint64_t n = h.at("params").get<std::uint64_t>();
    const std::uint64_t nb = h.value("buffers", std::uint64_t{0});
    // Compared without multiplying a header field: a crafted count must not
    // wrap into a small allocation size, nor size one past the file.
    const std::uint64_t data_bytes = in.size() - 24 - len;
    const std::uint64_t floats = data_bytes / sizeof(float);
    if (data_bytes % sizeof(float) != 0 || n > floats / 2 || nb > floats || 2 * n + nb != floats) {
      throw DataError(path, fmt::format("parameter data does not match the header ({} parameters and {} buffer values "
                                        "declared, {} bytes of data)",
                                        n, nb, data_bytes));
    }
    c.weights.resize(n);
    c.momentum.resize(n);
    c.buffers.resize(nb);
    // memcpy (the floats need not be aligned in the file), but never with an
    // empty vector's data(), which may be null even for 0 bytes.
    const std::byte* at = in.data() + 16 + len;
    const auto take = [&](std::vector<float>& v) {
      if (!v.empty()) std::memcpy(v.data(), at, v.size() * sizeof(float));
      at += v.size() * sizeof(float);
    };
    take(c.weights);
    take(c.momentum);
    take(c.buffers);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(path, fmt::format("bad checkpoint header: {}", e.what()));
  }
  return c;
}

void check_checkpoint_writable(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
    throw DataError(path, "exists and is not a regular file: a checkpoint cannot be written there");
  }
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  if (!fs::is_directory(dir, ec)) throw DataError(dir, "checkpoint folder does not exist");
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  const fs::path probe = dir / fmt::format(".{}.probe.{}.{}", path.filename().string(), host, ::getpid());
  UniqueFd fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) throw DataError(dir, fmt::format("checkpoint folder does not take a new file: {}", std::strerror(errno)));
  fd.reset();
  ::unlink(probe.c_str());
}

}  // namespace pinfeed::trainer
