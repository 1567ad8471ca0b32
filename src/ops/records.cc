#include "ops/records.h"

#include <cstring>
#include <string>

#include "shardgather/errors.h"

namespace shardgather::detail {

void check_record_dims(std::span<const Shape> shapes) {
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    if (static_cast<std::int64_t>(shapes[i].size()) > kMaxRecordDims) {
      throw InvalidArgument("tensor " + std::to_string(i) + ": " +
                            std::to_string(shapes[i].size()) + " dims; without a shapes hint at " +
                            "most " + std::to_string(kMaxRecordDims) + " can travel");
    }
  }
}

void encode_records(std::span<const Shape> shapes, std::byte* out) noexcept {
  for (const Shape& shape : shapes) {
    const auto ndim = static_cast<std::int64_t>(shape.size());
    std::memcpy(out, &ndim, sizeof ndim);
    out += sizeof ndim;
    if (!shape.empty()) {
      std::memcpy(out, shape.data(), shape.size() * sizeof(std::int64_t));
      out += shape.size() * sizeof(std::int64_t);
    }
  }
}

std::vector<Shape> decode_records(std::span<const std::byte> bytes, std::size_t num_tensors,
                                  int from_rank) {
  const auto fail = [from_rank](const std::string& why) {
    throw Mismatch("corrupt shape records from rank " + std::to_string(from_rank) + ": " + why);
  };
  std::vector<Shape> shapes(num_tensors);
  std::size_t pos = 0;
  const auto read_word = [&](std::size_t tensor) {
    if (bytes.size() - pos < sizeof(std::int64_t)) {
      fail("truncated at tensor " + std::to_string(tensor));
    }
    std::int64_t word = 0;
    std::memcpy(&word, bytes.data() + pos, sizeof word);
    pos += sizeof word;
    return word;
  };
  for (std::size_t i = 0; i < num_tensors; ++i) {
    const std::int64_t ndim = read_word(i);
    if (ndim < 0 || ndim > kMaxRecordDims) {
      fail("tensor " + std::to_string(i) + " has ndim " + std::to_string(ndim));
    }
    shapes[i].resize(static_cast<std::size_t>(ndim));
    for (auto& dim : shapes[i]) {
      dim = read_word(i);
      if (dim < 0) {
        fail("tensor " + std::to_string(i) + " has a negative dim " + std::to_string(dim));
      }
    }
  }
  return shapes;
}

}  // namespace shardgather::detail
