#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pinfeed/env.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"

namespace pinfeed {
namespace {

/// One launcher's reading, and whether its variables named the local rank
/// and size (else they are guesses: rank of world, one node).
struct Found : LaunchEnv {
  bool has_local = false;
};

int parse_int(const char* name, const char* text) {
  const std::string_view sv(text);
  int value = -1;
  const auto [end, ec] = std::from_chars(sv.data(), sv.data() + sv.size(), value);
  if (ec != std::errc() || end != sv.data() + sv.size() || value < 0) {
    throw ConfigError(fmt::format("environment variable {}='{}' is not a non-negative integer", name, sv));
  }
  return value;
}

/// Tasks on node `node` from a Slurm layout "4(x2),3": 4, 4, 3.
int tasks_on_node(const char* name, std::string_view layout, int node) {
  const std::string_view whole = layout;
  int seen = 0;
  while (!layout.empty()) {
    const std::string_view item = layout.substr(0, layout.find(','));
    layout.remove_prefix(std::min(layout.size(), item.size() + 1));
    int tasks = 0, repeat = 1;
    const auto paren = item.find("(x");
    const std::string_view count = item.substr(0, paren);
    auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), tasks);
    bool ok = ec == std::errc() && end == count.data() + count.size() && tasks > 0;
    if (ok && paren != std::string_view::npos) {
      const std::string_view times = item.substr(paren + 2, item.size() - paren - 3);
      auto [end2, ec2] = std::from_chars(times.data(), times.data() + times.size(), repeat);
      ok = item.back() == ')' && ec2 == std::errc() && end2 == times.data() + times.size() && repeat > 0;
    }
    if (!ok) {
      throw ConfigError(
          fmt::format("environment variable {}='{}' is not a Slurm task layout (at '{}'; "
                      "a layout reads like 4(x2),3)",
                      name, whole, item));
    }
    if (node < seen + repeat) return tasks;
    seen += repeat;
  }
  throw ConfigError(fmt::format("environment variable {} lists no node {}", name, node));
}

/// An srun step (not the batch script itself, whose one process also sees
/// SLURM_PROCID=0 and SLURM_NTASKS=N): rank, size, and the tasks of this
/// node from SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID (1 when absent).
Found read_slurm_step(const std::function<const char*(const char*)>& getenv) {
  Found env;
  env.source = "SLURM_PROCID/SLURM_STEP_NUM_TASKS";
  const char* step = getenv("SLURM_STEP_ID");
  const char* rank = getenv("SLURM_PROCID");
  const char* size = getenv("SLURM_STEP_NUM_TASKS");
  if (step == nullptr || rank == nullptr || size == nullptr) return Found{};
  const std::string_view s(step);
  if (s == "batch" || s == "extern" || s == "4294967294" || s == "4294967291") return Found{};
  env.launcher = "slurm";
  env.rank = parse_int("SLURM_PROCID", rank);
  env.world_size = parse_int("SLURM_STEP_NUM_TASKS", size);
  const char* local_rank = getenv("SLURM_LOCALID");
  const char* node = getenv("SLURM_NODEID");
  const char* layout = getenv("SLURM_STEP_TASKS_PER_NODE");
  env.has_local = local_rank != nullptr && layout != nullptr;
  env.local_rank = local_rank != nullptr ? parse_int("SLURM_LOCALID", local_rank) : 0;
  env.local_size = layout != nullptr ? tasks_on_node("SLURM_STEP_TASKS_PER_NODE", layout,
                                                     node != nullptr ? parse_int("SLURM_NODEID", node) : 0)
                                     : 1;
  if (env.world_size < 1 || env.rank >= env.world_size || env.local_rank >= env.local_size) {
    throw ConfigError(
        fmt::format("Slurm variables disagree: SLURM_PROCID={} of SLURM_STEP_NUM_TASKS={}, SLURM_LOCALID={} of "
                    "{} tasks on this node",
                    env.rank, env.world_size, env.local_rank, env.local_size));
  }
  return env;
}

/// One launcher's variables, or nullopt when its rank and size are unset.
std::optional<Found> read_launcher(const std::function<const char*(const char*)>& getenv, const char* launcher,
                                   const char* rank_name, const char* size_name, const char* local_rank_name,
                                   const char* local_size_name) {
  const char* rank = getenv(rank_name);
  const char* size = getenv(size_name);
  if (rank == nullptr && size == nullptr) return std::nullopt;
  // (PMI's half is left alone: some PMI-2 launches set PMI_RANK alone.)
  if ((rank == nullptr || size == nullptr) && std::string_view(launcher) == "pmi") return std::nullopt;
  if (rank == nullptr || size == nullptr) {
    // Half a launch (a hand-exported RANK, a script that forgot WORLD_SIZE):
    // guessing "rank 0 of 1" would train every process on the whole data.
    const char* set = rank != nullptr ? rank_name : size_name;
    const char* unset = rank != nullptr ? size_name : rank_name;
    throw ConfigError(fmt::format("{}={} is set but {} is not: set both (a launcher sets both), or neither", set,
                                  rank != nullptr ? rank : size, unset));
  }
  Found env;
  env.launcher = launcher;
  env.source = fmt::format("{}/{}", rank_name, size_name);
  env.rank = parse_int(rank_name, rank);
  env.world_size = parse_int(size_name, size);
  const char* lr = getenv(local_rank_name);
  const char* ls = getenv(local_size_name);
  env.has_local = lr != nullptr && ls != nullptr;
  env.local_rank = lr != nullptr ? parse_int(local_rank_name, lr) : env.rank;
  env.local_size = ls != nullptr ? parse_int(local_size_name, ls) : env.world_size;
  if (env.world_size < 1 || env.rank >= env.world_size) {
    throw ConfigError(fmt::format("{}={} is not a rank of {}={}", rank_name, env.rank, size_name, env.world_size));
  }
  if (env.local_size < 1 || env.local_rank >= env.local_size) {
    throw ConfigError(
        fmt::format("{}={} is not below {}={}", local_rank_name, env.local_rank, local_size_name, env.local_size));
  }
  return env;
}

std::string describe(const LaunchEnv& e) {
  return fmt::format("{} ({}) says rank {} of {}", e.launcher, e.source, e.rank, e.world_size);
}

/// Under torchrun's agent: torchrun decides, and an outer launch of more
/// processes is refused.
Found choose_under_torchrun_agent(const std::vector<Found>& found) {
  // torchrun's own workers (TORCHELASTIC_RUN_ID is set by its agent only):
  // whatever launched the agents (srun, mpirun, once per node or not) is
  // an outer launch whose variables the workers inherit; torchrun decides.
  // An outer launch of more processes than torchrun's is not one that
  // started these agents: stale variables, or torchrun runs that do not
  // know about each other (each would read the whole dataset).
  const Found& env = found.front();
  for (std::size_t i = 1; i < found.size(); ++i) {
    if (found[i].world_size > env.world_size) {
      throw ConfigError(
          fmt::format("the launch variables disagree: {}, but {}: more processes outside torchrun than "
                      "in it. Give torchrun --nnodes/--nproc-per-node for the whole job (or unset the "
                      "stale variables)",
                      describe(env), describe(found[i])));
    }
  }
  return env;
}

/// Without torchrun's agent: the first launcher found decides (a real
/// launcher over hand-exported RANK/WORLD_SIZE that agree with it); the
/// others must agree, or be an outer Slurm step of an MPI launch.
Found choose_launcher(const std::vector<Found>& found) {
  // RANK/WORLD_SIZE without torchrun's marker were exported by hand (or by
  // a script): when a real launcher agrees with them, that launcher
  // decides, so an mpirun launch stays an MPI launch.
  std::size_t first = 0;
  if (found.front().launcher == "torchrun" && found.size() > 1 && found[1].rank == found[0].rank &&
      found[1].world_size == found[0].world_size) {
    first = 1;
  }
  Found env = found[first];
  const bool mpi = env.launcher == "mpi" || env.launcher == "pmi";
  for (std::size_t i = 0; i < found.size(); ++i) {
    if (i == first) continue;
    const Found& other = found[i];
    if (other.rank == env.rank && other.world_size == env.world_size) {
      // An agreeing source that knows the node's layout fills in what the
      // deciding one lacks (srun --mpi=pmi2 sets PMI_RANK but no
      // MPI_LOCALRANKID; Slurm's SLURM_LOCALID has it).
      if (!env.has_local && other.has_local) {
        env.local_rank = other.local_rank;
        env.local_size = other.local_size;
        env.has_local = true;
      }
      continue;
    }
    // mpirun's daemons started by srun (once per node): the step is an
    // outer launch of fewer tasks.
    if (mpi && other.launcher == "slurm" && other.world_size < env.world_size) continue;
    throw ConfigError(
        fmt::format("the launch variables disagree: {}, but {}. Unset the stale ones (or launch with "
                    "one launcher)",
                    describe(env), describe(other)));
  }
  return env;
}

/// An initialized process group (torch.distributed) decides the rank and
/// size: it must agree with the launch, or be the inner launch of an outer
/// one (one process per node started by MPI or Slurm).
void apply_process_group(Found& env, const ProcessGroupView& group,
                         const std::function<const char*(const char*)>& getenv) {
  if (group.world_size < 1 || group.rank < 0 || group.rank >= group.world_size) {
    throw ConfigError(fmt::format("{} says rank {} of {}", group.name, group.rank, group.world_size));
  }
  const bool agrees = env.rank == group.rank && env.world_size == group.world_size;
  // A process group over more processes than an MPI or Slurm launch's
  // (torchrun-less multi-node setups that start one process per node and
  // form the group themselves) is the inner launch: the outer variables
  // say nothing about it.
  const bool outer = !agrees && env.launcher != "torchrun" && env.world_size < group.world_size;
  if (env.launcher != "single" && !agrees && !outer) {
    throw ConfigError(fmt::format("{} is initialized as rank {} of {}, but {}", group.name, group.rank,
                                  group.world_size, describe(env)));
  }
  if (env.launcher == "single") {
    env.local_rank = 0;
    env.local_size = 1;
  } else if (outer) {
    // The group's processes on this node: LOCAL_RANK/LOCAL_WORLD_SIZE when
    // the script that started them set them, else the group spread evenly
    // over the outer launch's processes (one per node), consecutive ranks
    // on a node, as torchrun and mpirun's default mapping place them.
    const char* lr = getenv("LOCAL_RANK");
    const char* ls = getenv("LOCAL_WORLD_SIZE");
    if (lr != nullptr && ls != nullptr) {
      env.local_rank = parse_int("LOCAL_RANK", lr);
      env.local_size = parse_int("LOCAL_WORLD_SIZE", ls);
      if (env.local_size < 1 || env.local_rank >= env.local_size) {
        throw ConfigError(
            fmt::format("LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}", env.local_rank, env.local_size));
      }
    } else if (group.world_size % env.world_size == 0) {
      env.local_size = group.world_size / env.world_size;
      env.local_rank = group.rank % env.local_size;
    } else {
      throw ConfigError(
          fmt::format("{} has {} processes, {}: cannot tell how many of them share this node. Set "
                      "LOCAL_RANK and LOCAL_WORLD_SIZE",
                      group.name, group.world_size, describe(env)));
    }
    env.source.clear();
  }
  env.rank = group.rank;
  env.world_size = group.world_size;
  env.launcher = group.name;
  env.source = env.source.empty() ? "its process group" : env.source;
}

}  // namespace

LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv,
                          const std::optional<ProcessGroupView>& group) {
  std::vector<Found> found;
  const auto add = [&](std::optional<Found> e) {
    if (e) found.push_back(std::move(*e));
  };
  add(read_launcher(getenv, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"));
  add(read_launcher(getenv, "mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE"));
  add(read_launcher(getenv, "pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"));
  if (Found slurm = read_slurm_step(getenv); slurm.launcher != "single") found.push_back(std::move(slurm));

  Found env;
  // TORCHELASTIC_RUN_ID is set by torchrun's agent only.
  if (!found.empty() && found.front().launcher == "torchrun" && getenv("TORCHELASTIC_RUN_ID") != nullptr) {
    env = choose_under_torchrun_agent(found);
  } else if (!found.empty()) {
    env = choose_launcher(found);
  }
  if (group) apply_process_group(env, *group, getenv);
  return static_cast<LaunchEnv&>(env);
}

LaunchEnv read_launch_env() {
  return read_launch_env([](const char* name) { return pinfeed::env::raw(name); });
}

}  // namespace pinfeed
