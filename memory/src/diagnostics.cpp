#include "pinfeed/memory/diagnostics.hpp"

#include <chrono>
#include <thread>

#include "pinfeed/launch_env.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/numa.hpp"
#include "pinfeed/memory/pressure_monitor.hpp"

namespace pinfeed::memory {
namespace {

using json = nlohmann::ordered_json;

json psi_json(const std::optional<Psi>& psi) {
  if (!psi) return nullptr;
  json j;
  const auto line = [](const PsiLine& l) {
    return json{{"avg10", l.avg10}, {"avg60", l.avg60}, {"avg300", l.avg300}, {"total_us", l.total_us}};
  };
  j["some"] = line(psi->some);
  j["full"] = psi->full ? line(*psi->full) : json(nullptr);
  return j;
}

template <typename T>
json opt(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

bool live_root(const std::string& root) { return root == "/"; }

PinMethod resolve_method(const DiagnosticsRequest& o) {
  const PinMethod m = parse_pin_method(o.pin_method);
  if (m != PinMethod::automatic) return m;
  // Reading another host's snapshot we cannot know its GPUs: assume the
  // conservative mlock path, which the memlock limit applies to.
  return live_root(o.root) && cuda::runtime_status().available ? PinMethod::cuda_register : PinMethod::mlock;
}

}  // namespace

std::optional<PoolPlanRequest> diagnostics_plan_request(const DiagnosticsRequest& o) {
  std::uint64_t batch = o.batch_bytes;
  if (!o.batch_shape.empty()) batch = batch_bytes_from_shape(o.batch_shape);
  if (batch == 0) return std::nullopt;
  PoolPlanRequest r;
  r.gpus = o.gpus;
  r.batch_bytes = batch;
  r.prefetch = o.prefetch;
  r.local_ranks = o.local_ranks != 0 ? o.local_ranks : static_cast<unsigned>(std::max(1, read_launch_env().local_size));
  r.gpu_memory_bytes = o.gpu_memory_bytes;
  if (r.gpu_memory_bytes == 0 && live_root(o.root)) {
    const auto devices = cuda::devices();
    if (!devices.empty()) r.gpu_memory_bytes = devices.front().total_bytes;
  }
  r.policy = BudgetPolicy{o.fraction, resolve_method(o), o.reserve_bytes};
  r.validate();
  return r;
}

json diagnostics_report_json(const std::string& root, const MemorySnapshot& s,
                             const std::optional<PressureReading>& activity) {
  json j;
  j["root"] = root;
  j["memory"] = {{"total_bytes", s.mem_total},
                 {"available_bytes", s.mem_available},
                 {"shmem_bytes", s.shmem},
                 {"mlocked_bytes", s.mlocked},
                 {"effective_total_bytes", s.effective_total()},
                 {"effective_available_bytes", s.effective_available()},
                 {"available_fraction", s.available_fraction()}};
  j["swap"] = {{"total_bytes", s.swap_total},
               {"used_bytes", s.swap_used()},
               {"pswpin", opt(s.pswpin)},
               {"pswpout", opt(s.pswpout)},
               {"in_pages_per_s", activity ? json(activity->swap_in_rate) : json(nullptr)},
               {"out_pages_per_s", activity ? json(activity->swap_out_rate) : json(nullptr)}};
  j["psi"] = psi_json(s.psi);
  if (!s.psi) j["psi_note"] = s.psi_note;
  const auto& cg = s.cgroup;
  j["cgroup"] = {{"version", to_string(cg.version)},
                 {"path", cg.path},
                 {"dir", cg.dir.string()},
                 {"limit_bytes", opt(cg.limit_bytes)},
                 {"high_bytes", opt(cg.high_bytes)},
                 {"usage_bytes", cg.usage_bytes},
                 {"inactive_file_bytes", cg.inactive_file_bytes},
                 {"room_bytes", opt(cg.room_bytes())},
                 {"pressure", psi_json(cg.pressure)},
                 {"oom_kills", opt(cg.oom_kills)},
                 {"max_events", opt(cg.max_events)},
                 {"failcnt", opt(cg.failcnt)}};
  j["process"] = {{"memlock_limit_bytes", opt(s.memlock_limit)},
                  {"memlock_limit_known", s.memlock_limit_known},
                  {"cap_ipc_lock", s.cap_ipc_lock},
                  {"vm_locked_bytes", s.vm_locked},
                  {"vm_pinned_bytes", s.vm_pinned}};
  if (live_root(root)) {
    const auto& topo = Topology::host();
    json nodes = json::array();
    for (const auto& n : topo.nodes()) {
      nodes.push_back(
          {{"os_index", n.os_index}, {"memory_bytes", n.memory_bytes}, {"cpus", n.cpus}, {"cpu_count", n.cpu_count}});
    }
    j["numa"] = {{"hwloc", topo.available()}, {"nodes", nodes}};
    const auto& cuda = cuda::runtime_status();
    json gpus = json::array();
    for (const auto& d : cuda::devices()) {
      gpus.push_back({{"index", d.index},
                      {"name", d.name},
                      {"memory_bytes", d.total_bytes},
                      {"pci_bus_id", d.pci_bus_id},
                      {"numa_node", d.numa_node},
                      {"host_page_tables", d.host_page_tables}});
    }
    j["cuda"] = {
        {"compiled", cuda.compiled}, {"available", cuda.available}, {"message", cuda.message}, {"devices", gpus}};
  } else {
    j["numa"] = nullptr;
    j["cuda"] = nullptr;
    j["note"] = "NUMA and GPUs are not read from --root: they describe the machine running the tool";
  }
  json users = json::array();
  for (const auto& u : locked_memory_users(root)) {
    users.push_back(
        {{"pid", u.pid}, {"name", u.name}, {"vm_locked_bytes", u.vm_locked}, {"vm_pinned_bytes", u.vm_pinned}});
  }
  j["locked_memory_users"] = users;
  return j;
}

json pool_plan_json(const PoolPlanRequest& r, const PoolPlan& p) {
  json terms = json::array();
  for (const auto& t : p.budget.terms) terms.push_back({{"name", t.name}, {"bytes", t.bytes}, {"detail", t.detail}});
  return {{"gpus", r.gpus},
          {"batch_bytes", r.batch_bytes},
          {"prefetch", r.prefetch},
          {"local_ranks", r.local_ranks},
          {"pin_method", to_string(r.policy.method)},
          {"fraction", r.policy.fraction},
          {"slot_bytes", p.slot_bytes},
          {"slots_needed", p.slots_needed},
          {"need_bytes", p.need_bytes},
          {"budget_bytes", p.budget.bytes},
          {"limiting", p.budget.limiting},
          {"terms", terms},
          {"slots_fit", p.slots_fit},
          {"prefetch_fit", p.prefetch_fit},
          {"fit",
           {{"fits", p.fit.fits},
            {"pool_bytes", p.fit.pool_bytes},
            {"allowed_bytes", p.fit.allowed_bytes},
            {"available_bytes", p.fit.available_bytes},
            {"slots_fit", p.fit.slots_fit},
            {"largest_slot_bytes", p.fit.largest_slot_bytes},
            {"limiting", p.fit.limiting}}},
          {"verdict", to_string(p.verdict)},
          {"reasons", p.reasons},
          {"rule_of_thumb",
           {{"known", p.rule_known}, {"gpu_memory_total_bytes", p.gpu_memory_total}, {"met", p.rule_met}}}};
}

std::string diagnostics_json(const DiagnosticsRequest& request) {
  const auto req = diagnostics_plan_request(request);  // validates before reading anything
  MemorySnapshot s = MemorySnapshot::read(request.root);
  std::optional<PressureReading> activity;
  if (live_root(request.root) && request.sample_ms > 0) {
    // Rates need two readings: measure swap activity over a short window.
    PressureMonitor::Config mc;
    mc.root = request.root;
    PressureMonitor monitor(mc);
    monitor.step(s);
    std::this_thread::sleep_for(std::chrono::milliseconds(request.sample_ms));
    s = MemorySnapshot::read(request.root);
    activity = monitor.step(s);
  }
  json j = diagnostics_report_json(request.root, s, activity);
  if (req) j["plan"] = pool_plan_json(*req, plan_pool(s, *req));
  return j.dump(2);
}

}  // namespace pinfeed::memory
