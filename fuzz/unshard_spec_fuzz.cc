// Z4: UnshardPlan on arbitrary specs (dtype codes, full shapes, shard dims, per-rank sizes near
// the int64 limits, padded sizes, world sizes). It either raises InvalidArgument/CountOverflow
// or returns a plan whose arithmetic holds: the sizes sum to the full dim, every rank's local
// shard fits the padded size, the output offsets are 64-byte aligned and in order, and the
// output holds every full parameter.
#include <cstdint>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_common.h"

#include "shardgather/errors.h"
#include "shardgather/layout.h"
#include "shardgather/unshard.h"

using namespace shardgather;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const int world = fdp.ConsumeIntegralInRange<int>(1, 16);
  const int rank = fdp.ConsumeIntegralInRange<int>(-1, world);  // out of range too
  const auto n = fdp.ConsumeIntegralInRange<std::size_t>(0, 16);
  std::vector<ShardSpec> specs(n);
  for (ShardSpec& s : specs) {
    s.dtype = static_cast<DType>(fdp.ConsumeIntegralInRange<std::uint8_t>(0, 11));
    const auto ndim = fdp.ConsumeIntegralInRange<std::size_t>(0, 4);
    for (std::size_t d = 0; d < ndim; ++d) {
      s.full_shape.push_back(fuzz::consume_dim(fdp));
    }
    s.shard_dim = fdp.ConsumeIntegralInRange<int>(-5, 5);
    if (fdp.ConsumeBool()) {
      const auto k = fdp.ConsumeIntegralInRange<std::size_t>(0, 17);
      for (std::size_t r = 0; r < k; ++r) {
        s.sizes.push_back(fuzz::consume_dim(fdp));
      }
    }
    s.padded_size = fdp.ConsumeBool() ? fuzz::consume_dim(fdp) : 0;
  }
  UnshardPlan plan;
  try {
    plan = UnshardPlan(specs, world, rank);
  } catch (const CountOverflow&) {
    return 0;
  } catch (const InvalidArgument&) {
    return 0;
  }
  FUZZ_CHECK(rank >= 0 && rank < world);
  FUZZ_CHECK(plan.size() == n && plan.world_size() == world);
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const ShardSpec& s = plan.spec(i);
    FUZZ_CHECK(s.shard_dim >= 0 && static_cast<std::size_t>(s.shard_dim) < s.full_shape.size());
    FUZZ_CHECK(s.sizes.size() == static_cast<std::size_t>(world));
    const std::int64_t full_d = s.full_shape[static_cast<std::size_t>(s.shard_dim)];
    std::uint64_t sum = 0;
    for (const std::int64_t rows : s.sizes) {
      FUZZ_CHECK(rows >= 0 && rows <= full_d);
      sum += static_cast<std::uint64_t>(rows);  // no wrap: each is at most full_d
      FUZZ_CHECK(s.padded_size == 0 || rows <= s.padded_size);
    }
    FUZZ_CHECK(sum == static_cast<std::uint64_t>(full_d));
    FUZZ_CHECK(plan.output_offset(i) % 64 == 0 && plan.output_offset(i) >= end);
    const std::uint64_t bytes = checked_nbytes(s.dtype, s.full_shape);
    end = plan.output_offset(i) + bytes;
    FUZZ_CHECK(end >= plan.output_offset(i) && end <= plan.output_bytes());
    (void)checked_nbytes(s.dtype, plan.shard_shape(rank, i));  // the local shard's bytes fit
  }
  FUZZ_CHECK(plan.output_bytes() == end || n == 0);
  return 0;
}
