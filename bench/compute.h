// The overlap benchmark's stand-in for a trainer's own work: a blocked single-precision matrix
// multiply, deterministic, on buffers allocated and touched once.
#pragma once

#include <cstdint>
#include <vector>

namespace shardgather::bench {

class Compute {
 public:
  Compute();
  // `units` multiplies of two 128 x 128 matrices (about 4 MFLOP each) into an accumulator.
  void run(std::uint64_t units);
  // A value depending on every result, so the work cannot be optimised away.
  [[nodiscard]] float checksum() const;

 private:
  std::vector<float> a_;
  std::vector<float> b_;
  std::vector<float> c_;
};

}  // namespace shardgather::bench
