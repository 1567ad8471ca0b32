// Stage: which step of a compound operation a call is.
//
// An operation built from several calls (a binding's quantized transfer: an agreement, an amax
// exchange, a payload; a weight sync's state, sizes, payload and vote rounds) names each call
// with a stage, and the stage travels in the call's pre-flight header. Ranks whose calls carry
// different stages raise Mismatch naming both operations and stages, so a step can never pair
// with another rank's own call (whose stage is empty) or with another step, even where both
// would move the same bytes. Set it in ForeachAllGatherOptions::stage, PlanOptions::stage (a
// plan's every execution carries its plan's stage) or CallShape::stage.
//
// A value: a fixed-size name, no allocation, cheap to copy.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

#include "shardgather/export.h"

namespace shardgather {

class SHARDGATHER_API Stage {
 public:
  // The longest name the header carries.
  static constexpr std::size_t kMaxBytes = 47;

  Stage() = default;  // empty: a call of its own, no step of anything
  // InvalidArgument when `name` is longer than kMaxBytes or holds a NUL byte.
  explicit Stage(std::string_view name);

  [[nodiscard]] std::string_view name() const noexcept;
  [[nodiscard]] bool empty() const noexcept { return name_[0] == '\0'; }
  friend bool operator==(const Stage&, const Stage&) = default;

 private:
  std::array<char, kMaxBytes + 1> name_{};
};

}  // namespace shardgather
