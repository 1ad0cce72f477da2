#pragma once
// A shared library opened with dlopen and its entry points bound by name:
// the one way pinfeed loads cuBLAS and NCCL, so binaries start (and the CPU
// path works) where they are not installed. Opening never throws; error()
// says what is missing, for the caller to report when the library is
// actually needed. The handle is kept for the process's life. Not installed.
#include <dlfcn.h>
#include <fmt/format.h>

#include <initializer_list>
#include <string>

namespace pinfeed::trainer::detail {

class DynamicLibrary {
 public:
  /// The first of `names` that loads. When a name exists but one of its own
  /// dependencies does not (libcublas.so.13 without libcublasLt.so.13), that
  /// is the reason kept, not the next name's "no such file".
  DynamicLibrary(const char* what, std::initializer_list<const char*> names) {
    std::string tried, first, missing_dependency;
    for (const char* name : names) {
      tried += fmt::format("{}{}", tried.empty() ? "" : ", ", name);
      handle_ = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle_ != nullptr) {
        name_ = name;
        return;
      }
      const char* why = dlerror();
      const std::string reason = why != nullptr ? why : std::string(name) + ": cannot be loaded";
      if (first.empty()) first = reason;
      if (missing_dependency.empty() && reason.rfind(std::string(name) + ":", 0) != 0) missing_dependency = reason;
    }
    error_ =
        fmt::format("cannot load {} ({}): {}", what, tried, missing_dependency.empty() ? first : missing_dependency);
  }

  /// Binds `f` to `symbol`; a missing one becomes the error (the first kept).
  template <class F>
  void bind(F& f, const char* symbol) {
    if (handle_ == nullptr) return;
    f = reinterpret_cast<F>(dlsym(handle_, symbol));
    if (f == nullptr && error_.empty()) error_ = fmt::format("{} lacks {}", name_, symbol);
  }

  /// Empty when the library and every bound symbol are there.
  [[nodiscard]] const std::string& error() const noexcept { return error_; }

 private:
  void* handle_ = nullptr;
  std::string name_, error_;
};

}  // namespace pinfeed::trainer::detail
