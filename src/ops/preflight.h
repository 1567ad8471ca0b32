// The pre-flight header: a fixed-size record every rank sends before the payload, so that
// cross-rank disagreements and local failures become the same error on every rank.
//
// It is raw bytes of a trivially copyable struct: every rank of a group must share the byte
// order and struct layout (one architecture), which holds for the clusters this serves. The
// decoder never trusts a field it reads: lengths and codes are validated before use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "shardgather/communicator.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/stage.h"
#include "shardgather/strategy.h"
#include "shardgather/types.h"

namespace shardgather::detail {

inline constexpr std::uint32_t kHeaderMagic = 0x52484753;  // "SGHR"
// 3: bits 24-31 of flags carry a device call's DeviceGather request.
// 4: bits 4-7 carry the transport's exchange form (Capabilities::exchange_form).
// 5: the stage (stage.h): which step of a compound operation the call is.
inline constexpr std::uint16_t kHeaderVersion = 5;
inline constexpr std::size_t kInlineDTypes = 128;
inline constexpr std::size_t kStatusTextBytes = 160;

enum HeaderFlags : std::uint32_t {
  kHasHint = 1U << 0U,  // hint_hash fingerprints the shapes of every rank (hint or plan)
};
// Bits 4-7 of flags: the transport's exchange form (Capabilities::exchange_form), because two
// ranks moving one personal exchange two ways (MPI point to point and MPI_Ialltoallw) never pair.
inline constexpr unsigned kExchangeFormShift = 4;
// Bits 8-15 of flags: the strategy the payload moves with (resolved, so kAuto never travels),
// because two ranks moving one payload two ways would mis-pair their transfers.
inline constexpr unsigned kStrategyShift = 8;
// Bits 16-23: the DeviceType of the call's tensors, because a rank gathering host memory and one
// gathering device memory take different transport paths (docs/gpu.md).
inline constexpr unsigned kDeviceShift = 16;

// Bits 24-31: a device call's DeviceGather request (0, kAuto, on host calls), because two ranks
// moving one uneven device gather two ways would pair broadcasts with an all-gather.
inline constexpr unsigned kDeviceGatherShift = 24;

struct PreflightHeader {
  std::uint32_t magic = kHeaderMagic;
  std::uint16_t version = kHeaderVersion;
  std::uint8_t op = static_cast<std::uint8_t>(Operation::kForeachAllGather);
  std::uint8_t status = static_cast<std::uint8_t>(ErrorCode::kOk);
  std::uint32_t flags = 0;
  std::uint32_t world_size = 0;
  std::uint64_t seq = 0;
  std::uint64_t num_tensors = 0;
  std::uint64_t payload_bytes = 0;          // what this rank will send
  std::uint64_t dtype_hash = 0;             // over every dtype
  std::uint64_t hint_hash = 0;              // over the whole hint; 0 without one
  std::int64_t status_tensor = -1;          // the tensor the status is about, or -1
  std::uint8_t dtypes[kInlineDTypes] = {};  // the first dtypes, so a mismatch names its index
  char status_text[kStatusTextBytes] = {};  // NUL-terminated message of a failed status
  // The call's stage (stage.h), NUL-terminated; empty for a call of its own. Compared with the
  // operation, because a step of a compound operation must never pair with another call.
  char stage[Stage::kMaxBytes + 1] = {};
};
static_assert(sizeof(PreflightHeader) == 400, "the header layout is part of the wire format");

void set_stage(PreflightHeader& header, const Stage& stage) noexcept;

inline void set_strategy(PreflightHeader& header, Strategy strategy) noexcept {
  header.flags = (header.flags & ~(0xffU << kStrategyShift)) |
                 (static_cast<std::uint32_t>(strategy) << kStrategyShift);
}
inline Strategy strategy_of(const PreflightHeader& header) noexcept {
  return static_cast<Strategy>((header.flags >> kStrategyShift) & 0xffU);
}

inline void set_exchange_form(PreflightHeader& header, std::uint8_t form) noexcept {
  header.flags = (header.flags & ~(0xfU << kExchangeFormShift)) |
                 ((static_cast<std::uint32_t>(form) & 0xfU) << kExchangeFormShift);
}
inline std::uint8_t exchange_form_of(const PreflightHeader& header) noexcept {
  return static_cast<std::uint8_t>((header.flags >> kExchangeFormShift) & 0xfU);
}

inline void set_device_type(PreflightHeader& header, DeviceType type) noexcept {
  header.flags = (header.flags & ~(0xffU << kDeviceShift)) |
                 (static_cast<std::uint32_t>(type) << kDeviceShift);
}
inline DeviceType device_type_of(const PreflightHeader& header) noexcept {
  return static_cast<DeviceType>((header.flags >> kDeviceShift) & 0xffU);
}

inline void set_device_gather_request(PreflightHeader& header, DeviceGather request) noexcept {
  header.flags = (header.flags & ~(0xffU << kDeviceGatherShift)) |
                 (static_cast<std::uint32_t>(request) << kDeviceGatherShift);
}
inline DeviceGather device_gather_request_of(const PreflightHeader& header) noexcept {
  return static_cast<DeviceGather>((header.flags >> kDeviceGatherShift) & 0xffU);
}

// Records a local failure; the text is truncated to fit.
void set_status(PreflightHeader& header, ErrorCode code, std::string_view text) noexcept;

// The dtype_hash of a list (plans compute it once).
std::uint64_t hash_dtypes(std::span<const DType> dtypes) noexcept;

// Fills num_tensors, the inline dtypes and dtype_hash (hash_dtypes(dtypes) when given).
void set_dtypes(PreflightHeader& header, std::span<const DType> dtypes,
                std::uint64_t precomputed_hash = 0) noexcept;

std::uint64_t hash_hint(std::span<const std::vector<std::int64_t>> flat_hint, int world_size);

// Validates and copies one received header. Mismatch("corrupt ...") on bad magic, version,
// operation, strategy, device type, device gather request, status code or an unterminated text
// or stage.
PreflightHeader decode_header(std::span<const std::byte> bytes, int from_rank);

// Decodes every rank's header from an all_gather and raises, identically on every rank, the
// first failed status or disagreement: operation and stage, world size, sequence number, tensor
// count, hint presence, dtypes, hint hash (a plan's fingerprint covers its dtypes: the dtype is the
// cause to name), device type, device gather request, strategy. `me` only prefixes the message.
void check_headers(std::span<const std::byte> gathered, std::span<PreflightHeader> headers, int me);

}  // namespace shardgather::detail
