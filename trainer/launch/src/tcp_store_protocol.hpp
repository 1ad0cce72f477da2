#pragma once
// The TCPStore wire protocol's codes and size caps, shared by the client
// (tcp_store.cpp) and the server (tcp_store_server.cpp). See Note [TCPStore
// protocol] in tcp_store.cpp.
#include <cstdint>

namespace pinfeed::trainer::detail::wire {

// The v1 codes; a v2 connection's codes are mapped onto them (to_v1).
enum Query : std::uint8_t {
  kSet = 0,
  kCompareSet = 1,
  kGet = 2,
  kAdd = 3,
  kCheck = 4,
  kWait = 5,
  kNumKeys = 6,
  kDelete = 8,
};
constexpr std::uint8_t kV2Validate = 0;
constexpr std::uint8_t kV2Ping = 13;
constexpr std::uint8_t kNone = 0xff;
constexpr std::uint32_t kV2Magic = 0x3C85F7CEU;
constexpr std::uint64_t kMaxKey = 64U << 10U;
constexpr std::uint64_t kMaxValue = 16U << 20U;
constexpr std::uint64_t kMaxKeys = 4096;
constexpr std::uint64_t kMaxKeyListBytes = 1U << 20U;  ///< all of one WAIT/CHECK's keys

/// A request code of a v2 connection for the v1 code `q`.
constexpr std::uint8_t v2_code(std::uint8_t q) {
  return q == kDelete ? std::uint8_t{kDelete} : static_cast<std::uint8_t>(q + 1);
}
/// The v1 code of a v2 request code (VALIDATE and PING have none: kNone).
constexpr std::uint8_t to_v1(std::uint8_t q) {
  if (q >= 1 && q <= 7) return static_cast<std::uint8_t>(q - 1);
  return q == kDelete ? std::uint8_t{kDelete} : kNone;
}

}  // namespace pinfeed::trainer::detail::wire
