#pragma once
// Checkpoints: weights, optimizer state (momentum), and where training
// stands (optimizer step, epoch, the loader's position), enough to resume and
// reproduce the uninterrupted run exactly on the CPU backend.
//
// Format: "PFCKPT01", a little-endian u64 header length, a JSON header, the
// weights and momentum as raw float32, and an FNV-1a 64 checksum of all that.
// Written atomically: a temporary file in the same folder, fsync, rename over
// the old checkpoint, fsync of the folder. A writer killed at any point leaves
// the previous checkpoint intact; a write that fails removes its temporary,
// and so does SIGINT/SIGTERM with install_checkpoint_signal_handlers(). A
// checkpoint path that is a symlink is written through the link (its target
// is replaced), as cp would.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "pinfeed/file_io.hpp"
#include "pinfeed/loader/dataset.hpp"

#include "pinfeed/trainer/model.hpp"

namespace pinfeed::trainer {

struct Checkpoint {
  std::uint64_t step = 0;      ///< optimizer steps done
  std::uint64_t epoch = 0;     ///< the epoch to continue
  std::uint64_t position = 0;  ///< samples of that epoch each rank has consumed
  std::uint64_t seed = 0;
  std::uint64_t world_size = 1;
  std::uint64_t global_batch = 0;
  ModelConfig model;
  std::vector<float> weights, momentum;
  std::vector<float> buffers;  ///< the model's non-parameter state (BatchNorm running statistics)
  /// The training set it was taken on (unset in checkpoints written before
  /// 2026-12-03): --resume refuses another one.
  std::optional<loader::DatasetFingerprint> dataset;
};

struct SaveHooks {
  std::function<void()> before_rename;  ///< runs after the temporary file is complete (tests kill here)
};

/// Throws DataError(path, reason) when the file cannot be written.
void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ckpt, const SaveHooks& hooks = {});
/// Throws DataError(path, reason): missing, not a regular file, over
/// kMaxCheckpointBytes, truncated, not a checkpoint, checksum mismatch, a
/// header whose sizes disagree with the file.
Checkpoint load_checkpoint(const std::filesystem::path& path);

/// The same checks on bytes already in memory (`path` names them in errors).
Checkpoint parse_checkpoint(std::span<const std::byte> bytes, const std::filesystem::path& path);

/// One run's claim on a checkpoint: an advisory lock (flock) on
/// ".<name>.lock" beside the file the path resolves to, held for the
/// object's life. Throws DataError naming the checkpoint and the holder
/// (pid, host) when another run holds it: two runs writing one checkpoint
/// would replace each other's. Once held, temporaries of this checkpoint
/// left by killed writers (".<name>.tmp.<pid>") are removed. The lock file
/// stays (removing it would race with the next run taking it).
class CheckpointLock {
 public:
  explicit CheckpointLock(const std::filesystem::path& path);
  [[nodiscard]] std::size_t removed_temporaries() const noexcept { return removed_; }

 private:
  UniqueFd fd_;
  std::size_t removed_ = 0;
};

/// SIGINT and SIGTERM (unless ignored): the temporary of a save in progress
/// is removed and the process exits with 128 + the signal's number. Without
/// it a kill during a save left a full-size temporary behind. Call it before
/// the process starts any thread: it blocks both signals in the caller, so
/// every thread started later inherits the mask, and takes them on a thread
/// of its own (sigwait), never in signal context and never as EINTR in a
/// worker. Calling it again does nothing.
void install_checkpoint_signal_handlers();

/// True once SIGINT/SIGTERM has arrived under
/// install_checkpoint_signal_handlers(): the process is exiting.
bool termination_requested();

/// Where a checkpoint path leads: its symlinks followed (to a target that
/// may not exist yet). DataError on a symlink loop.
std::filesystem::path resolve_checkpoint_path(const std::filesystem::path& path);

/// Largest checkpoint read (the reference models are far smaller).
inline constexpr std::uint64_t kMaxCheckpointBytes = 16ULL << 30U;

/// Throws DataError naming the folder (or the path) unless a checkpoint
/// can be written there: the folder exists and takes a new file, and the
/// path is not something other than a regular file. Run before training.
void check_checkpoint_writable(const std::filesystem::path& path);

}  // namespace pinfeed::trainer
