// Shape records: how shapes travel inside the payload when no hint is given.
// A rank's records are, per tensor, one int64 ndim followed by its ndim int64 dims.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardgather/types.h"

namespace shardgather::detail {

// The records never describe more dims than this; a larger ndim on the wire is corruption.
inline constexpr std::int64_t kMaxRecordDims = 64;

// InvalidArgument naming the first tensor with more dims than records carry: checked before
// anything is sent, so that no rank's payload is rejected only after it moved.
void check_record_dims(std::span<const Shape> shapes);

// Writes the records of `shapes` to `out`, which holds record_bytes(shapes) bytes.
void encode_records(std::span<const Shape> shapes, std::byte* out) noexcept;

// Reads `num_tensors` records from `bytes`, validating every length and dim before use.
// Mismatch("corrupt shape records from rank r: ...") on anything malformed.
std::vector<Shape> decode_records(std::span<const std::byte> bytes, std::size_t num_tensors,
                                  int from_rank);

}  // namespace shardgather::detail
