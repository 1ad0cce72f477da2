#pragma once
// pinfeed's exception hierarchy. Every error the library throws derives from
// pinfeed::Error; callers that react to running out of memory catch
// OutOfMemory, which carries a short machine-readable reason.
#include <filesystem>
#include <stdexcept>
#include <string>

namespace pinfeed {

/// Base of every pinfeed exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration or flag is invalid: names the field and the bad value.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A file could not be read or parsed. Always carries the path and a reason.
class DataError : public Error {
 public:
  DataError(std::filesystem::path path, const std::string& reason);
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

 private:
  std::filesystem::path path_;
  std::string reason_;
};

/// A CUDA runtime call failed (memory/cuda_host.hpp, the trainer's CUDA backend).
class CudaError : public Error {
 public:
  using Error::Error;
};

/// Memory could not be provided. reason() is a short tag callers and tools
/// can show or match on: "memlock limit", "budget", "mmap", "cuda register",
/// "limit" (LimitingAdaptor), "injected" (tests).
class OutOfMemory : public Error {
 public:
  OutOfMemory(std::string reason, const std::string& what);
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

 private:
  std::string reason_;
};

/// A blocking wait was cancelled (pool shut down or a stop was requested).
class Cancelled : public Error {
 public:
  using Error::Error;
};

}  // namespace pinfeed
