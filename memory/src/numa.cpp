#include "pinfeed/memory/numa.hpp"

#include <hwloc.h>

#include <cstdlib>

#include "pinfeed/log.hpp"

namespace pinfeed::memory {

struct Topology::Impl {
  hwloc_topology_t topo = nullptr;
};

Topology::Topology() : impl_(std::make_unique<Impl>()) {
  if (hwloc_topology_init(&impl_->topo) != 0) {
    impl_->topo = nullptr;
  } else if (hwloc_topology_load(impl_->topo) != 0) {
    hwloc_topology_destroy(impl_->topo);
    impl_->topo = nullptr;
  }
  if (impl_->topo == nullptr) {
    pinfeed::detail::log().warn("hwloc could not read the topology; assuming one NUMA node, no binding");
    nodes_.push_back(NumaNode{0, 0, "?", 0});
    return;
  }
  available_ = true;
  const int depth = hwloc_get_type_depth(impl_->topo, HWLOC_OBJ_NUMANODE);
  const unsigned count = hwloc_get_nbobjs_by_depth(impl_->topo, depth);
  for (unsigned i = 0; i < count; ++i) {
    hwloc_obj_t obj = hwloc_get_obj_by_depth(impl_->topo, depth, i);
    NumaNode node;
    node.os_index = obj->os_index;
    node.memory_bytes = obj->attr != nullptr ? obj->attr->numanode.local_memory : 0;
    if (obj->cpuset != nullptr) {
      char* list = nullptr;
      if (hwloc_bitmap_list_asprintf(&list, obj->cpuset) >= 0 && list != nullptr) {
        node.cpus = list;
        std::free(list);  // NOLINT: hwloc allocates with malloc
      }
      const int weight = hwloc_bitmap_weight(obj->cpuset);
      node.cpu_count = weight > 0 ? static_cast<unsigned>(weight) : 0U;
    }
    nodes_.push_back(std::move(node));
  }
}

Topology::~Topology() {
  if (impl_ && impl_->topo != nullptr) hwloc_topology_destroy(impl_->topo);
}

const Topology& Topology::host() {
  static const Topology topology;
  return topology;
}

bool Topology::bind_area(void* ptr, std::size_t bytes, unsigned os_index) const noexcept {
  if (!available_) return false;
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  if (set == nullptr) return false;
  hwloc_bitmap_only(set, os_index);
  const int rc = hwloc_set_area_membind(impl_->topo, ptr, bytes, set, HWLOC_MEMBIND_BIND,
                                        HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT);
  hwloc_bitmap_free(set);
  return rc == 0;
}

}  // namespace pinfeed::memory
