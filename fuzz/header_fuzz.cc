// Z3: the pre-flight header decoder and the shape-records decoder on arbitrary bytes. Both must
// either return something valid or raise Mismatch, and never read outside the buffer (ASan).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz_common.h"
#include "ops/preflight.h"
#include "ops/records.h"

#include "shardgather/errors.h"

using namespace shardgather;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 2);
  if (mode == 0) {
    // One header of any length, copied to an exact-size heap buffer so ASan sees its end.
    const std::vector<std::uint8_t> raw = fdp.ConsumeRemainingBytes<std::uint8_t>();
    std::vector<std::byte> bytes(raw.size());
    std::transform(raw.begin(), raw.end(), bytes.begin(), [](auto b) { return std::byte{b}; });
    try {
      const detail::PreflightHeader h = detail::decode_header(bytes, 1);
      FUZZ_CHECK(h.magic == detail::kHeaderMagic);
      FUZZ_CHECK(std::memchr(h.status_text, '\0', detail::kStatusTextBytes) != nullptr);
      FUZZ_CHECK(std::memchr(h.stage, '\0', sizeof h.stage) != nullptr);
    } catch (const Mismatch&) {
    }
  } else if (mode == 1) {
    // A gathered set of headers: valid ones (so the cross checks run) with fuzzed fields.
    const auto world = fdp.ConsumeIntegralInRange<std::size_t>(1, 8);
    std::vector<std::byte> gathered(world * sizeof(detail::PreflightHeader));
    for (std::size_t r = 0; r < world; ++r) {
      detail::PreflightHeader h;
      h.world_size = static_cast<std::uint32_t>(world);
      const std::vector<std::uint8_t> patch =
          fdp.ConsumeBytes<std::uint8_t>(fdp.ConsumeIntegralInRange<std::size_t>(0, sizeof h));
      const auto at = fdp.ConsumeIntegralInRange<std::size_t>(0, sizeof h - patch.size());
      if (!patch.empty()) {
        std::memcpy(reinterpret_cast<std::uint8_t*>(&h) + at, patch.data(), patch.size());
      }
      std::memcpy(gathered.data() + r * sizeof h, &h, sizeof h);
    }
    std::vector<detail::PreflightHeader> headers(world);
    try {
      detail::check_headers(gathered, headers, 0);
    } catch (const Error& e) {
      // A failed status travels with its own class; everything else is a Mismatch.
      FUZZ_CHECK(e.code() != ErrorCode::kOk);
    }
  } else {
    const auto n = fdp.ConsumeIntegralInRange<std::size_t>(0, 300);
    const std::vector<std::uint8_t> raw = fdp.ConsumeRemainingBytes<std::uint8_t>();
    std::vector<std::byte> bytes(raw.size());
    std::transform(raw.begin(), raw.end(), bytes.begin(), [](auto b) { return std::byte{b}; });
    try {
      const std::vector<Shape> shapes = detail::decode_records(bytes, n, 2);
      FUZZ_CHECK(shapes.size() == n);
      std::uint64_t words = n;
      for (const Shape& s : shapes) {
        FUZZ_CHECK(s.size() <= static_cast<std::size_t>(detail::kMaxRecordDims));
        for (const std::int64_t d : s) {
          FUZZ_CHECK(d >= 0);
        }
        words += s.size();
      }
      FUZZ_CHECK(words * 8 <= bytes.size());
    } catch (const Mismatch&) {
    }
  }
  return 0;
}
