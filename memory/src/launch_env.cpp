#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <string_view>

#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"

namespace pinfeed {
namespace {

int parse_int(const char* name, const char* text) {
  const std::string_view sv(text);
  int value = -1;
  const auto [end, ec] = std::from_chars(sv.data(), sv.data() + sv.size(), value);
  if (ec != std::errc() || end != sv.data() + sv.size() || value < 0) {
    throw ConfigError(fmt::format("environment variable {}='{}' is not a non-negative integer", name, sv));
  }
  return value;
}

}  // namespace

LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv) {
  struct Names {
    const char *launcher, *rank, *size, *local_rank, *local_size;
  };
  static constexpr Names kLaunchers[] = {
      {"mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  LaunchEnv env;
  for (const Names& n : kLaunchers) {
    const char* rank = getenv(n.rank);
    const char* size = getenv(n.size);
    if (rank == nullptr || size == nullptr) continue;
    env.launcher = n.launcher;
    env.rank = parse_int(n.rank, rank);
    env.world_size = parse_int(n.size, size);
    const char* lr = getenv(n.local_rank);
    const char* ls = getenv(n.local_size);
    // SLURM_NTASKS_PER_NODE may read "4(x2)" for a uniform layout: the count
    // before the parenthesis is the one for this node.
    std::string local_size_text;
    if (ls != nullptr) {
      local_size_text = ls;
      if (const auto paren = local_size_text.find('('); paren != std::string::npos) local_size_text.resize(paren);
      ls = local_size_text.c_str();
    }
    env.local_rank = lr != nullptr ? parse_int(n.local_rank, lr) : env.rank;
    env.local_size = ls != nullptr ? parse_int(n.local_size, ls) : env.world_size;
    if (env.world_size < 1 || env.rank >= env.world_size) {
      throw ConfigError(fmt::format("{}={} is not a rank of {}={}", n.rank, env.rank, n.size, env.world_size));
    }
    if (env.local_size < 1 || env.local_rank >= env.local_size) {
      throw ConfigError(fmt::format("{}={} is not below {}={}", n.local_rank, env.local_rank, n.local_size, env.local_size));
    }
    return env;
  }
  return env;
}

LaunchEnv read_launch_env() {
  return read_launch_env([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace pinfeed
