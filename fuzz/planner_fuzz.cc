// Z1: the layout planner on arbitrary inputs. It either raises InvalidArgument/CountOverflow or
// returns a plan whose invariants hold (docs/reliability.md, fuzzing); small plans are
// materialised: every rank's send stream (records, zero gaps, tensors) placed at its displacement
// must put every tensor at the offset the plan gives it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_common.h"
#include "ops/records.h"

#include "shardgather/errors.h"
#include "shardgather/layout.h"

using namespace shardgather;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const fuzz::Input in = fuzz::consume_input(fdp);
  const LayoutOptions options{.with_records = in.with_records};
  LayoutPlan plan;
  try {
    plan = plan_layout(in.dtypes, in.shapes, in.world, options);
  } catch (const CountOverflow&) {
    return 0;
  } catch (const InvalidArgument&) {
    return 0;
  }
  const std::size_t n = in.dtypes.size();
  const auto world = static_cast<std::size_t>(in.world);
  FUZZ_CHECK(plan.world_size == in.world && plan.num_tensors == n);
  FUZZ_CHECK(plan.counts.size() == world && plan.displs.size() == world);
  FUZZ_CHECK(plan.alignment == block_alignment(in.dtypes, options));
  std::uint64_t prev_end = 0;
  for (std::size_t r = 0; r < world; ++r) {
    // Blocks: aligned, in rank order, disjoint, inside the buffer.
    FUZZ_CHECK(plan.displs[r] % plan.alignment == 0);
    FUZZ_CHECK(plan.displs[r] >= prev_end);
    FUZZ_CHECK(plan.displs[r] - prev_end < plan.alignment);  // no padding beyond alignment
    const std::uint64_t end = plan.displs[r] + plan.counts[r];
    FUZZ_CHECK(end >= plan.displs[r] && end <= plan.total_bytes);
    prev_end = end;
    const std::span<const Shape> rank_shapes(in.shapes.data() + r * n, n);
    const BlockLayout block = plan_block(in.dtypes, rank_shapes, options);
    FUZZ_CHECK(block.bytes == plan.counts[r]);
    FUZZ_CHECK(block.record_bytes == (in.with_records ? record_bytes(rank_shapes) : 0));
    std::uint64_t tensor_end = plan.displs[r] + block.record_bytes;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = plan.index(static_cast<int>(r), i);
      FUZZ_CHECK(plan.sizes[k] == checked_nbytes(in.dtypes[i], rank_shapes[i]));
      FUZZ_CHECK(plan.shapes[k] == rank_shapes[i]);
      // Tensors: in order, disjoint, inside the block, aligned when non-empty.
      FUZZ_CHECK(plan.offsets[k] >= tensor_end);
      FUZZ_CHECK(plan.offsets[k] + plan.sizes[k] <= end);
      if (plan.sizes[k] != 0) {
        FUZZ_CHECK(plan.offsets[k] % dtype_size(in.dtypes[i]) == 0);
        FUZZ_CHECK(plan.offsets[k] - tensor_end < dtype_size(in.dtypes[i]));
      }
      FUZZ_CHECK(plan.offsets[k] - plan.displs[r] == block.offsets[i]);
      tensor_end = plan.offsets[k] + plan.sizes[k];
    }
    FUZZ_CHECK(tensor_end == end);  // the block ends with its last tensor: no trailing bytes
  }
  FUZZ_CHECK(plan.total_bytes == prev_end);

  // Materialise small plans: simulate pack -> gather -> unpack and check the identity.
  if (plan.total_bytes < (64U << 10)) {
    std::vector<std::byte> gathered(plan.total_bytes, std::byte{0xEE});
    for (std::size_t r = 0; r < world; ++r) {
      const std::span<const Shape> rank_shapes(in.shapes.data() + r * n, n);
      std::vector<std::byte> stream;
      if (in.with_records) {
        stream.resize(record_bytes(rank_shapes));
        detail::encode_records(rank_shapes, stream.data());
      }
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t k = plan.index(static_cast<int>(r), i);
        if (plan.sizes[k] == 0) {
          continue;
        }
        stream.resize(plan.offsets[k] - plan.displs[r], std::byte{0});
        for (std::uint64_t b = 0; b < plan.sizes[k]; ++b) {
          stream.push_back(fuzz::pattern(r, i, b));
        }
      }
      FUZZ_CHECK(stream.size() == plan.counts[r]);
      if (!stream.empty()) {
        std::memcpy(gathered.data() + plan.displs[r], stream.data(), stream.size());
      }
      if (in.with_records) {
        const std::vector<Shape> decoded = detail::decode_records(
            std::span<const std::byte>(gathered.data() + plan.displs[r], plan.counts[r]), n,
            static_cast<int>(r));
        FUZZ_CHECK(std::equal(decoded.begin(), decoded.end(), rank_shapes.begin()));
      }
    }
    for (std::size_t r = 0; r < world; ++r) {
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t k = plan.index(static_cast<int>(r), i);
        for (std::uint64_t b = 0; b < plan.sizes[k]; ++b) {
          FUZZ_CHECK(gathered[plan.offsets[k] + b] == fuzz::pattern(r, i, b));
        }
      }
    }
  }
  return 0;
}
