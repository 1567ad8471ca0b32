#include "support/reshard_cases.h"

#include <algorithm>
#include <numeric>

#include <gtest/gtest.h>

#include "support/testing.h"

namespace shardgather::testing {

namespace {

struct Rng {
  std::uint64_t state;
  std::uint64_t next() { return state = mix(state); }
  // In [lo, hi].
  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  bool chance(int percent) { return static_cast<int>(next() % 100) < percent; }
};

std::byte pattern(std::uint64_t seed, std::size_t tensor, std::uint64_t k) {
  return static_cast<std::byte>(
      mix(seed * 131 + static_cast<std::uint64_t>(tensor) * 1000003 + k * 7 + 1) & 0xff);
}

// Calls fn(index) for every index of `size`, row-major (once, with no dims, for a 0-d box).
template <typename Fn>
void for_each_index(const Shape& size, Fn&& fn) {
  for (const std::int64_t s : size) {
    if (s == 0) {
      return;
    }
  }
  Shape at(size.size(), 0);
  while (true) {
    fn(at);
    std::size_t d = size.size();
    while (d-- > 0) {
      if (++at[d] < size[d]) {
        break;
      }
      at[d] = 0;
    }
    if (d == static_cast<std::size_t>(-1)) {
      return;
    }
  }
}

Box random_sub_box(const Shape& shape, Rng& rng) {
  Box b{Shape(shape.size()), Shape(shape.size())};
  for (std::size_t d = 0; d < shape.size(); ++d) {
    const std::int64_t lo = rng.uniform(0, shape[d]);
    b.offset[d] = lo;
    b.size[d] = rng.uniform(lo, shape[d]) - lo;
  }
  return b;
}

// The cells of uneven cuts along up to two dims (some cells empty).
std::vector<Box> grid_boxes(const Shape& shape, Rng& rng) {
  const std::size_t ndim = shape.size();
  std::vector<Shape> cuts(ndim);
  for (std::size_t d = 0; d < ndim; ++d) {
    cuts[d] = {0, shape[d]};
  }
  const std::int64_t splits =
      ndim == 0 ? 0 : rng.uniform(1, std::min<std::int64_t>(2, static_cast<std::int64_t>(ndim)));
  for (std::int64_t s = 0; s < splits; ++s) {
    const auto d = static_cast<std::size_t>(rng.uniform(0, static_cast<std::int64_t>(ndim) - 1));
    const std::int64_t parts = rng.uniform(1, 4);
    for (std::int64_t p = 1; p < parts; ++p) {
      cuts[d].push_back(rng.uniform(0, shape[d]));
    }
    std::sort(cuts[d].begin(), cuts[d].end());  // duplicates: empty cells
  }
  std::vector<Box> boxes;
  Shape count(ndim);
  for (std::size_t d = 0; d < ndim; ++d) {
    count[d] = static_cast<std::int64_t>(cuts[d].size()) - 1;
  }
  for_each_index(count, [&](const Shape& at) {
    Box b{Shape(ndim), Shape(ndim)};
    for (std::size_t d = 0; d < ndim; ++d) {
      const auto k = static_cast<std::size_t>(at[d]);
      b.offset[d] = cuts[d][k];
      b.size[d] = cuts[d][k + 1] - cuts[d][k];
    }
    boxes.push_back(b);
  });
  if (ndim == 0) {
    boxes.push_back(Box{});
  }
  return boxes;
}

// Each box to `replicas` distinct ranks of `set`, starting at a random one.
void place(const std::vector<Box>& boxes, const std::vector<int>& set, int max_replicas, Rng& rng,
           std::vector<RankBox>& out) {
  for (const Box& b : boxes) {
    const auto n = static_cast<std::int64_t>(set.size());
    const std::int64_t replicas =
        std::min<std::int64_t>(rng.chance(35) ? rng.uniform(2, max_replicas) : 1, n);
    const std::int64_t start = rng.uniform(0, n - 1);
    for (std::int64_t r = 0; r < replicas; ++r) {
      out.push_back({set[static_cast<std::size_t>((start + r) % n)], b});
    }
  }
}

std::vector<int> random_set(int world, Rng& rng) {
  std::vector<int> set;
  for (int r = 0; r < world; ++r) {
    if (rng.chance(60)) {
      set.push_back(r);
    }
  }
  if (set.empty()) {
    set.push_back(static_cast<int>(rng.uniform(0, world - 1)));
  }
  return set;
}

DType random_dtype(Rng& rng) {
  constexpr DType kAll[] = {DType::kUInt8, DType::kBool,    DType::kInt16, DType::kBFloat16,
                            DType::kInt32, DType::kFloat32, DType::kInt64, DType::kFloat64,
                            DType::kInt8,  DType::kFloat16};
  return kAll[rng.next() % std::size(kAll)];
}

Shape contiguous_strides(const Shape& shape) {
  Shape s(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) {
    s[d - 1] = s[d] * shape[d];
  }
  return s;
}

std::int64_t flat_index(const Shape& shape, const Shape& index) {
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    flat = flat * shape[d] + index[d];
  }
  return flat;
}

// A view of `kind` for a box of `size`, over new storage filled with the canary.
TensorView make_view(DType dtype, const Shape& size, ViewKind kind, Rng& rng,
                     std::vector<std::byte>& storage) {
  const auto elem = static_cast<std::int64_t>(dtype_size(dtype));
  const std::size_t ndim = size.size();
  if (kind == ViewKind::kTransposed && ndim < 2) {
    kind = ViewKind::kEmbedded;
  }
  Shape outer = size;
  Shape inset(ndim, 0);
  if (kind == ViewKind::kEmbedded) {
    for (std::size_t d = 0; d < ndim; ++d) {
      const std::int64_t pad = rng.uniform(0, 2);
      outer[d] += pad;
      inset[d] = rng.uniform(0, pad);
    }
  }
  if (kind == ViewKind::kTransposed) {
    std::swap(outer[ndim - 1], outer[ndim - 2]);
  }
  Shape strides = contiguous_strides(outer);
  if (kind == ViewKind::kTransposed) {
    std::swap(strides[ndim - 1], strides[ndim - 2]);
  }
  const std::int64_t elements =
      std::accumulate(outer.begin(), outer.end(), std::int64_t{1}, std::multiplies<>());
  storage.assign(static_cast<std::size_t>(elements * elem), kCanary);
  std::int64_t at = 0;
  for (std::size_t d = 0; d < ndim && elements != 0; ++d) {
    at += inset[d] * strides[d];
  }
  return TensorView{.data = elements == 0 ? storage.data() : storage.data() + at * elem,
                    .dtype = dtype,
                    .shape = size,
                    .strides = kind == ViewKind::kContiguous ? Shape{} : strides,
                    .device = kCpu};
}

// Writes the reference bytes of `box` of tensor `tensor` through `view`.
void write_reference(const TensorView& view, const TensorRegions& t, std::size_t tensor,
                     const Box& box, std::uint64_t seed) {
  const auto elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  const Shape strides = view.strides.empty() ? contiguous_strides(view.shape) : view.strides;
  Shape global(box.offset.size());
  for_each_index(box.size, [&](const Shape& at) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < at.size(); ++d) {
      global[d] = box.offset[d] + at[d];
      offset += at[d] * strides[d];
    }
    const auto flat = static_cast<std::uint64_t>(flat_index(t.shape, global));
    auto* out = static_cast<std::byte*>(view.data) + offset * elem;
    for (std::int64_t b = 0; b < elem; ++b) {
      out[b] = pattern(seed, tensor,
                       flat * static_cast<std::uint64_t>(elem) + static_cast<std::uint64_t>(b));
    }
  });
}

std::string box_text(const Box& b) {
  std::string s = "[";
  for (std::size_t d = 0; d < b.offset.size(); ++d) {
    s += (d == 0 ? "" : ",") + std::to_string(b.offset[d]) + "+" + std::to_string(b.size[d]);
  }
  return s + "]";
}

}  // namespace

std::vector<TensorRegions> random_reshard_layout(std::uint64_t seed, int world) {
  Rng rng{mix(seed + 0x5eed)};
  const std::vector<int> src_set = random_set(world, rng);
  std::vector<int> dst_set;
  switch (rng.next() % 3) {
    case 0:
      dst_set = src_set;  // the same ranks: a re-layout inside one group
      break;
    case 1:
      for (int r = 0; r < world; ++r) {  // disjoint where the world leaves room
        if (std::find(src_set.begin(), src_set.end(), r) == src_set.end()) {
          dst_set.push_back(r);
        }
      }
      break;
    default:
      dst_set = random_set(world, rng);
  }
  if (dst_set.empty()) {
    dst_set = src_set;
  }
  std::vector<TensorRegions> tensors(static_cast<std::size_t>(rng.uniform(1, 6)));
  for (TensorRegions& t : tensors) {
    t.dtype = random_dtype(rng);
    const std::int64_t ndim = rng.chance(5) ? 0 : rng.uniform(1, 5);
    for (std::int64_t d = 0; d < ndim; ++d) {
      t.shape.push_back(rng.chance(5) ? 0 : rng.uniform(1, ndim > 3 ? 4 : 7));
    }
    place(grid_boxes(t.shape, rng), src_set, 3, rng, t.sources);
    if (rng.chance(30)) {  // replicas that do not line up with the grid
      for (int extra = 0; extra < 2; ++extra) {
        t.sources.push_back({src_set[rng.next() % src_set.size()], random_sub_box(t.shape, rng)});
      }
    }
    if (rng.chance(70)) {
      place(grid_boxes(t.shape, rng), dst_set, 2, rng, t.destinations);
    } else {
      for (const int r : dst_set) {
        const std::int64_t boxes = rng.uniform(0, 2);
        for (std::int64_t b = 0; b < boxes; ++b) {
          t.destinations.push_back({r, random_sub_box(t.shape, rng)});
        }
      }
    }
  }
  return tensors;
}

ReshardViews make_reshard_views(const ReshardPlan& plan, std::uint64_t seed, int variant) {
  Rng rng{mix(seed * 31 + static_cast<std::uint64_t>(variant) * 977 +
              static_cast<std::uint64_t>(plan.rank()))};
  const auto kind = [&] {
    return variant == 0 ? ViewKind::kContiguous : static_cast<ViewKind>(rng.next() % 3);
  };
  ReshardViews views;
  views.storage.resize(plan.source_count() + plan.destination_count());
  for (std::size_t v = 0; v < plan.source_count(); ++v) {
    const std::size_t i = plan.regions().source_views[v].tensor;
    const TensorRegions& t = plan.tensor(i);
    const Box& box = plan.source(v).box;
    views.sources.push_back(make_view(t.dtype, box.size, kind(), rng, views.storage[v]));
    write_reference(views.sources.back(), t, i, box, seed);
  }
  for (std::size_t v = 0; v < plan.destination_count(); ++v) {
    const std::size_t i = plan.regions().destination_views[v].tensor;
    const Box& box = plan.destination(v).box;
    views.destinations.push_back(make_view(plan.tensor(i).dtype, box.size, kind(), rng,
                                           views.storage[plan.source_count() + v]));
  }
  return views;
}

std::string check_reshard(const ReshardPlan& plan, const ReshardViews& views, std::uint64_t seed) {
  for (std::size_t v = 0; v < plan.destination_count(); ++v) {
    const std::size_t i = plan.regions().destination_views[v].tensor;
    const std::vector<std::byte>& got = views.storage[plan.source_count() + v];
    std::vector<std::byte> want(got.size(), kCanary);
    TensorView expected = views.destinations[v];
    expected.data = want.data() + (static_cast<const std::byte*>(views.destinations[v].data) -
                                   views.storage[plan.source_count() + v].data());
    write_reference(expected, plan.tensor(i), i, plan.destination(v).box, seed);
    for (std::size_t b = 0; b < got.size(); ++b) {
      if (got[b] != want[b]) {
        return "rank " + std::to_string(plan.rank()) + " destination " + std::to_string(v) +
               " (tensor " + std::to_string(i) + ", box " + box_text(plan.destination(v).box) +
               "): storage byte " + std::to_string(b) + " of " + std::to_string(got.size()) +
               " is " + std::to_string(static_cast<int>(got[b])) + ", want " +
               std::to_string(static_cast<int>(want[b]));
      }
    }
  }
  return "";
}

std::string describe_layout(const std::vector<TensorRegions>& tensors) {
  std::string s;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorRegions& t = tensors[i];
    s += "tensor " + std::to_string(i) + " " + std::string(dtype_name(t.dtype)) + " " +
         box_text(Box{Shape(t.shape.size(), 0), t.shape}) + " src";
    for (const RankBox& rb : t.sources) {
      s += " r" + std::to_string(rb.rank) + box_text(rb.box);
    }
    s += " dst";
    for (const RankBox& rb : t.destinations) {
      s += " r" + std::to_string(rb.rank) + box_text(rb.box);
    }
    s += "\n";
  }
  return s;
}

int case_reshard_fuzz(Communicator& comm, int iterations, std::uint64_t seed) {
  int forwarding = 0;
  for (int iter = 0; iter < iterations; ++iter) {
    const std::uint64_t s = seed + static_cast<std::uint64_t>(iter);
    const std::vector<TensorRegions> layout = random_reshard_layout(s, comm.size());
    ReshardPlan plan = ReshardPlan::for_communicator(layout, comm);
    ReshardViews views = make_reshard_views(plan, s, iter % 3);
    const std::uint64_t before = comm.exchange_bytes_received();
    plan.execute(views.sources, comm, views.destinations);
    const std::string problem = check_reshard(plan, views, s);
    EXPECT_EQ(problem, "") << "seed " << s << "\n" << describe_layout(layout);
    // The transport moved what the plan says reaches this rank from others, in both exchanges.
    const RegionPlan& r = plan.regions();
    const auto me = static_cast<std::size_t>(comm.rank());
    const std::uint64_t from_self = r.recv_counts[me] + (r.forwarding ? r.forwarded_counts[me] : 0);
    EXPECT_EQ(comm.exchange_bytes_received() - before, r.rank_received[me] - from_self)
        << "seed " << s << " rank " << comm.rank();
    forwarding += r.forwarding ? 1 : 0;
    if (::testing::Test::HasFailure()) {
      return forwarding;
    }
  }
  return forwarding;
}

void case_reshard_mismatch(Communicator& comm) {
  const int world = comm.size();
  TensorRegions t{.dtype = DType::kFloat32, .shape = {6, 4}, .sources = {}, .destinations = {}};
  for (int r = 0; r < world; ++r) {
    t.sources.push_back({r, Box{{0, 0}, {6, 4}}});
    t.destinations.push_back({r, Box{{0, r % 4}, {6, 1}}});
  }
  if (comm.rank() == world - 1) {
    t.destinations.back().box.offset[1] = (world + 1) % 4;
  }
  ReshardPlan plan(std::span(&t, 1), world, comm.rank());
  ReshardViews views = make_reshard_views(plan, 3, 0);
  const auto [code, message] =
      outcome([&] { plan.execute(views.sources, comm, views.destinations); });
  if (world == 1) {
    EXPECT_EQ(code, "Ok") << message;
    return;
  }
  EXPECT_EQ(code, "Mismatch") << message;
  for (const std::byte b : views.storage.back()) {
    ASSERT_EQ(b, kCanary) << "a destination was written before the plans were compared";
  }
}

}  // namespace shardgather::testing
