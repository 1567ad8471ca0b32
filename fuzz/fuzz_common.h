// Shared by the fuzz targets: decoding a planner input from the fuzzer's bytes, a check macro
// that aborts (so libFuzzer records a crash), and a byte pattern.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "shardgather/types.h"

#define FUZZ_CHECK(cond)                                                                \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (false)

namespace shardgather::fuzz {

// the fuzzing plan (docs/reliability.md): world 1-64, n 0-256, dims 0-4 with sizes up to 2^40, any
// dtype code (invalid ones included), the records flag. Sizes favour small and boundary values so
// that many plans are valid; negative dims appear too.
struct Input {
  int world = 1;
  bool with_records = false;
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;  // rank-major
};

inline std::int64_t consume_dim(FuzzedDataProvider& fdp) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return fdp.ConsumeIntegralInRange<std::int64_t>((std::int64_t{1} << 31) - 2,
                                                      (std::int64_t{1} << 31) + 2);
    case 3:
      return fdp.ConsumeIntegralInRange<std::int64_t>(0, std::int64_t{1} << 40);
    case 4:
      return fdp.ConsumeIntegral<std::int64_t>();  // negative and huge
    default:
      return fdp.ConsumeIntegralInRange<std::int64_t>(0, 37);
  }
}

inline Input consume_input(FuzzedDataProvider& fdp) {
  Input in;
  in.world = fdp.ConsumeIntegralInRange<int>(1, 64);
  in.with_records = fdp.ConsumeBool();
  const auto n = fdp.ConsumeIntegralInRange<std::size_t>(0, 256);
  std::vector<std::size_t> ndims(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto code = fdp.ConsumeIntegralInRange<std::uint8_t>(0, 11);  // 10, 11: invalid
    in.dtypes.push_back(static_cast<DType>(code));
    ndims[i] = fdp.ConsumeIntegralInRange<std::size_t>(0, 4);
  }
  // Ranks repeat the first rank's shapes unless the fuzzer pays for different ones.
  in.shapes.reserve(n * static_cast<std::size_t>(in.world));
  for (int r = 0; r < in.world; ++r) {
    const bool fresh = r == 0 || fdp.ConsumeBool();
    for (std::size_t i = 0; i < n; ++i) {
      if (fresh) {
        Shape s(ndims[i]);
        for (auto& d : s) {
          d = consume_dim(fdp);
        }
        in.shapes.push_back(std::move(s));
      } else {
        in.shapes.push_back(in.shapes[(static_cast<std::size_t>(r) - 1) * n + i]);
      }
    }
  }
  return in;
}

inline std::byte pattern(std::size_t rank, std::size_t tensor, std::uint64_t b) {
  return static_cast<std::byte>((rank * 131 + tensor * 31 + b * 7 + 1) & 0xffU);
}

}  // namespace shardgather::fuzz
