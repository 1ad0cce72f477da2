#include "pinfeed/memory/pressure_events.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "pinfeed/units.hpp"

namespace pinfeed::memory {

namespace {
/// A read that only drains or re-arms a notification: its result changes nothing.
void ignore_result(ssize_t /*bytes*/) noexcept {}
bool write_all(int fd, const std::string& text) {
  return ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
}
std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}
}  // namespace

PressureEvents::PressureEvents(const MemorySnapshot& s, const std::vector<std::uint64_t>& usage_lines) {
  std::vector<std::string> armed, missed;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s.root != "/") {
    description_ = "none: the monitor reads a fixture root, not this host";
    return;
  }
  const CgroupMemory& cg = s.cgroup;
  if (cg.version == CgroupVersion::v1 && !cg.dir.empty()) {
    arm_v1(cg, usage_lines, armed, missed);
  } else if (cg.version == CgroupVersion::v2 && !cg.dir.empty()) {
    arm_psi(cg.dir / "memory.pressure", armed, missed);
    arm_kernfs(cg.dir / "memory.events", armed, missed);
  }
  arm_psi("/proc/pressure/memory", armed, missed);
  description_ = armed.empty() ? "none armed" : join(armed, "; ");
  if (!missed.empty()) description_ += fmt::format(" (not armed: {})", join(missed, "; "));
}

PressureEvents::~PressureEvents() {
  for (const Source& src : sources_) ::close(src.fd);
  for (const int fd : keep_open_) ::close(fd);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void PressureEvents::arm_v1(const CgroupMemory& cg, const std::vector<std::uint64_t>& usage_lines,
                            std::vector<std::string>& armed, std::vector<std::string>& missed) {
  const int control = ::open((cg.dir / "cgroup.event_control").c_str(), O_WRONLY | O_CLOEXEC);
  if (control < 0) {
    missed.push_back(fmt::format("{}: {}", (cg.dir / "cgroup.event_control").string(), std::strerror(errno)));
    return;
  }
  // One eventfd per registration: the kernel refuses a second one on the
  // same eventfd for some files, and a count per line costs nothing.
  const auto reg = [&](const char* file, const std::string& argument) -> bool {
    const int target = ::open((cg.dir / file).c_str(), O_RDONLY | O_CLOEXEC);
    if (target < 0) return false;
    const int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0 || !write_all(control, fmt::format("{} {} {}", efd, target, argument))) {
      if (efd >= 0) ::close(efd);
      ::close(target);
      return false;
    }
    keep_open_.push_back(target);
    sources_.push_back(Source{efd, Kind::eventfd});
    return true;
  };
  std::vector<std::string> lines;
  for (const std::uint64_t line : usage_lines) {
    if (line == 0) continue;
    if (reg("memory.usage_in_bytes", std::to_string(line))) {
      lines.push_back(format_bytes(line));
    } else {
      missed.push_back(fmt::format("usage threshold {}: {}", format_bytes(line), std::strerror(errno)));
    }
  }
  if (!lines.empty()) armed.push_back(fmt::format("cgroup v1 usage thresholds at {}", join(lines, " and ")));
  if (reg("memory.pressure_level", "medium")) {
    armed.emplace_back("cgroup v1 pressure_level medium");
  } else {
    missed.push_back(fmt::format("pressure_level: {}", std::strerror(errno)));
  }
  ::close(control);
}

void PressureEvents::arm_psi(const std::filesystem::path& file, std::vector<std::string>& armed,
                             std::vector<std::string>& missed) {
  // 100 ms of stall in a 1 s window; without CAP_SYS_RESOURCE the window must
  // be a multiple of 2 s.
  for (const char* trigger : {"some 100000 1000000", "some 200000 2000000"}) {
    const int fd = ::open(file.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      missed.push_back(fmt::format("{}: {}", file.string(), std::strerror(errno)));
      return;
    }
    if (write_all(fd, std::string(trigger) + '\0')) {
      sources_.push_back(Source{fd, Kind::psi});
      armed.push_back(fmt::format("PSI trigger \"{}\" on {}", trigger, file.string()));
      return;
    }
    const int err = errno;
    ::close(fd);
    if (err != EINVAL) {
      missed.push_back(fmt::format("PSI trigger on {}: {}", file.string(), std::strerror(err)));
      return;
    }
  }
  missed.push_back(fmt::format("PSI trigger on {}: refused", file.string()));
}

void PressureEvents::arm_kernfs(const std::filesystem::path& file, std::vector<std::string>& armed,
                                std::vector<std::string>& missed) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    missed.push_back(fmt::format("{}: {}", file.string(), std::strerror(errno)));
    return;
  }
  std::array<char, 512> buf{};
  ignore_result(::read(fd, buf.data(), buf.size()));  // a kernfs file notifies changes after its first read
  sources_.push_back(Source{fd, Kind::kernfs});
  armed.push_back(fmt::format("changes of {}", file.string()));
}

bool PressureEvents::wait(std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds;
  fds.reserve(sources_.size() + 1);
  fds.push_back(pollfd{wake_fd_, POLLIN, 0});
  for (const Source& src : sources_) {
    fds.push_back(pollfd{src.fd, static_cast<short>(src.kind == Kind::eventfd ? POLLIN : POLLPRI), 0});
  }
  const int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  if (n <= 0) return false;
  std::uint64_t count = 0;
  if ((fds[0].revents & POLLIN) != 0) ignore_result(::read(wake_fd_, &count, sizeof count));
  bool fired = false;
  for (std::size_t i = 0; i < sources_.size(); ++i) {
    const short got = fds[i + 1].revents;
    if (got == 0) continue;
    Source& src = sources_[i];
    if ((got & POLLNVAL) != 0 || ((got & POLLERR) != 0 && src.kind != Kind::kernfs)) {
      // The cgroup went away (or the descriptor broke): drop it, or poll()
      // would return at once for ever. The monitor polls for what is left.
      ::close(src.fd);
      src.fd = -1;
      continue;
    }
    fired = true;
    if (src.kind == Kind::eventfd) {
      ignore_result(::read(src.fd, &count, sizeof count));
    } else if (src.kind == Kind::kernfs) {
      std::array<char, 512> buf{};
      ignore_result(::pread(src.fd, buf.data(), buf.size(), 0));  // re-arms the notification
    }
  }
  std::erase_if(sources_, [](const Source& src) { return src.fd < 0; });
  if (fired) ++fired_;
  return fired;
}

void PressureEvents::wake() noexcept {
  if (wake_fd_ < 0) return;
  const std::uint64_t one = 1;
  ignore_result(::write(wake_fd_, &one, sizeof one));
}

}  // namespace pinfeed::memory
