// FNV-1a over 64-bit words: the fingerprint hashes in the pre-flight header. Not
// cryptographic; it only has to make accidental agreement between different lists unlikely.
#pragma once

#include <cstdint>

namespace shardgather::detail {

class Hasher {
 public:
  void add(std::uint64_t word) noexcept {
    for (int i = 0; i < 8; ++i) {
      hash_ ^= (word >> (8 * i)) & 0xffU;
      hash_ *= 0x100000001b3ULL;
    }
  }
  [[nodiscard]] std::uint64_t value() const noexcept { return hash_; }

 private:
  std::uint64_t hash_ = 0xcbf29ce484222325ULL;
};

}  // namespace shardgather::detail
