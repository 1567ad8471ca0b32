// Test support shared by the threads and MPI suites: deterministic data, tensor factories,
// the rank-thread harness and the naive per-tensor reference.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardgather/shardgather.h"

namespace shardgather::testing {

// Runs `call` and returns the class it raised ("Ok" when it returned) and its message.
template <typename Fn>
std::pair<std::string, std::string> outcome(Fn&& call) {
  try {
    call();
  } catch (const Error& e) {
    return {std::string(error_code_name(e.code())), e.what()};
  }
  return {"Ok", ""};
}

std::uint64_t mix(std::uint64_t x) noexcept;

// Byte k of the logical (row-major) contents of tensor `tensor` on rank `rank`.
void fill_pattern(std::span<std::byte> out, std::uint64_t seed, int rank, std::size_t tensor);

enum class Layout {
  kContiguous,
  kEveryOther,  // strides twice the row-major ones in the last dim: every second element
  kTransposed,  // 2-D only: column-major storage
};

// An owning host tensor whose logical contents are the pattern of (seed, rank, tensor).
struct HostTensor {
  std::vector<std::byte> storage;
  TensorView view;
};

HostTensor make_tensor(DType dtype, const Shape& shape, std::uint64_t seed, int rank,
                       std::size_t tensor, Layout layout = Layout::kContiguous);

std::vector<TensorView> views_of(const std::vector<HostTensor>& tensors);

// Counts the bytes of out[i][r] that differ from rank r's pattern; also checks each
// view's shape and dtype against `shapes` ([r][i]) and `dtypes`. Returns a description of
// the first problem, or "" when everything is bit-exact.
std::string verify_gather(const GatherResult& out, const std::vector<std::vector<Shape>>& shapes,
                          const std::vector<DType>& dtypes, std::uint64_t seed);

// The naive reference: one all_gather_v per tensor, sizes from a per-tensor all_gather of the
// byte counts. Returns [i][r] -> bytes.
std::vector<std::vector<std::vector<std::byte>>> reference_gather(
    std::span<const TensorView> params, Communicator& comm);

// H1: runs fn(rank, comm) on world_size threads over one thread group. A watchdog prints
// "HUNG <name>" and aborts the process when the ranks have not finished within hard_deadline.
// The first exception thrown by any rank is rethrown after all threads joined.
void run_ranks(int world_size, const std::function<void(int, Communicator&)>& fn,
               const std::string& name,
               std::chrono::milliseconds hard_deadline = std::chrono::seconds(60));
// The same over simulated hosts: rank r on host hosts[r] (make_thread_group's numbering).
void run_ranks_on_hosts(const std::vector<int>& hosts,
                        const std::function<void(int, Communicator&)>& fn, const std::string& name,
                        std::chrono::milliseconds hard_deadline = std::chrono::seconds(60));

// A random list for property tests, the same on every rank for (seed, iter), with shapes
// that depend on the rank: returns dtypes and shapes[r][i].
struct RandomList {
  std::vector<DType> dtypes;
  std::vector<std::vector<Shape>> shapes;
};
RandomList random_list(std::uint64_t seed, int iter, int world_size, std::size_t max_tensors);

}  // namespace shardgather::testing
