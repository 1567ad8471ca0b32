#include "support/testing.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "shardgather/copy.h"

namespace shardgather::testing {

std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27U)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31U);
}

void fill_pattern(std::span<std::byte> out, std::uint64_t seed, int rank, std::size_t tensor) {
  const std::uint64_t key =
      mix(seed ^ mix(static_cast<std::uint64_t>(rank) * std::uint64_t{1000003} + tensor));
  std::size_t k = 0;
  for (std::uint64_t w = 0; k < out.size(); ++w) {
    const std::uint64_t word = mix(key + w);
    for (unsigned b = 0; b < 8 && k < out.size(); ++b, ++k) {
      out[k] = static_cast<std::byte>((word >> (8U * b)) & 0xffU);
    }
  }
}

HostTensor make_tensor(DType dtype, const Shape& shape, std::uint64_t seed, int rank,
                       std::size_t tensor, Layout layout) {
  const std::uint64_t bytes = checked_nbytes(dtype, shape);
  const std::size_t elem = dtype_size(dtype);
  std::vector<std::byte> logical(bytes);
  fill_pattern(logical, seed, rank, tensor);
  HostTensor t;
  t.view.dtype = dtype;
  t.view.shape = shape;
  const std::size_t ndim = shape.size();
  if (layout == Layout::kContiguous || ndim == 0) {
    t.storage = std::move(logical);
    // Keep a non-null pointer even for empty tensors, as frameworks do.
    if (t.storage.empty()) {
      t.storage.resize(8);
    }
    t.view.data = t.storage.data();
    return t;
  }
  Shape strides(ndim, 1);
  if (layout == Layout::kTransposed) {
    if (ndim != 2) {
      throw InvalidArgument("kTransposed needs a 2-D shape");
    }
    strides = {1, shape[0]};
  } else {
    strides[ndim - 1] = 2;
    for (std::size_t d = ndim - 1; d-- > 0;) {
      strides[d] = strides[d + 1] * shape[d + 1];
    }
  }
  std::int64_t extent = 1;
  for (std::size_t d = 0; d < ndim; ++d) {
    extent += (shape[d] == 0 ? 0 : (shape[d] - 1) * strides[d]);
  }
  t.storage.assign(static_cast<std::size_t>(extent) * elem + 8, std::byte{0x5a});
  t.view.data = t.storage.data();
  t.view.strides = strides;
  // Scatter logical element j to its strided location.
  const std::uint64_t numel = bytes / elem;
  std::vector<std::int64_t> index(ndim, 0);
  for (std::uint64_t j = 0; j < numel; ++j) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < ndim; ++d) {
      offset += index[d] * strides[d];
    }
    std::memcpy(t.storage.data() + offset * static_cast<std::int64_t>(elem),
                logical.data() + j * elem, elem);
    for (std::size_t d = ndim; d-- > 0;) {
      if (++index[d] < shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
  return t;
}

std::vector<TensorView> views_of(const std::vector<HostTensor>& tensors) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const HostTensor& t : tensors) {
    views.push_back(t.view);
  }
  return views;
}

std::string verify_gather(const GatherResult& out, const std::vector<std::vector<Shape>>& shapes,
                          const std::vector<DType>& dtypes, std::uint64_t seed) {
  const std::string where = " (seed " + std::to_string(seed) + ")";
  if (out.size() != dtypes.size()) {
    return "result has " + std::to_string(out.size()) + " tensors, expected " +
           std::to_string(dtypes.size()) + where;
  }
  if (!out.empty() && out.world_size() != static_cast<int>(shapes.size())) {
    return "result world size " + std::to_string(out.world_size()) + where;
  }
  std::vector<std::byte> expected;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    for (std::size_t r = 0; r < shapes.size(); ++r) {
      const TensorView& v = out[i][r];
      const std::string at = "out[" + std::to_string(i) + "][" + std::to_string(r) + "]";
      if (v.shape != shapes[r][i]) {
        return at + " has the wrong shape" + where;
      }
      if (v.dtype != dtypes[i]) {
        return at + " has the wrong dtype" + where;
      }
      // Empty tensors take no space and no alignment (docs/layout.md).
      if (checked_nbytes(v.dtype, v.shape) != 0 &&
          reinterpret_cast<std::uintptr_t>(v.data) % dtype_size(v.dtype) != 0) {
        return at + " is not aligned to its element size" + where;
      }
      expected.resize(checked_nbytes(dtypes[i], shapes[r][i]));
      fill_pattern(expected, seed, static_cast<int>(r), i);
      if (!expected.empty() && std::memcmp(v.data, expected.data(), expected.size()) != 0) {
        std::size_t k = 0;
        const auto* got = static_cast<const std::byte*>(v.data);
        while (got[k] == expected[k]) {
          ++k;
        }
        return at + " differs from rank " + std::to_string(r) + "'s tensor " + std::to_string(i) +
               " at byte " + std::to_string(k) + where;
      }
    }
  }
  return "";
}

std::vector<std::vector<std::vector<std::byte>>> reference_gather(
    std::span<const TensorView> params, Communicator& comm) {
  const auto world = static_cast<std::size_t>(comm.size());
  const Deadline deadline = comm.deadline_after(comm.timeout());
  std::vector<std::vector<std::vector<std::byte>>> out(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::uint64_t bytes = checked_nbytes(params[i].dtype, params[i].shape);
    std::vector<std::byte> packed(bytes);
    pack(params[i], packed.data());
    std::vector<std::uint64_t> counts(world);
    comm.all_gather(std::as_bytes(std::span(&bytes, 1)), std::as_writable_bytes(std::span(counts)),
                    deadline);
    std::vector<std::uint64_t> displs(world);
    const std::uint64_t total = place_blocks(counts, 1, displs);
    std::vector<std::byte> recv(total);
    const ConstSegment segment{packed.data(), packed.size()};
    comm.all_gather_v(std::span(&segment, 1), recv.data(), counts, displs, deadline);
    for (std::size_t r = 0; r < world; ++r) {
      const auto begin = recv.begin() + static_cast<std::ptrdiff_t>(displs[r]);
      out[i].emplace_back(begin, begin + static_cast<std::ptrdiff_t>(counts[r]));
    }
  }
  return out;
}

void run_ranks(int world_size, const std::function<void(int, Communicator&)>& fn,
               const std::string& name, std::chrono::milliseconds hard_deadline) {
  run_ranks_on_hosts(std::vector<int>(static_cast<std::size_t>(world_size), 0), fn, name,
                     hard_deadline);
}

void run_ranks_on_hosts(const std::vector<int>& hosts,
                        const std::function<void(int, Communicator&)>& fn, const std::string& name,
                        std::chrono::milliseconds hard_deadline) {
  const auto world_size = static_cast<int>(hosts.size());
  auto comms = make_thread_group(world_size, hosts);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world_size));
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[static_cast<std::size_t>(r)]);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
      const std::lock_guard<std::mutex> lock(mu);
      ++finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, hard_deadline, [&] { return finished == world_size; })) {
      std::fprintf(stderr, "HUNG %s\n", name.c_str());
      std::fflush(stderr);
      std::abort();
    }
  }
  for (std::thread& t : threads) {
    t.join();
  }
  for (const std::exception_ptr& e : errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
}

RandomList random_list(std::uint64_t seed, int iter, int world_size, std::size_t max_tensors) {
  std::uint64_t state = mix(seed * std::uint64_t{7919} + static_cast<std::uint64_t>(iter));
  const auto next = [&state](std::uint64_t bound) {
    state = mix(state);
    return bound == 0 ? 0 : state % bound;
  };
  RandomList list;
  const std::size_t n = next(max_tensors + 1);
  std::vector<std::size_t> ndims(n);
  constexpr DType kDTypes[] = {DType::kBool,    DType::kUInt8,  DType::kInt8,    DType::kInt16,
                               DType::kInt32,   DType::kInt64,  DType::kFloat16, DType::kBFloat16,
                               DType::kFloat32, DType::kFloat64};
  for (std::size_t i = 0; i < n; ++i) {
    list.dtypes.push_back(kDTypes[next(kNumDTypes)]);
    ndims[i] = next(4);
  }
  list.shapes.resize(static_cast<std::size_t>(world_size));
  for (auto& row : list.shapes) {
    for (std::size_t i = 0; i < n; ++i) {
      Shape shape(ndims[i]);
      for (auto& dim : shape) {
        // Mostly small odd sizes, sometimes 0 or 1.
        const std::uint64_t pick = next(10);
        dim = pick == 0 ? 0 : pick == 1 ? 1 : static_cast<std::int64_t>(next(37) + 1);
      }
      row.push_back(shape);
    }
  }
  return list;
}

}  // namespace shardgather::testing
