#pragma once
// NUMA topology through hwloc, in one small wrapper. If the topology cannot
// be read it describes one node and binds nothing.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pinfeed::memory {

struct NumaNode {
  unsigned os_index = 0;
  std::uint64_t memory_bytes = 0;  ///< local memory of the node
  std::string cpus;                ///< CPU list, e.g. "0-15,32-47"
  unsigned cpu_count = 0;
};

class Topology {
 public:
  /// The host's topology, loaded once (thread-safe).
  static const Topology& host();

  /// Whether hwloc loaded; false means "one node, no binding".
  [[nodiscard]] bool available() const noexcept { return available_; }
  [[nodiscard]] const std::vector<NumaNode>& nodes() const noexcept { return nodes_; }

  /// Binds [ptr, ptr+bytes) to memory of NUMA node `os_index` before it is
  /// touched. Returns false (and binds nothing) when binding is unsupported
  /// or the node does not exist; the caller then gets default placement.
  bool bind_area(void* ptr, std::size_t bytes, unsigned os_index) const noexcept;

  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

 private:
  Topology();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool available_ = false;
  std::vector<NumaNode> nodes_;
};

}  // namespace pinfeed::memory
