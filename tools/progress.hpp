#pragma once
// The tools' one progress bar, on stderr: on a terminal a bar redrawn in
// place with the share done, the counts, an optional note and the time
// left; elsewhere (a log file) a line per 10%, or nothing (quiet_unless_tty).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace pinfeed::tools {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label, bool quiet_unless_tty = false)
      : label_(std::move(label)), tty_(::isatty(STDERR_FILENO) != 0), quiet_(quiet_unless_tty && !tty_) {}

  /// `done` of `total` finished; `note` is shown after the counts ("812 img/s").
  void update(std::size_t done, std::size_t total, std::string_view note = {}) {
    if (quiet_) return;
    const std::size_t pct = total == 0 ? 100 : done * 100 / total;
    if (!tty_) {
      if (pct / 10 != last_pct_ / 10 || done == total)
        fmt::print(stderr, "{}: {}% ({}/{})\n", label_, pct, done, total);
      last_pct_ = pct;
      return;
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::string eta;
    if (done > 0 && done < total)
      eta = fmt::format(" ETA {:.0f}s", elapsed * static_cast<double>(total - done) / static_cast<double>(done));
    const std::size_t width = 30, filled = pct * width / 100;
    fmt::print(stderr, "\r{} [{}{}] {:3}% {}/{}{}{}{}   ", label_, std::string(filled, '#'),
               std::string(width - filled, '.'), pct, done, total, note.empty() ? "" : " ", note, eta);
    if (done == total) fmt::print(stderr, "\r{}\r", std::string(100, ' '));  // the line that follows says it all
    last_pct_ = pct;
  }

 private:
  std::string label_;
  bool tty_, quiet_;
  std::size_t last_pct_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace pinfeed::tools
