#pragma once
// Figures for people: a tool writes its data as PREFIX.csv and a gnuplot
// script as PREFIX.gp, and renders PREFIX.png when gnuplot is installed
// (scripts/install-deps.sh installs gnuplot-nox). Used by pinfeed-train
// --compare and pinfeed-bench threads.
#include <pthread.h>
#include <unistd.h>

#include <fmt/format.h>
#include <csignal>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "pinfeed/error.hpp"

namespace pinfeed::tools {

/// `commands` with every {csv} replaced by the data file's path.
inline std::string with_data(std::string commands, const std::string& csv_path) {
  for (std::size_t at = commands.find("{csv}"); at != std::string::npos;
       at = commands.find("{csv}", at + csv_path.size())) {
    commands.replace(at, 5, csv_path);
  }
  return commands;
}

/// Before a run whose figures go to `prefix`: its folder exists and can be
/// written (and so can files already there), so that a long run does not
/// end in "cannot write". Throws ConfigError naming `flag`.
inline void check_plot_prefix(const std::string& prefix, const char* flag) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(prefix).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw ConfigError(fmt::format("{} {}: the folder {} does not exist", flag, prefix, dir.string()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw ConfigError(fmt::format("{} {}: the folder {} cannot be written", flag, prefix, dir.string()));
  }
  for (const char* ext : {".csv", ".gp", ".png"}) {
    const std::string path = prefix + ext;
    if (fs::exists(path, ec) && (fs::is_directory(path, ec) || ::access(path.c_str(), W_OK) != 0)) {
      throw ConfigError(fmt::format("{} {}: {} exists and cannot be written", flag, prefix, path));
    }
  }
}

/// Writes `csv` to prefix.csv and a script (a 900x540 PNG terminal, comma
/// separated data, then `commands`, in which every {csv} names the data) to
/// prefix.gp; runs gnuplot on it. Returns the PNG's path, or "" (with a
/// note on stderr) when gnuplot is not installed. Throws DataError when a
/// file cannot be written, Error when gnuplot fails.
inline std::string write_plot(const std::string& prefix, const std::string& csv, const std::string& commands,
                              const char* tool) {
  const std::string csv_path = prefix + ".csv", png = prefix + ".png", gp = prefix + ".gp";
  {
    std::ofstream out(csv_path);
    out << csv;
    if (!out) throw DataError(csv_path, "cannot write");
  }
  {
    std::ofstream script(gp);
    script << "set terminal pngcairo size 900,680\n"
           << fmt::format("set output '{}'\n", png) << "set datafile separator ','\nset grid\n"
           << with_data(commands, csv_path);
    if (!script) throw DataError(gp, "cannot write");
  }
  // The child inherits the signal mask: pinfeed-train blocks SIGINT/SIGTERM
  // in every thread (install_checkpoint_signal_handlers), and gnuplot must
  // still stop on Ctrl-C. Unblocked here, a signal reaches this thread's
  // forwarding handler, which passes it to the signal thread.
  sigset_t stop_signals, before;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  (void)::pthread_sigmask(SIG_UNBLOCK, &stop_signals, &before);
  struct Restore {
    sigset_t mask;
    ~Restore() { (void)::pthread_sigmask(SIG_SETMASK, &mask, nullptr); }
  } restore{before};
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    fmt::print(stderr, "{}: gnuplot not found: wrote {} and {} only\n", tool, csv_path, gp);
    return "";
  }
  if (std::system(fmt::format("gnuplot '{}'", gp).c_str()) != 0) throw Error(fmt::format("gnuplot {} failed", gp));
  return png;
}

}  // namespace pinfeed::tools
