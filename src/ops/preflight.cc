#include "ops/preflight.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "vocabulary/hash.h"

namespace shardgather::detail {

namespace {

bool known_operation(std::uint8_t op) noexcept {
  return op >= static_cast<std::uint8_t>(Operation::kForeachAllGather) &&
         op < static_cast<std::uint8_t>(Operation::kEnd);
}

std::string op_str(std::uint8_t op) {
  return std::string(operation_name(static_cast<Operation>(op)));
}

// "foreach_all_gather", or "foreach_all_gather (as the step 'unshard(quantize): payload')".
std::string call_str(const PreflightHeader& h) {
  std::string out = op_str(h.op);
  if (h.stage[0] != '\0') {
    out += " (as the step '" + std::string(h.stage) + "')";
  }
  return out;
}

std::string op_prefix(int me, const PreflightHeader& h) {
  return "rank " + std::to_string(me) + ": " + call_str(h) + " op seq " + std::to_string(h.seq) +
         ": ";
}

std::string strategy_str(const PreflightHeader& h) {
  return std::string(strategy_name(strategy_of(h)));
}

template <typename T>
[[noreturn]] void throw_field_mismatch(int me, const PreflightHeader& first, const char* field,
                                       int rank_a, T a, int rank_b, T b) {
  throw Mismatch(op_prefix(me, first) + field + " differs: rank " + std::to_string(rank_a) +
                 " has " + std::to_string(a) + ", rank " + std::to_string(rank_b) + " has " +
                 std::to_string(b));
}

}  // namespace

void set_status(PreflightHeader& header, ErrorCode code, std::string_view text) noexcept {
  header.status = static_cast<std::uint8_t>(code);
  const std::size_t n = std::min(text.size(), kStatusTextBytes - 1);
  std::memcpy(header.status_text, text.data(), n);
  header.status_text[n] = '\0';
}

void set_stage(PreflightHeader& header, const Stage& stage) noexcept {
  const std::string_view name = stage.name();  // at most kMaxBytes: the field's room
  std::memcpy(header.stage, name.data(), name.size());
  header.stage[name.size()] = '\0';
}

std::uint64_t hash_dtypes(std::span<const DType> dtypes) noexcept {
  Hasher hasher;
  hasher.add(dtypes.size());
  for (const DType dtype : dtypes) {
    hasher.add(static_cast<std::uint64_t>(dtype));
  }
  return hasher.value();
}

void set_dtypes(PreflightHeader& header, std::span<const DType> dtypes,
                std::uint64_t precomputed_hash) noexcept {
  header.num_tensors = dtypes.size();
  for (std::size_t i = 0; i < dtypes.size() && i < kInlineDTypes; ++i) {
    header.dtypes[i] = static_cast<std::uint8_t>(dtypes[i]);
  }
  header.dtype_hash = precomputed_hash != 0 ? precomputed_hash : hash_dtypes(dtypes);
}

std::uint64_t hash_hint(std::span<const std::vector<std::int64_t>> flat_hint, int world_size) {
  Hasher hasher;
  hasher.add(static_cast<std::uint64_t>(world_size));
  hasher.add(flat_hint.size());
  for (const auto& shape : flat_hint) {
    hasher.add(shape.size());
    for (const std::int64_t dim : shape) {
      hasher.add(static_cast<std::uint64_t>(dim));
    }
  }
  // 0 means "no hint" on the wire.
  return hasher.value() == 0 ? 1 : hasher.value();
}

PreflightHeader decode_header(std::span<const std::byte> bytes, int from_rank) {
  // Built only on failure: a good header must cost no allocation.
  const auto where = [from_rank] {
    return "corrupt pre-flight header from rank " + std::to_string(from_rank);
  };
  if (bytes.size() != sizeof(PreflightHeader)) {
    throw Mismatch(where() + ": " + std::to_string(bytes.size()) + " bytes, expected " +
                   std::to_string(sizeof(PreflightHeader)));
  }
  PreflightHeader h;
  std::memcpy(&h, bytes.data(), sizeof h);
  if (h.magic != kHeaderMagic) {
    throw Mismatch(where() + ": bad magic " + std::to_string(h.magic));
  }
  if (h.version != kHeaderVersion) {
    throw Mismatch(where() + ": version " + std::to_string(h.version) + ", this build speaks " +
                   std::to_string(kHeaderVersion));
  }
  if (!known_operation(h.op)) {
    throw Mismatch(where() + ": unknown operation " + std::to_string(h.op));
  }
  if (strategy_name(strategy_of(h)) == "invalid") {
    throw Mismatch(where() + ": unknown strategy " +
                   std::to_string((h.flags >> kStrategyShift) & 0xffU));
  }
  if (device_type_name(device_type_of(h)) == "invalid") {
    throw Mismatch(where() + ": unknown device type " +
                   std::to_string((h.flags >> kDeviceShift) & 0xffU));
  }
  if (device_gather_request_of(h) > kLastDeviceGather) {
    throw Mismatch(where() + ": unknown device gather request " +
                   std::to_string((h.flags >> kDeviceGatherShift) & 0xffU));
  }
  if (h.status > static_cast<std::uint8_t>(kLastErrorCode)) {
    throw Mismatch(where() + ": unknown status " + std::to_string(h.status));
  }
  if (std::memchr(h.status_text, '\0', kStatusTextBytes) == nullptr) {
    throw Mismatch(where() + ": unterminated status text");
  }
  if (std::memchr(h.stage, '\0', sizeof h.stage) == nullptr) {
    throw Mismatch(where() + ": unterminated stage");
  }
  return h;
}

namespace {

// Raises, naming rank `r`, the first field in which its header disagrees with rank 0's.
void check_agrees(const PreflightHeader& h0, const PreflightHeader& h, std::size_t r, int me) {
  const int rr = static_cast<int>(r);
  if (h.op != h0.op || std::strcmp(h.stage, h0.stage) != 0) {
    throw Mismatch(op_prefix(me, h0) + "operation differs: rank 0 calls " + call_str(h0) +
                   ", rank " + std::to_string(r) + " calls " + call_str(h));
  }
  if (h.world_size != h0.world_size) {
    throw_field_mismatch(me, h0, "world size", 0, h0.world_size, rr, h.world_size);
  }
  if (h.seq != h0.seq) {
    throw_field_mismatch(me, h0, "op sequence number", 0, h0.seq, rr, h.seq);
  }
  if (h.num_tensors != h0.num_tensors) {
    throw_field_mismatch(me, h0, "tensor count", 0, h0.num_tensors, rr, h.num_tensors);
  }
  if ((h.flags & kHasHint) != (h0.flags & kHasHint)) {
    throw Mismatch(op_prefix(me, h0) + "shapes hint given on rank " +
                   std::to_string((h0.flags & kHasHint) != 0 ? 0 : rr) + " but not on rank " +
                   std::to_string((h0.flags & kHasHint) != 0 ? rr : 0));
  }
  const std::size_t inline_n = std::min<std::uint64_t>(h.num_tensors, kInlineDTypes);
  for (std::size_t i = 0; i < inline_n; ++i) {
    if (h.dtypes[i] != h0.dtypes[i]) {
      throw Mismatch(
          op_prefix(me, h0) + "dtype of tensor " + std::to_string(i) + " differs: rank 0 has " +
          std::string(dtype_name(static_cast<DType>(h0.dtypes[i]))) + ", rank " +
          std::to_string(r) + " has " + std::string(dtype_name(static_cast<DType>(h.dtypes[i]))));
    }
  }
  if (h.dtype_hash != h0.dtype_hash) {
    throw Mismatch(op_prefix(me, h0) +
                   "dtype of a tensor at index >= " + std::to_string(kInlineDTypes) +
                   " differs between rank 0 and rank " + std::to_string(r) + " (dtype hash " +
                   std::to_string(h0.dtype_hash) + " vs " + std::to_string(h.dtype_hash) + ")");
  }
  // After the dtypes: a plan's fingerprint covers its dtypes too, and the dtype is the cause
  // that can be named.
  if (h.hint_hash != h0.hint_hash) {
    throw Mismatch(op_prefix(me, h0) + "shapes hint / plan differs between rank 0 and rank " +
                   std::to_string(r) + " (shapes hash " + std::to_string(h0.hint_hash) + " vs " +
                   std::to_string(h.hint_hash) + ")");
  }
  if (device_type_of(h) != device_type_of(h0)) {
    throw Mismatch(op_prefix(me, h0) + "device differs: rank 0 gathers " +
                   std::string(device_type_name(device_type_of(h0))) + " tensors, rank " +
                   std::to_string(r) + " " + std::string(device_type_name(device_type_of(h))) +
                   " tensors");
  }
  if (exchange_form_of(h) != exchange_form_of(h0)) {
    throw Mismatch(op_prefix(me, h0) + "transport exchange differs: rank 0 moves personal " +
                   "exchanges in form " + std::to_string(exchange_form_of(h0)) + ", rank " +
                   std::to_string(r) + " in form " + std::to_string(exchange_form_of(h)) +
                   " (MpiOptions::exchange must be the same on every rank)");
  }
  if (device_gather_request_of(h) != device_gather_request_of(h0)) {
    throw Mismatch(op_prefix(me, h0) + "device gather differs: rank 0 asks for " +
                   std::string(device_gather_name(device_gather_request_of(h0))) + ", rank " +
                   std::to_string(r) + " for " +
                   std::string(device_gather_name(device_gather_request_of(h))) +
                   " (SHARDGATHER_DEVICE_GATHER must be the same on every rank)");
  }
  // Last: plans that differ resolve kAuto differently, and "plan differs" is the cause.
  if (strategy_of(h) != strategy_of(h0)) {
    throw Mismatch(op_prefix(me, h0) + "strategy differs: rank 0 moves the payload with " +
                   strategy_str(h0) + ", rank " + std::to_string(r) + " with " + strategy_str(h));
  }
}

}  // namespace

void check_headers(std::span<const std::byte> gathered, std::span<PreflightHeader> headers,
                   int me) {
  const std::size_t world = headers.size();
  for (std::size_t r = 0; r < world; ++r) {
    headers[r] =
        decode_header(gathered.subspan(r * sizeof(PreflightHeader), sizeof(PreflightHeader)),
                      static_cast<int>(r));
  }
  const PreflightHeader& h0 = headers[0];
  // A failed local check anywhere wins: every rank raises that rank's class and text.
  for (std::size_t r = 0; r < world; ++r) {
    if (headers[r].status != static_cast<std::uint8_t>(ErrorCode::kOk)) {
      throw_error(static_cast<ErrorCode>(headers[r].status),
                  op_prefix(me, headers[r]) + "failed on rank " + std::to_string(r) + ": " +
                      headers[r].status_text);
    }
  }
  for (std::size_t r = 1; r < world; ++r) {
    check_agrees(h0, headers[r], r, me);
  }
}

}  // namespace shardgather::detail
