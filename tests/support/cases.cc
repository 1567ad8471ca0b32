#include "support/cases.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/testing.h"

namespace shardgather::testing {

namespace {

constexpr std::uint64_t kSeed = 20261130;

// FSDP2's odd parameter shapes, plus a 0-size and a 1-element one.
const std::vector<Shape>& fsdp_full_shapes() {
  static const std::vector<Shape> shapes = {{17, 257}, {17},  {64, 312}, {64}, {64, 64},
                                            {512, 64}, {256}, {64, 297}, {0},  {1}};
  return shapes;
}

// torch.chunk along dim 0: ceil(D / W) rows per rank, the last ranks smaller or empty.
Shape chunk_dim0(Shape full, int rank, int world) {
  if (full.empty()) {
    return full;
  }
  const std::int64_t rows = full[0];
  const std::int64_t chunk = (rows + world - 1) / world;
  full[0] = std::clamp<std::int64_t>(rows - chunk * rank, 0, chunk);
  return full;
}

struct Inputs {
  std::vector<DType> dtypes;
  std::vector<std::vector<Shape>> shapes;  // [r][i]
  std::vector<HostTensor> tensors;         // this rank's
  std::vector<TensorView> views;
};

Inputs make_inputs(const std::vector<DType>& dtypes, std::vector<std::vector<Shape>> shapes,
                   int rank, Layout layout = Layout::kContiguous) {
  Inputs in{dtypes, std::move(shapes), {}, {}};
  const auto& mine = in.shapes[static_cast<std::size_t>(rank)];
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    in.tensors.push_back(make_tensor(dtypes[i], mine[i], kSeed, rank, i, layout));
  }
  in.views = views_of(in.tensors);
  return in;
}

// The collectives a call must issue: header (unless world 1, or hint without pre-flight),
// and one payload collective when any byte moves.
void expect_counts(const Communicator& comm, std::uint64_t before, const GatherResult& out,
                   bool with_hint, bool preflight, bool moves_bytes) {
  const bool header = comm.size() > 1 && (preflight || !with_hint);
  const bool payload = comm.size() > 1 && moves_bytes;
  EXPECT_EQ(out.stats().metadata_collectives, header && !with_hint ? 1U : 0U);
  EXPECT_EQ(out.stats().preflight_collectives, header && with_hint ? 1U : 0U);
  EXPECT_EQ(out.stats().payload_collectives, payload ? 1U : 0U);
  EXPECT_EQ(comm.collectives_issued() - before, (header ? 1U : 0U) + (payload ? 1U : 0U));
}

template <typename Error>
void expect_raises(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception";
  } catch (const Error& e) {
    for (const std::string& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception class: " << e.what();
  }
}

}  // namespace

void case_fsdp_shapes(Communicator& comm, bool with_hint, bool preflight) {
  const int world = comm.size();
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (const Shape& full : fsdp_full_shapes()) {
      shapes[static_cast<std::size_t>(r)].push_back(chunk_dim0(full, r, world));
    }
  }
  const std::vector<DType> dtypes(fsdp_full_shapes().size(), DType::kFloat32);
  const Inputs in = make_inputs(dtypes, shapes, comm.rank());
  const std::uint64_t before = comm.collectives_issued();
  const GatherResult out =
      foreach_all_gather(in.views, comm,
                         with_hint ? std::span<const std::vector<Shape>>(shapes)
                                   : std::span<const std::vector<Shape>>(),
                         ForeachAllGatherOptions{.timeout = {}, .preflight = preflight});
  EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "");
  expect_counts(comm, before, out, with_hint, preflight, true);
  EXPECT_EQ(out.stats().staged_bytes, 0U);
}

void case_edge_shapes(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    shapes[static_cast<std::size_t>(r)] = {
        {},                    // 0-d
        {r % 2 == 0 ? 0 : 3},  // an empty shard on even ranks
        {5, 0},                // (n, 0)
        {0, 7},                // empty with a non-zero trailing dim
        {1},                   // one element
        {r + 1, 3},            // uneven
        {},                    // 0-d again, another dtype
    };
  }
  const std::vector<DType> dtypes = {DType::kFloat64,  DType::kInt32, DType::kFloat16,
                                     DType::kBFloat16, DType::kUInt8, DType::kFloat32,
                                     DType::kInt8};
  for (const bool with_hint : {false, true}) {
    const Inputs in = make_inputs(dtypes, shapes, rank);
    const GatherResult out =
        foreach_all_gather(in.views, comm,
                           with_hint ? std::span<const std::vector<Shape>>(shapes)
                                     : std::span<const std::vector<Shape>>());
    EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "") << "hint " << with_hint;
  }
  // Every tensor empty on every rank: nothing to move, but a valid result of the right shapes.
  std::vector<std::vector<Shape>> empty_shapes(static_cast<std::size_t>(world),
                                               std::vector<Shape>{{0}, {4, 0}, {0, 0, 2}});
  const std::vector<DType> empty_dtypes(3, DType::kFloat32);
  const Inputs in = make_inputs(empty_dtypes, empty_shapes, rank);
  const std::uint64_t before = comm.collectives_issued();
  const GatherResult out = foreach_all_gather(in.views, comm, empty_shapes);
  EXPECT_EQ(verify_gather(out, empty_shapes, empty_dtypes, kSeed), "");
  expect_counts(comm, before, out, true, true, false);
}

void case_empty_list(Communicator& comm) {
  const std::uint64_t before = comm.collectives_issued();
  const GatherResult out = foreach_all_gather({}, comm);
  EXPECT_TRUE(out.empty());
  expect_counts(comm, before, out, false, true, false);
}

void case_single_tensor_uneven(Communicator& comm, bool with_hint) {
  const int world = comm.size();
  constexpr std::int64_t kRows[] = {2, 3, 1, 2};
  std::vector<std::vector<Shape>> shapes;
  for (int r = 0; r < world; ++r) {
    shapes.push_back({{kRows[r % 4], 5}});
  }
  const std::vector<DType> dtypes = {DType::kBFloat16};
  const Inputs in = make_inputs(dtypes, shapes, comm.rank());
  const std::uint64_t before = comm.collectives_issued();
  const GatherResult out =
      foreach_all_gather(in.views, comm,
                         with_hint ? std::span<const std::vector<Shape>>(shapes)
                                   : std::span<const std::vector<Shape>>());
  EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "");
  expect_counts(comm, before, out, with_hint, true, true);
  EXPECT_EQ(out.stats().staged_bytes, 0U) << "a single contiguous tensor is sent in place";
  if (with_hint && world > 1) {
    // With the hint the blocks are back to back: the gathered buffer is the full dim-0 tensor.
    for (int r = 1; r < world; ++r) {
      EXPECT_EQ(static_cast<const std::byte*>(out[0][static_cast<std::size_t>(r)].data),
                static_cast<const std::byte*>(out[0][static_cast<std::size_t>(r) - 1].data) +
                    kRows[(r - 1) % 4] * 5 * 2);
    }
  }
}

void case_mixed_dtypes(Communicator& comm) {
  const int world = comm.size();
  const std::vector<DType> dtypes = {DType::kInt8,  DType::kFloat64,  DType::kBool,
                                     DType::kInt16, DType::kFloat32,  DType::kUInt8,
                                     DType::kInt64, DType::kBFloat16, DType::kFloat16};
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (std::size_t i = 0; i < dtypes.size(); ++i) {
      shapes[static_cast<std::size_t>(r)].push_back(
          {static_cast<std::int64_t>(3 + (i * 7 + static_cast<std::size_t>(r)) % 5)});
    }
  }
  const Inputs in = make_inputs(dtypes, shapes, comm.rank());
  const GatherResult out = foreach_all_gather(in.views, comm);
  // verify_gather also checks every view is aligned to its element size.
  EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "");
}

void case_non_contiguous(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    shapes[static_cast<std::size_t>(r)] = {{4 + r, 3}, {9 + r}, {2, 3 + r, 2}, {6, 1}};
  }
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat64, DType::kInt16,
                                     DType::kFloat32};
  const auto& mine = shapes[static_cast<std::size_t>(rank)];
  std::vector<HostTensor> tensors;
  tensors.push_back(make_tensor(dtypes[0], mine[0], kSeed, rank, 0, Layout::kTransposed));
  tensors.push_back(make_tensor(dtypes[1], mine[1], kSeed, rank, 1, Layout::kEveryOther));
  tensors.push_back(make_tensor(dtypes[2], mine[2], kSeed, rank, 2, Layout::kEveryOther));
  // One column of a wider matrix, as in PyTorch's gloo test.
  tensors.push_back(make_tensor(dtypes[3], mine[3], kSeed, rank, 3, Layout::kEveryOther));
  const std::vector<TensorView> views = views_of(tensors);
  const GatherResult out = foreach_all_gather(views, comm);
  EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "");
  EXPECT_GT(out.stats().staged_bytes, 0U);
}

void case_wrong_hint(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world),
                                         std::vector<Shape>{{4, 8}, {3}});
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  std::vector<std::vector<Shape>> actual = shapes;
  if (world > 1) {
    actual[1][0] = {8, 4};  // same bytes, different shape: the silent case without a check
  }
  const Inputs in = make_inputs(dtypes, actual, rank);
  if (world == 1) {
    EXPECT_NO_THROW(foreach_all_gather(in.views, comm, shapes));
    return;
  }
  expect_raises<InvalidArgument>([&] { foreach_all_gather(in.views, comm, shapes); },
                                 {"rank 1", "tensor 0", "[4, 8]", "[8, 4]"});
  // The communicator stays usable: a valid call right after is bit-exact.
  const Inputs good = make_inputs(dtypes, shapes, rank);
  const GatherResult out = foreach_all_gather(good.views, comm, shapes);
  EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "");
}

void case_count_mismatch(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  if (world == 1) {
    return;
  }
  const std::vector<DType> dtypes(3, DType::kFloat32);
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world),
                                         std::vector<Shape>{{5}, {6}, {7}});
  Inputs in = make_inputs(dtypes, shapes, rank);
  if (rank == 1) {
    in.views.pop_back();
  }
  expect_raises<Mismatch>([&] { foreach_all_gather(in.views, comm); },
                          {"tensor count", "rank 0 has 3", "rank 1 has 2", "op seq"});
  // An empty list on one rank is the same class of error.
  if (rank == 1) {
    in.views.clear();
  } else {
    in.views = views_of(in.tensors);
  }
  expect_raises<Mismatch>([&] { foreach_all_gather(in.views, comm); }, {"rank 1 has 0"});
  in.views = views_of(in.tensors);
  const GatherResult out = foreach_all_gather(in.views, comm);
  EXPECT_EQ(verify_gather(out, shapes, dtypes, kSeed), "");
}

void case_dtype_mismatch(Communicator& comm) {
  const int world = comm.size();
  const int rank = comm.rank();
  if (world == 1) {
    return;
  }
  std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32, DType::kFloat32};
  const std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world),
                                               std::vector<Shape>{{5}, {6}, {7}});
  if (rank == 1) {
    dtypes[2] = DType::kInt32;  // same bytes: MPI alone would reinterpret silently
  }
  const Inputs in = make_inputs(dtypes, shapes, rank);
  expect_raises<Mismatch>([&] { foreach_all_gather(in.views, comm); },
                          {"dtype of tensor 2", "f32", "i32"});
  expect_raises<Mismatch>([&] { foreach_all_gather(in.views, comm, shapes); },
                          {"dtype of tensor 2"});
}

void case_random_vs_reference(Communicator& comm, std::uint64_t seed, int iterations) {
  const int world = comm.size();
  const int rank = comm.rank();
  for (int iter = 0; iter < iterations; ++iter) {
    const RandomList list = random_list(seed, iter, world, 24);
    const auto& mine = list.shapes[static_cast<std::size_t>(rank)];
    std::vector<HostTensor> tensors;
    for (std::size_t i = 0; i < list.dtypes.size(); ++i) {
      const Layout layout =
          (mix(seed + i) % 5 == 0 && !mine[i].empty()) ? Layout::kEveryOther : Layout::kContiguous;
      tensors.push_back(make_tensor(list.dtypes[i], mine[i],
                                    seed + static_cast<std::uint64_t>(iter), rank, i, layout));
    }
    const std::vector<TensorView> views = views_of(tensors);
    const bool with_hint = iter % 2 == 1;
    const GatherResult out =
        foreach_all_gather(views, comm,
                           with_hint ? std::span<const std::vector<Shape>>(list.shapes)
                                     : std::span<const std::vector<Shape>>());
    const auto reference = reference_gather(views, comm);
    ASSERT_EQ(out.size(), reference.size()) << "seed " << seed << " iter " << iter;
    for (std::size_t i = 0; i < reference.size(); ++i) {
      for (std::size_t r = 0; r < reference[i].size(); ++r) {
        const TensorView& v = out[i][r];
        ASSERT_EQ(v.shape, list.shapes[r][i]) << "seed " << seed << " iter " << iter;
        ASSERT_EQ(checked_nbytes(v.dtype, v.shape), reference[i][r].size());
        ASSERT_TRUE(reference[i][r].empty() ||
                    std::memcmp(v.data, reference[i][r].data(), reference[i][r].size()) == 0)
            << "out[" << i << "][" << r << "] differs from the per-tensor reference; seed " << seed
            << " iter " << iter;
      }
    }
  }
}

}  // namespace shardgather::testing
