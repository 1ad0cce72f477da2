#include "pinfeed/memory/memory_snapshot.hpp"

#include <fmt/format.h>

#include <charconv>
#include <limits>
#include <sstream>

#include "pinfeed/error.hpp"
#include "pinfeed/file_io.hpp"

namespace fs = std::filesystem;

namespace pinfeed::memory {

std::string_view to_string(CgroupVersion v) noexcept { return enum_word(kCgroupVersionWords, v); }

namespace {

// cgroup v1 reports "no limit" as the largest page-aligned signed 64-bit
// value (9223372036854771712); anything this large is no limit in practice.
constexpr std::uint64_t kUnlimitedFloor = std::uint64_t{1} << 62U;

/// Largest procfs / cgroup file read: a snapshot's files are a few KiB; a
/// `--root` pointing meminfo at /dev/zero or a huge file must not allocate
/// until the host runs out.
constexpr std::size_t kMaxProcFileBytes = 1U << 20U;

std::optional<std::string> slurp(const fs::path& path) { return read_text_file(path, kMaxProcFileBytes); }

std::optional<std::uint64_t> to_u64(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.remove_suffix(1);
  std::uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

/// A file holding one number, or "max" (v2 no limit).
std::optional<std::uint64_t> read_limit(const fs::path& path, bool* present) {
  const auto text = slurp(path);
  if (present != nullptr) *present = text.has_value();
  if (!text) return std::nullopt;
  if (text->rfind("max", 0) == 0) return std::nullopt;
  const auto v = to_u64(*text);
  if (!v || *v >= kUnlimitedFloor) return std::nullopt;
  return v;
}

/// "key value" lines (memory.stat, vmstat, memory.events) or "Key: value [kB]" (meminfo, status).
std::optional<std::uint64_t> field(const std::string& text, std::string_view key, bool kilobytes) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t eol = std::min(text.find('\n', pos), text.size());
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    if (line.size() <= key.size() || line.substr(0, key.size()) != key) continue;
    std::string_view rest = line.substr(key.size());
    if (rest.front() == ':') rest.remove_prefix(1);
    if (rest.empty() || (rest.front() != ' ' && rest.front() != '\t')) continue;
    while (!rest.empty() && (rest.front() == ' ' || rest.front() == '\t')) rest.remove_prefix(1);
    const std::size_t end = rest.find(' ');
    const auto v = to_u64(rest.substr(0, end));
    if (!v) return std::nullopt;
    if (kilobytes && *v > std::numeric_limits<std::uint64_t>::max() / 1024) return std::nullopt;  // overflow: unusable
    return kilobytes ? *v * 1024 : *v;
  }
  return std::nullopt;
}

std::optional<PsiLine> parse_psi_line(std::string_view line) {
  PsiLine p;
  int seen = 0;
  std::istringstream in{std::string(line)};
  std::string tok;
  while (in >> tok) {
    const auto eq = tok.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = tok.substr(0, eq);
    const std::string val = tok.substr(eq + 1);
    try {
      if (key == "avg10")
        p.avg10 = std::stod(val), ++seen;
      else if (key == "avg60")
        p.avg60 = std::stod(val), ++seen;
      else if (key == "avg300")
        p.avg300 = std::stod(val), ++seen;
      else if (key == "total")
        p.total_us = std::stoull(val), ++seen;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  if (seen != 4) return std::nullopt;
  return p;
}

std::optional<Psi> parse_psi(const std::string& text) {
  Psi psi;
  bool some = false;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("some ", 0) == 0) {
      auto p = parse_psi_line(line.substr(5));
      if (!p) return std::nullopt;
      psi.some = *p;
      some = true;
    } else if (line.rfind("full ", 0) == 0) {
      psi.full = parse_psi_line(line.substr(5));
    }
  }
  if (!some) return std::nullopt;
  return psi;
}

/// The process's cgroup path for the memory controller (v1) or the unified
/// hierarchy (v2), from proc/self/cgroup.
struct CgroupPaths {
  std::optional<std::string> v1_memory, v2;
};
CgroupPaths parse_proc_cgroup(const std::string& text) {
  CgroupPaths paths;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto c1 = line.find(':');
    const auto c2 = line.find(':', c1 == std::string::npos ? 0 : c1 + 1);
    if (c1 == std::string::npos || c2 == std::string::npos) continue;
    const std::string id = line.substr(0, c1);
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const std::string path = line.substr(c2 + 1);
    if (id == "0" && controllers.empty()) {
      paths.v2 = path;
      continue;
    }
    std::istringstream list(controllers);
    std::string c;
    while (std::getline(list, c, ',')) {
      if (c == "memory") paths.v1_memory = path;
    }
  }
  return paths;
}

/// The cgroup's folder under a mount: mount/path when it exists; inside a
/// cgroup namespace the path may not match the mount, then the mount root
/// is the process's own cgroup.
fs::path cgroup_dir(const fs::path& mount, const std::string& path) {
  std::error_code ec;
  // A path that climbs out ("/../../etc") must not leave the mount (nor,
  // with --root, the snapshot): such a path is no cgroup of ours.
  const fs::path rel = fs::path(path).relative_path().lexically_normal();
  if (!rel.empty() && *rel.begin() == "..") return mount;
  fs::path candidate = mount / rel;
  if (fs::is_directory(candidate, ec)) return candidate;
  return mount;
}

void read_cgroup_v1(const fs::path& dir, CgroupMemory& cg) {
  cg.version = CgroupVersion::v1;
  cg.dir = dir;
  cg.limit_bytes = read_limit(dir / "memory.limit_in_bytes", nullptr);
  cg.usage_bytes = read_limit(dir / "memory.usage_in_bytes", nullptr).value_or(0);
  if (const auto v = slurp(dir / "memory.failcnt")) cg.failcnt = to_u64(*v);
  if (const auto memsw = read_limit(dir / "memory.memsw.limit_in_bytes", nullptr)) {
    cg.memsw_limit_bytes = memsw;
    cg.memsw_usage_bytes = read_limit(dir / "memory.memsw.usage_in_bytes", nullptr).value_or(0);
  }
  if (const auto oc = slurp(dir / "memory.oom_control")) cg.oom_kills = field(*oc, "oom_kill", false);
  if (const auto stat = slurp(dir / "memory.stat")) {
    // hierarchical_memory_limit: the lowest limit up the tree.
    if (const auto h = field(*stat, "hierarchical_memory_limit", false); h && *h < kUnlimitedFloor) {
      cg.limit_bytes = cg.limit_bytes ? std::min(*cg.limit_bytes, *h) : *h;
    }
    cg.inactive_file_bytes =
        field(*stat, "total_inactive_file", false).value_or(field(*stat, "inactive_file", false).value_or(0));
  }
}

void read_cgroup_v2(const fs::path& mount, const fs::path& dir, CgroupMemory& cg) {
  cg.version = CgroupVersion::v2;
  cg.dir = dir;
  // The effective limit is the lowest memory.max from here up to the mount.
  const fs::path top = mount.lexically_normal();
  for (fs::path d = dir.lexically_normal();; d = d.parent_path()) {
    if (const auto lim = read_limit(d / "memory.max", nullptr)) {
      cg.limit_bytes = cg.limit_bytes ? std::min(*cg.limit_bytes, *lim) : *lim;
    }
    if (const auto high = read_limit(d / "memory.high", nullptr)) {
      cg.high_bytes = cg.high_bytes ? std::min(*cg.high_bytes, *high) : *high;
    }
    if (d == top || d.native().size() <= top.native().size()) break;
  }
  cg.usage_bytes = read_limit(dir / "memory.current", nullptr).value_or(0);
  if (const auto stat = slurp(dir / "memory.stat"))
    cg.inactive_file_bytes = field(*stat, "inactive_file", false).value_or(0);
  if (const auto p = slurp(dir / "memory.pressure")) cg.pressure = parse_psi(*p);
  if (const auto ev = slurp(dir / "memory.events")) {
    cg.oom_kills = field(*ev, "oom_kill", false);
    cg.max_events = field(*ev, "max", false);
    cg.high_events = field(*ev, "high", false);
  }
}

}  // namespace

std::optional<std::uint64_t> CgroupMemory::limit_hits() const noexcept {
  if (failcnt) return failcnt;
  if (!max_events && !high_events) return std::nullopt;
  return max_events.value_or(0) + high_events.value_or(0);
}

std::optional<std::uint64_t> CgroupMemory::room_bytes() const noexcept {
  const auto room = [this](std::optional<std::uint64_t> limit, std::uint64_t usage) -> std::optional<std::uint64_t> {
    if (!limit) return std::nullopt;
    const std::uint64_t net = usage - std::min(inactive_file_bytes, usage);
    return *limit > net ? *limit - net : 0;
  };
  std::optional<std::uint64_t> best;
  for (const auto r :
       {room(limit_bytes, usage_bytes), room(high_bytes, usage_bytes), room(memsw_limit_bytes, memsw_usage_bytes)}) {
    if (r) best = best ? std::min(*best, *r) : *r;
  }
  return best;
}

MemorySnapshot MemorySnapshot::read(const fs::path& root) {
  MemorySnapshot s;
  s.taken_at = std::chrono::steady_clock::now();
  s.root = root;
  const fs::path proc = root / "proc";

  const fs::path meminfo_path = proc / "meminfo";
  const auto meminfo = slurp(meminfo_path);
  if (!meminfo) throw DataError(meminfo_path, "cannot read (is this a procfs root?)");
  const auto total = field(*meminfo, "MemTotal", true);
  if (!total || *total == 0)
    throw DataError(meminfo_path, "no usable MemTotal line (missing, zero, not a number or too large)");
  s.mem_total = *total;
  // Kernels before 3.14 lack MemAvailable: MemFree + Cached is the usual estimate.
  s.mem_available =
      field(*meminfo, "MemAvailable", true)
          .value_or(field(*meminfo, "MemFree", true).value_or(0) + field(*meminfo, "Cached", true).value_or(0));
  s.shmem = field(*meminfo, "Shmem", true).value_or(0);
  s.mlocked = field(*meminfo, "Mlocked", true).value_or(0);
  s.swap_total = field(*meminfo, "SwapTotal", true).value_or(0);
  s.swap_free = field(*meminfo, "SwapFree", true).value_or(0);

  if (const auto vmstat = slurp(proc / "vmstat")) {
    s.pswpin = field(*vmstat, "pswpin", false);
    s.pswpout = field(*vmstat, "pswpout", false);
  }

  if (const auto psi = slurp(proc / "pressure" / "memory")) {
    s.psi = parse_psi(*psi);
    if (!s.psi) s.psi_note = "proc/pressure/memory is unparsable";
  } else {
    std::error_code ec;
    s.psi_note = fs::exists(proc / "pressure", ec)
                     ? "PSI present but memory file unreadable (psi=0 on the kernel command line?)"
                     : "no PSI on this kernel (needs Linux 4.20+ with CONFIG_PSI)";
  }

  const fs::path self = proc / "self";
  if (const auto cg = slurp(self / "cgroup")) {
    const CgroupPaths paths = parse_proc_cgroup(*cg);
    const fs::path mount = root / "sys" / "fs" / "cgroup";
    std::error_code ec;
    if (paths.v1_memory && fs::is_directory(mount / "memory", ec)) {
      read_cgroup_v1(cgroup_dir(mount / "memory", *paths.v1_memory), s.cgroup);
      s.cgroup.path = *paths.v1_memory;
    } else if (paths.v2 && fs::exists(mount / "cgroup.controllers", ec)) {
      read_cgroup_v2(mount, cgroup_dir(mount, *paths.v2), s.cgroup);
      s.cgroup.path = *paths.v2;
    }
  }

  if (const auto limits = slurp(self / "limits")) {
    std::istringstream in(*limits);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Max locked memory", 0) != 0) continue;
      std::istringstream words(line.substr(17));
      std::string soft;
      words >> soft;
      s.memlock_limit_known = true;
      if (soft != "unlimited") s.memlock_limit = to_u64(soft);
    }
  }
  if (const auto status = slurp(self / "status")) {
    s.vm_locked = field(*status, "VmLck", true).value_or(0);
    s.vm_pinned = field(*status, "VmPin", true).value_or(0);
    const auto pos = status->find("CapEff:");
    if (pos != std::string::npos) {
      const std::string hex = status->substr(pos + 7, status->find('\n', pos) - pos - 7);
      try {
        constexpr unsigned kCapIpcLock = 14;
        s.cap_ipc_lock = ((std::stoull(hex, nullptr, 16) >> kCapIpcLock) & 1U) != 0;
      } catch (const std::exception&) {
        s.cap_ipc_lock = false;
      }
    }
  }
  return s;
}

std::uint64_t MemorySnapshot::effective_available() const noexcept {
  const auto room = cgroup.room_bytes();
  return room ? std::min(mem_available, *room) : mem_available;
}

std::uint64_t MemorySnapshot::effective_total() const noexcept {
  return cgroup.limit_bytes ? std::min(mem_total, *cgroup.limit_bytes) : mem_total;
}

double MemorySnapshot::available_fraction() const noexcept {
  const std::uint64_t total = effective_total();
  if (total == 0) return 0;
  return std::min(1.0, static_cast<double>(effective_available()) / static_cast<double>(total));
}

std::vector<LockedMemoryUser> locked_memory_users(const fs::path& root) {
  std::vector<LockedMemoryUser> users;
  std::error_code ec;
  for (fs::directory_iterator it(root / "proc", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int pid = 0;
    const auto [ptr, perr] = std::from_chars(name.data(), name.data() + name.size(), pid);
    if (perr != std::errc{} || ptr != name.data() + name.size()) continue;
    std::optional<std::string> status;
    try {
      status = slurp(it->path() / "status");  // vanished or unreadable: skip
    } catch (const DataError&) {
      continue;  // not a process's status file (a crafted --root): skip it too
    }
    if (!status) continue;
    LockedMemoryUser u;
    u.pid = pid;
    u.vm_locked = field(*status, "VmLck", true).value_or(0);
    u.vm_pinned = field(*status, "VmPin", true).value_or(0);
    if (u.vm_locked == 0 && u.vm_pinned == 0) continue;
    if (const auto p = status->find("Name:"); p != std::string::npos) {
      std::istringstream words(status->substr(p + 5, status->find('\n', p) - p - 5));
      words >> u.name;
    }
    users.push_back(std::move(u));
  }
  std::sort(users.begin(), users.end(),
            [](const auto& a, const auto& b) { return a.vm_locked + a.vm_pinned > b.vm_locked + b.vm_pinned; });
  return users;
}

}  // namespace pinfeed::memory
