// Overflow-checked 64-bit size arithmetic. Every size in the planner goes through these, so
// a product or sum that does not fit raises CountOverflow instead of wrapping.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "shardgather/errors.h"

namespace shardgather::detail {

inline std::uint64_t add_checked(std::uint64_t a, std::uint64_t b, const char* what) {
  if (b > std::numeric_limits<std::uint64_t>::max() - a) {
    throw CountOverflow(std::string(what) + ": " + std::to_string(a) + " + " + std::to_string(b) +
                        " overflows 64 bits");
  }
  return a + b;
}

inline std::uint64_t mul_checked(std::uint64_t a, std::uint64_t b, const char* what) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) {
    throw CountOverflow(std::string(what) + ": " + std::to_string(a) + " * " + std::to_string(b) +
                        " overflows 64 bits");
  }
  return a * b;
}

// `alignment` is a power of two.
inline std::uint64_t align_up_checked(std::uint64_t value, std::uint64_t alignment,
                                      const char* what) {
  return add_checked(value, (alignment - value % alignment) % alignment, what);
}

}  // namespace shardgather::detail
