// Z2: the planner against a naive reference planner written here with 128-bit arithmetic:
// the same plan field by field, or the same error class.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_common.h"

#include "shardgather/errors.h"
#include "shardgather/layout.h"

using namespace shardgather;

namespace {

using U128 = unsigned __int128;
constexpr U128 kMax64 = ~std::uint64_t{0};

struct RefPlan {
  std::string error;  // "", "InvalidArgument" or "CountOverflow"
  std::uint64_t alignment = 1;
  std::vector<std::uint64_t> offsets, sizes, counts, displs;
  std::uint64_t total = 0;
};

RefPlan reference(const fuzz::Input& in) {
  RefPlan p;
  const std::size_t n = in.dtypes.size();
  // Argument errors first, as the planner validates each tensor before adding it up.
  for (const DType d : in.dtypes) {
    if (dtype_size(d) == 0) {
      p.error = "InvalidArgument";
    }
  }
  for (const Shape& s : in.shapes) {
    for (const std::int64_t d : s) {
      if (d < 0) {
        p.error = "InvalidArgument";
      }
    }
  }
  if (!p.error.empty()) {
    return p;
  }
  p.alignment = in.with_records ? 8 : 1;
  for (const DType d : in.dtypes) {
    p.alignment = std::max<std::uint64_t>(p.alignment, dtype_size(d));
  }
  U128 end = 0;
  for (int r = 0; r < in.world; ++r) {
    U128 off = 0;
    if (in.with_records) {
      U128 words = n;
      for (std::size_t i = 0; i < n; ++i) {
        words += in.shapes[static_cast<std::size_t>(r) * n + i].size();
      }
      off = words * 8;
    }
    std::vector<U128> offs(n), sizes(n);
    for (std::size_t i = 0; i < n; ++i) {
      const Shape& s = in.shapes[static_cast<std::size_t>(r) * n + i];
      U128 size = dtype_size(in.dtypes[i]);
      bool zero = false;
      for (const std::int64_t d : s) {
        zero = zero || d == 0;
      }
      for (const std::int64_t d : s) {
        size = zero ? 0 : size * static_cast<std::uint64_t>(d);
        if (size > kMax64) {
          p.error = "CountOverflow";
          return p;
        }
      }
      if (size != 0) {
        const std::uint64_t e = dtype_size(in.dtypes[i]);
        off = (off + e - 1) / e * e;
      }
      offs[i] = off;
      sizes[i] = size;
      off += size;
      if (off > kMax64) {
        p.error = "CountOverflow";
        return p;
      }
    }
    const U128 displ = (end + p.alignment - 1) / p.alignment * p.alignment;
    if (displ + off > kMax64) {
      p.error = "CountOverflow";
      return p;
    }
    p.counts.push_back(static_cast<std::uint64_t>(off));
    p.displs.push_back(static_cast<std::uint64_t>(displ));
    for (std::size_t i = 0; i < n; ++i) {
      p.offsets.push_back(static_cast<std::uint64_t>(displ + offs[i]));
      p.sizes.push_back(static_cast<std::uint64_t>(sizes[i]));
    }
    end = displ + off;
  }
  p.total = static_cast<std::uint64_t>(end);
  return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const fuzz::Input in = fuzz::consume_input(fdp);
  const RefPlan ref = reference(in);
  std::string error;
  LayoutPlan plan;
  try {
    plan = plan_layout(in.dtypes, in.shapes, in.world, {.with_records = in.with_records});
  } catch (const CountOverflow&) {
    error = "CountOverflow";
  } catch (const InvalidArgument&) {
    error = "InvalidArgument";
  }
  if (!ref.error.empty() || !error.empty()) {
    // Which error wins when a list has both kinds may differ; that an error is raised may not.
    FUZZ_CHECK(!ref.error.empty() && !error.empty());
    FUZZ_CHECK(ref.error != "CountOverflow" || error == "CountOverflow" ||
               error == "InvalidArgument");
    return 0;
  }
  FUZZ_CHECK(plan.alignment == ref.alignment);
  FUZZ_CHECK(plan.counts == ref.counts);
  FUZZ_CHECK(plan.displs == ref.displs);
  FUZZ_CHECK(plan.offsets == ref.offsets);
  FUZZ_CHECK(plan.sizes == ref.sizes);
  FUZZ_CHECK(plan.total_bytes == ref.total);
  return 0;
}
