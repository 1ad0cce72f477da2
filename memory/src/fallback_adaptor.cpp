#include "pinfeed/memory/fallback_adaptor.hpp"

#include "pinfeed/error.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/units.hpp"

namespace pinfeed::memory {

void* FallbackAdaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  std::optional<std::string> reason = refuse_ ? refuse_() : std::nullopt;
  if (!reason) {
    try {
      void* p = primary_.allocate(bytes, alignment);
      try {
        const std::scoped_lock lock(mutex_);
        from_primary_.emplace(p, true);
      } catch (...) {
        primary_.deallocate(p, bytes, alignment);
        throw;
      }
      return p;
    } catch (const OutOfMemory& e) {
      reason = e.reason();
      pinfeed::detail::log().warn("{} refused {} ({}): serving it from {}", primary_.name(), format_bytes(bytes),
                                  e.what(), fallback_.name());
    }
  } else {
    pinfeed::detail::log().info("{} skipped for {} ({}): serving it from {}", primary_.name(), format_bytes(bytes),
                                *reason, fallback_.name());
  }
  void* p = fallback_.allocate(bytes, alignment);
  try {
    const std::scoped_lock lock(mutex_);
    from_primary_.emplace(p, false);
    ++reasons_[*reason];
  } catch (...) {
    fallback_.deallocate(p, bytes, alignment);
    throw;
  }
  return p;
}

void FallbackAdaptor::do_deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept {
  bool primary = false;
  {
    const std::scoped_lock lock(mutex_);
    const auto it = from_primary_.find(ptr);
    if (it == from_primary_.end()) {
      pinfeed::detail::log().error("fallback adaptor: deallocate of unknown pointer {}", ptr);
      return;
    }
    primary = it->second;
    from_primary_.erase(it);
  }
  (primary ? primary_ : fallback_).deallocate(ptr, bytes, alignment);
}

bool FallbackAdaptor::served_pinned(const void* ptr) const {
  const std::scoped_lock lock(mutex_);
  const auto it = from_primary_.find(ptr);
  return it != from_primary_.end() && it->second && primary_.is_pinned();
}

std::uint64_t FallbackAdaptor::fallback_count() const {
  const std::scoped_lock lock(mutex_);
  std::uint64_t n = 0;
  for (const auto& [reason, count] : reasons_) n += count;
  return n;
}

std::map<std::string, std::uint64_t> FallbackAdaptor::fallback_reasons() const {
  const std::scoped_lock lock(mutex_);
  return reasons_;
}

}  // namespace pinfeed::memory
