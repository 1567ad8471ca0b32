#include "compute.h"

#include <cstddef>

namespace shardgather::bench {

namespace {
constexpr std::size_t kN = 128;
constexpr std::size_t kBlock = 64;  // three 64 x 64 float tiles fit in L1 + L2 comfortably
}  // namespace

Compute::Compute() : a_(kN * kN), b_(kN * kN), c_(kN * kN, 0.0F) {
  for (std::size_t k = 0; k < kN * kN; ++k) {
    a_[k] = static_cast<float>(k % 17) * 0.01F;
    b_[k] = static_cast<float>(k % 13) * 0.02F;
  }
}

void Compute::run(std::uint64_t units) {
  const float* a = a_.data();
  const float* b = b_.data();
  float* c = c_.data();
  for (std::uint64_t u = 0; u < units; ++u) {
    for (std::size_t ii = 0; ii < kN; ii += kBlock) {
      for (std::size_t kk = 0; kk < kN; kk += kBlock) {
        for (std::size_t jj = 0; jj < kN; jj += kBlock) {
          for (std::size_t i = ii; i < ii + kBlock; ++i) {
            for (std::size_t k = kk; k < kk + kBlock; ++k) {
              const float aik = a[i * kN + k];
              for (std::size_t j = jj; j < jj + kBlock; ++j) {
                c[i * kN + j] += aik * b[k * kN + j];
              }
            }
          }
        }
      }
    }
    c[u % (kN * kN)] *= 0.5F;  // keeps the accumulator bounded across many units
  }
}

float Compute::checksum() const {
  float sum = 0;
  for (const float v : c_) {
    sum += v;
  }
  return sum;
}

}  // namespace shardgather::bench
