#include "rel_cases.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "ops/call.h"
#include "ops/preflight.h"
#include "support/testing.h"
#include <dirent.h>

#include "shardgather/errors.h"

namespace shardgather::reliability {

namespace {

using testing::fill_pattern;
using Rows = std::vector<std::vector<Shape>>;  // [rank][tensor]

constexpr std::uint64_t kSeed = 0x5e1ab1e;
constexpr std::uint64_t kFollowupSeed = 0xf0110;
constexpr std::byte kSentinel{0xEE};
constexpr std::size_t kGuard = 64;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Rows same_rows(int world, const std::vector<Shape>& row) {
  return Rows(static_cast<std::size_t>(world), row);
}

// One rank's inputs, each in its own allocation with sentinel guards before and after.
struct Inputs {
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorView> views;

  // Contiguous tensor i holding the pattern of (seed, rank, i), or a strided one.
  void add(DType dtype, const Shape& shape, int rank, testing::Layout layout = {},
           std::uint64_t seed = kSeed) {
    const testing::HostTensor t =
        testing::make_tensor(dtype, shape, seed, rank, views.size(), layout);
    add_raw(t.storage, t.view, static_cast<const std::byte*>(t.view.data) - t.storage.data());
  }
  // A view over `bytes` at `offset` bytes into a copy of them.
  void add_raw(std::span<const std::byte> bytes, TensorView view, std::ptrdiff_t offset) {
    std::vector<std::byte> s(bytes.size() + 2 * kGuard, kSentinel);
    std::copy(bytes.begin(), bytes.end(), s.begin() + kGuard);
    storage.push_back(std::move(s));
    view.data = storage.back().data() + kGuard + offset;
    views.push_back(std::move(view));
  }
  [[nodiscard]] std::uint64_t sum() const {
    std::uint64_t h = 0;
    for (const auto& s : storage) {
      h = h * 31 + checksum(std::span(s).subspan(kGuard, s.size() - 2 * kGuard));
    }
    return h;
  }
  [[nodiscard]] bool guards_ok() const {
    return std::all_of(storage.begin(), storage.end(), [](const auto& s) {
      const auto is_sentinel = [](std::byte b) { return b == kSentinel; };
      return std::all_of(s.begin(), s.begin() + kGuard, is_sentinel) &&
             std::all_of(s.end() - kGuard, s.end(), is_sentinel);
    });
  }
};

// What a successful call must return: out[i][r] has shape truth[r][i] and the bytes
// content(r, i) writes.
struct Expected {
  Rows truth;
  std::vector<DType> dtypes;
  // Unset: the pattern of (kSeed, r, i).
  std::function<void(int, std::size_t, std::span<std::byte>)> content;
};

std::uint64_t mismatch_bytes(const GatherResult& out, const Expected& e) {
  std::uint64_t bad = 0;
  if (out.size() != e.dtypes.size()) {
    return std::max<std::uint64_t>(1, out.buffer().size());
  }
  std::vector<std::byte> want;
  for (std::size_t i = 0; i < e.dtypes.size(); ++i) {
    for (std::size_t r = 0; r < e.truth.size(); ++r) {
      const TensorView& v = out[i][r];
      const std::uint64_t true_bytes = checked_nbytes(e.dtypes[i], e.truth[r][i]);
      const std::uint64_t got_bytes = checked_nbytes(v.dtype, v.shape);
      if (v.shape != e.truth[r][i] || v.dtype != e.dtypes[i]) {
        bad += std::max<std::uint64_t>({true_bytes, got_bytes, 1});
        continue;
      }
      want.resize(true_bytes);
      if (e.content) {
        e.content(static_cast<int>(r), i, want);
      } else {
        fill_pattern(want, kSeed, static_cast<int>(r), i);
      }
      const auto* got = static_cast<const std::byte*>(v.data);
      for (std::size_t k = 0; k < want.size(); ++k) {
        bad += got[k] != want[k] ? 1U : 0U;
      }
    }
  }
  return bad;
}

// A valid call (FSDP-like odd shapes with a hint), checked bit-exact: the "make-up" call.
bool valid_call(Communicator& comm, std::chrono::milliseconds timeout,
                std::optional<GatherResult>* keep = nullptr) {
  const int world = comm.size();
  Rows rows(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    rows[static_cast<std::size_t>(r)] = {{17, 3 + r}, {r % 2 == 0 ? 0 : 5}, {64}, {}};
  }
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16, DType::kUInt8,
                                     DType::kFloat64};
  Inputs in;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    in.add(dtypes[i], rows[static_cast<std::size_t>(comm.rank())][i], comm.rank(), {},
           kFollowupSeed);
  }
  GatherResult out = foreach_all_gather(
      in.views, comm, rows, ForeachAllGatherOptions{.timeout = timeout, .preflight = true});
  Expected e{rows, dtypes, [](int r, std::size_t i, std::span<std::byte> b) {
               fill_pattern(b, kFollowupSeed, r, i);
             }};
  const bool ok = mismatch_bytes(out, e) == 0;
  if (keep != nullptr) {
    keep->emplace(std::move(out));
  }
  return ok;
}

using Call = std::function<GatherResult()>;

// The common skeleton: a valid call whose output is kept, the case's call, the checks, and a
// follow-up call. `expect` is the class this rank must end with.
Outcome attempt(const char* id, Communicator& comm, const CaseContext& ctx, std::string expect,
                const std::vector<std::string>& needles, const Inputs& in, const Call& call,
                const std::optional<Expected>& expected,
                const std::string& followup_expect = "Ok") {
  Outcome o;
  o.case_id = id;
  o.backend = ctx.backend;
  o.rank = comm.rank();
  o.world = comm.size();
  o.naked = !ctx.preflight;
  o.expect = o.naked ? "any" : std::move(expect);
  std::optional<GatherResult> prior;
  if (!valid_call(comm, ctx.timeout, &prior)) {
    o.note = "the valid call before the case was not bit-exact; ";
    o.sentinel_ok = false;
  }
  const std::uint64_t prior_sum =
      checksum(std::span<const std::byte>(prior->buffer().data(), prior->buffer().size()));
  const std::uint64_t in_sum = in.sum();
  const Clock::time_point t0 = Clock::now();
  try {
    const GatherResult out = call();
    o.t_err_s = seconds_since(t0);
    o.outcome = "ok";
    o.err_class = "Ok";
    if (expected) {
      o.out_mismatch_bytes = mismatch_bytes(out, *expected);
    }
  } catch (const Error& e) {
    o.t_err_s = seconds_since(t0);
    o.outcome = "error";
    o.err_class = std::string(error_code_name(e.code()));
    o.err_msg = e.what();
  } catch (const std::exception& e) {
    o.t_err_s = seconds_since(t0);
    o.outcome = "error";
    o.err_class = "std::exception";
    o.err_msg = e.what();
  }
  o.in_changed = in.sum() != in_sum;
  o.sentinel_ok = o.sentinel_ok && in.guards_ok() &&
                  checksum(std::span<const std::byte>(prior->buffer().data(),
                                                      prior->buffer().size())) == prior_sum;
  if (o.outcome == "error") {
    for (const std::string& needle : needles) {
      if (o.err_msg.find(needle) == std::string::npos) {
        o.msg_ok = false;
        o.note += "message lacks \"" + needle + "\"; ";
      }
    }
  }
  if (o.naked) {
    // Not gated, and after an undetected mismatch the ranks may no longer agree on which
    // call comes next: a follow-up would only wait out its deadline.
    return o;
  }
  if (comm.is_poisoned()) {
    const Clock::time_point t1 = Clock::now();
    try {
      valid_call(comm, ctx.timeout);
      o.followup_ok = false;
      o.note += "a call on a poisoned communicator succeeded; ";
    } catch (const CommAborted&) {
      o.followup_ok = seconds_since(t1) < 0.010;
      o.note += "poisoned; ";
    } catch (const std::exception& e) {
      o.followup_ok = false;
      o.note += std::string("poisoned, follow-up raised ") + e.what() + "; ";
    }
  } else {
    std::string got = "Ok";
    try {
      if (!valid_call(comm, ctx.timeout)) {
        got = "NotBitExact";
      }
    } catch (const Error& e) {
      got = std::string(error_code_name(e.code()));
      o.note += std::string("follow-up raised ") + e.what() + "; ";
    } catch (const std::exception& e) {
      got = "std::exception";
      o.note += std::string("follow-up raised ") + e.what() + "; ";
    }
    o.followup_ok = got == followup_expect;
  }
  return o;
}

ForeachAllGatherOptions opts(const CaseContext& ctx) {
  return ForeachAllGatherOptions{.timeout = ctx.timeout, .preflight = ctx.preflight};
}

// A standard case: every rank passes `mine` (built from rows[rank]) with or without a hint.
Outcome simple(const char* id, Communicator& comm, const CaseContext& ctx, std::string expect,
               const std::vector<std::string>& needles, const Inputs& in,
               const std::optional<Rows>& hint, const std::optional<Expected>& expected) {
  const ForeachAllGatherOptions o = opts(ctx);
  return attempt(
      id, comm, ctx, std::move(expect), needles, in,
      [&]() {
        return hint ? foreach_all_gather(in.views, comm, *hint, o)
                    : foreach_all_gather(in.views, comm, {}, o);
      },
      expected);
}

Inputs inputs_for(const Rows& rows, const std::vector<DType>& dtypes, int rank) {
  Inputs in;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    in.add(dtypes[i], rows[static_cast<std::size_t>(rank)][i], rank);
  }
  return in;
}

// ---- B: bad inputs -------------------------------------------------------------------------

Outcome b1_empty_all(Communicator& comm, const CaseContext& ctx) {
  const Inputs in;
  return simple("B1", comm, ctx, "Ok", {}, in, std::nullopt,
                Expected{same_rows(comm.size(), {}), {}, {}});
}

Outcome b2_empty_on_one(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(3, DType::kFloat32);
  const Rows rows = same_rows(comm.size(), {{5}, {6}, {7}});
  const Inputs in = comm.rank() == 1 ? Inputs{} : inputs_for(rows, dtypes, comm.rank());
  return simple("B2", comm, ctx, "Mismatch", {"tensor count", "rank 1 has 0", "op seq"}, in,
                std::nullopt, std::nullopt);
}

Outcome b3_zero_size(Communicator& comm, const CaseContext& ctx, bool all_empty) {
  const int world = comm.size();
  Rows rows(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    rows[static_cast<std::size_t>(r)] =
        all_empty ? std::vector<Shape>{{0}, {3, 0}, {0, 0, 9}}
                  : std::vector<Shape>{{0}, {r + 2, 3}, {0, 5}, {1}, {r % 2 == 0 ? 0 : 4}};
  }
  const std::vector<DType> dtypes(rows[0].size(), DType::kFloat32);
  const Inputs in = inputs_for(rows, dtypes, comm.rank());
  // Both paths: shapes in the payload (no hint) and from the hint.
  const ForeachAllGatherOptions o = opts(ctx);
  return attempt(
      all_empty ? "B3b" : "B3a", comm, ctx, "Ok", {}, in,
      [&]() {
        GatherResult a = foreach_all_gather(in.views, comm, {}, o);
        if (mismatch_bytes(a, Expected{rows, dtypes, {}}) != 0) {
          throw std::runtime_error("the no-hint call was not bit-exact");
        }
        return foreach_all_gather(in.views, comm, rows, o);
      },
      Expected{rows, dtypes, {}});
}
Outcome b3a(Communicator& c, const CaseContext& x) { return b3_zero_size(c, x, false); }
Outcome b3b(Communicator& c, const CaseContext& x) { return b3_zero_size(c, x, true); }

Outcome b4_mixed_dtypes(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {
      DType::kInt8,  DType::kFloat64, DType::kBool,     DType::kInt16,   DType::kFloat32,
      DType::kUInt8, DType::kInt64,   DType::kBFloat16, DType::kFloat16, DType::kInt32};
  Rows rows(static_cast<std::size_t>(comm.size()));
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (std::size_t i = 0; i < dtypes.size(); ++i) {
      rows[r].push_back({static_cast<std::int64_t>(1 + (i * 7 + r) % 5)});
    }
  }
  const Inputs in = inputs_for(rows, dtypes, comm.rank());
  return simple("B4", comm, ctx, "Ok", {}, in, std::nullopt, Expected{rows, dtypes, {}});
}

Outcome b5_non_contiguous(Communicator& comm, const CaseContext& ctx) {
  Rows rows(static_cast<std::size_t>(comm.size()));
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const auto k = static_cast<std::int64_t>(r);
    rows[r] = {{4 + k, 3}, {9 + k}, {6, 1}, {2, 3 + k, 2}};
  }
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat64, DType::kFloat32,
                                     DType::kInt16};
  const auto& mine = rows[static_cast<std::size_t>(comm.rank())];
  Inputs in;
  in.add(dtypes[0], mine[0], comm.rank(), testing::Layout::kTransposed);
  in.add(dtypes[1], mine[1], comm.rank(), testing::Layout::kEveryOther);
  in.add(dtypes[2], mine[2], comm.rank(), testing::Layout::kEveryOther);  // one column
  in.add(dtypes[3], mine[3], comm.rank(), testing::Layout::kEveryOther);
  return simple("B5", comm, ctx, "Ok", {}, in, rows, Expected{rows, dtypes, {}});
}

// B6: the one-shot API sizes its own output, so the only caller input that sizes it is the
// shapes hint. Rank 1's row claims one element more than its tensor holds ("output one
// element too small" for the real data).
Outcome b6_hint_one_element_off(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32};
  const Rows rows = same_rows(comm.size(), {{7}});
  Rows hint = rows;
  if (comm.rank() == 1) {
    hint[1][0] = {8};
  }
  const Inputs in = inputs_for(rows, dtypes, comm.rank());
  return simple("B6", comm, ctx, "InvalidArgument", {"rank 1", "tensor 0", "[8]", "[7]"}, in, hint,
                std::nullopt);
}

// B7c: two inputs that are views of the same storage (read-only overlap).
Outcome b7c_overlapping_views(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const Rows rows = same_rows(comm.size(), {{10}, {6}});
  std::vector<std::byte> base(10 * 4);
  fill_pattern(base, kSeed, comm.rank(), 0);
  Inputs in;
  in.add_raw(base, TensorView{nullptr, DType::kFloat32, {10}, {}}, 0);
  in.views.push_back(
      TensorView{static_cast<std::byte*>(in.views[0].data) + 12, DType::kFloat32, {6}, {}});
  Expected e{rows, dtypes, [](int r, std::size_t i, std::span<std::byte> out) {
               std::vector<std::byte> b(40);
               fill_pattern(b, kSeed, r, 0);
               std::copy_n(b.begin() + (i == 0 ? 0 : 12), out.size(), out.begin());
             }};
  return simple("B7c", comm, ctx, "Ok", {}, in, rows, e);
}

// B8: a float32 tensor at byte offset 1 of a uint8 buffer.
Outcome b8_misaligned(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kUInt8, DType::kFloat32, DType::kFloat64};
  const Rows rows = same_rows(comm.size(), {{3}, {13}, {5}});
  Inputs in;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    std::vector<std::byte> b(checked_nbytes(dtypes[i], rows[0][i]) + 1);
    fill_pattern(std::span(b).subspan(1), kSeed, comm.rank(), i);
    in.add_raw(b, TensorView{nullptr, dtypes[i], rows[0][i], {}}, 1);
  }
  return simple("B8", comm, ctx, "Ok", {}, in, std::nullopt, Expected{rows, dtypes, {}});
}

Outcome b9a_null_data(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const Rows rows = same_rows(comm.size(), {{4}, {3, 2}});
  Inputs in = inputs_for(rows, dtypes, comm.rank());
  if (comm.rank() == 1) {
    in.views[1].data = nullptr;
  }
  return simple("B9a", comm, ctx, "InvalidArgument", {"rank 1", "tensor 1", "null data"}, in,
                std::nullopt, std::nullopt);
}

Outcome b9b_null_empty(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const Rows rows = same_rows(comm.size(), {{0}, {3}});
  Inputs in = inputs_for(rows, dtypes, comm.rank());
  in.views[0].data = nullptr;
  return simple("B9b", comm, ctx, "Ok", {}, in, rows, Expected{rows, dtypes, {}});
}

// B10: [2^32, 2^32] f32 in a descriptor over 16 real bytes: nothing may be read or allocated.
Outcome b10_shape_overflow(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const Rows rows = same_rows(comm.size(), {{4}, {4}});
  Inputs in = inputs_for(rows, dtypes, comm.rank());
  if (comm.rank() == 1) {
    in.views[1].shape = {std::int64_t{1} << 32, std::int64_t{1} << 32};
  }
  return simple("B10", comm, ctx, "CountOverflow", {"rank 1", "tensor 1", "overflows"}, in,
                std::nullopt, std::nullopt);
}

// B11: every rank's block fits 64 bits (2^63 bytes), the gathered total does not.
Outcome b11_total_overflow(Communicator& comm, const CaseContext& ctx, bool with_hint) {
  const Shape big = {std::int64_t{1} << 62};
  Inputs in;
  std::vector<std::byte> tiny(16);
  in.add_raw(tiny, TensorView{nullptr, DType::kUInt8, big, {}}, 0);
  in.add_raw(tiny, TensorView{nullptr, DType::kUInt8, big, {}}, 0);
  const Rows rows = same_rows(comm.size(), {big, big});
  return simple(with_hint ? "B11a" : "B11b", comm, ctx, "CountOverflow", {"overflows"}, in,
                with_hint ? std::optional<Rows>(rows) : std::nullopt, std::nullopt);
}
Outcome b11a(Communicator& c, const CaseContext& x) { return b11_total_overflow(c, x, true); }
Outcome b11b(Communicator& c, const CaseContext& x) { return b11_total_overflow(c, x, false); }

Outcome b12_bad_dtype(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const Rows rows = same_rows(comm.size(), {{4}, {4}});
  Inputs in = inputs_for(rows, dtypes, comm.rank());
  if (comm.rank() == 1) {
    in.views[0].dtype = static_cast<DType>(200);
  }
  return simple("B12", comm, ctx, "InvalidArgument", {"rank 1", "tensor 0", "dtype code 200"}, in,
                std::nullopt, std::nullopt);
}

// B13: world size 1: a local copy, no collective.
Outcome b13_world_one(Communicator& comm, const CaseContext& ctx) {
  std::unique_ptr<Communicator> self = ctx.make_self();
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kInt8, DType::kFloat64};
  const Rows rows = {{{3, 5}, {0}, {7}}};
  const Inputs in = inputs_for(rows, dtypes, 0);
  Outcome o = simple("B13", *self, ctx, "Ok", {}, in, std::nullopt,
                     Expected{rows, dtypes, [](int, std::size_t i, std::span<std::byte> b) {
                                fill_pattern(b, kSeed, 0, i);
                              }});
  const std::uint64_t before = self->collectives_issued();
  foreach_all_gather(in.views, *self);
  foreach_all_gather(in.views, *self, rows);
  if (self->collectives_issued() != before) {
    o.outcome = "error";
    o.err_class = "Communicated";
    o.note += "world size 1 issued collectives; ";
  }
  o.rank = comm.rank();
  o.world = comm.size();
  return o;
}

// B14: invalid construction raises at once (no hang).
Outcome b14_bad_init(Communicator& comm, const CaseContext& ctx) {
  Outcome o;
  o.case_id = "B14";
  o.backend = ctx.backend;
  o.rank = comm.rank();
  o.world = comm.size();
  o.expect = "InvalidArgument";
  const Clock::time_point t0 = Clock::now();
  const std::vector<std::string> classes = ctx.bad_inits();
  o.t_err_s = seconds_since(t0);
  o.outcome = "error";
  o.err_class = classes.empty() ? "none" : classes[0];
  for (const std::string& c : classes) {
    o.err_msg += c + " ";
    if (c != classes[0]) {
      o.err_class = "mixed";
    }
  }
  o.followup_ok = valid_call(comm, ctx.timeout);
  return o;
}

// ---- M: cross-rank mismatch ----------------------------------------------------------------

Outcome m1_count(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(3, DType::kFloat32);
  const Rows rows = same_rows(comm.size(), {{5}, {6}, {7}});
  Inputs in = inputs_for(rows, dtypes, comm.rank());
  Rows hint = rows;
  if (comm.rank() == 1) {
    in.views.pop_back();
    for (auto& row : hint) {
      row.pop_back();
    }
  }
  return simple("M1", comm, ctx, "Mismatch", {"tensor count", "rank 0 has 3", "rank 1 has 2"}, in,
                hint, std::nullopt);
}

// M2: same count and same bytes, but rank 1's tensors 0 and 1 are [3], [2] where the others
// believe [2], [3]: with the check off the split point inside rank 1's block is wrong.
Outcome m2_shapes(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(2, DType::kFloat32);
  Rows truth = same_rows(comm.size(), {{2}, {3}});
  truth[1] = {{3}, {2}};
  Rows hint = same_rows(comm.size(), {{2}, {3}});
  if (comm.rank() == 1) {
    hint = truth;
  }
  const Inputs in = inputs_for(truth, dtypes, comm.rank());
  return simple("M2", comm, ctx, "Mismatch", {"differs between rank 0 and rank 1"}, in, hint,
                Expected{truth, dtypes, {}});
}

// M3: per-rank bytes differ (rank 1 holds [5] where the others' hints say [4]).
Outcome m3_bytes(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  Rows truth = same_rows(comm.size(), {{4096}, {3}});
  truth[1][0] = {4097};
  Rows hint = same_rows(comm.size(), {{4096}, {3}});
  if (comm.rank() == 1) {
    hint = truth;
  }
  const Inputs in = inputs_for(truth, dtypes, comm.rank());
  return simple("M3", comm, ctx, "Mismatch", {"differs between rank 0 and rank 1"}, in, hint,
                Expected{truth, dtypes, {}});
}

// M4: rank 1 has int32 where the others have float32: the same bytes.
Outcome m4_dtype(Communicator& comm, const CaseContext& ctx) {
  std::vector<DType> dtypes(3, DType::kFloat32);
  const Rows rows = same_rows(comm.size(), {{5}, {6}, {7}});
  std::vector<DType> mine = dtypes;
  if (comm.rank() == 1) {
    mine[2] = DType::kInt32;
  }
  const Inputs in = inputs_for(rows, mine, comm.rank());
  Expected e{rows, dtypes, {}};
  return simple("M4", comm, ctx, "Mismatch", {"dtype of tensor 2", "f32", "i32"}, in, rows, e);
}

// M5: rank 1's hint row disagrees with its own tensor ([4, 8] vs [8, 4], or [4, 9]).
Outcome m5_hint_vs_tensor(Communicator& comm, const CaseContext& ctx, bool same_bytes) {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat32};
  const Rows hint = same_rows(comm.size(), {{4, 8}, {3}});
  Rows truth = hint;
  truth[1][0] = same_bytes ? Shape{8, 4} : Shape{4, 9};
  const Inputs in = inputs_for(truth, dtypes, comm.rank());
  return simple(same_bytes ? "M5a" : "M5b", comm, ctx, "InvalidArgument",
                {"rank 1", "tensor 0", "[4, 8]", same_bytes ? "[8, 4]" : "[4, 9]"}, in, hint,
                Expected{truth, dtypes, {}});
}
Outcome m5a(Communicator& c, const CaseContext& x) { return m5_hint_vs_tensor(c, x, true); }
Outcome m5b(Communicator& c, const CaseContext& x) { return m5_hint_vs_tensor(c, x, false); }

// M6: rank 1's hint says rank 0 holds [2, 2] where everyone else (rank 0 too) says [4].
Outcome m6_hint_differs(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes = {DType::kFloat32};
  const Rows truth = same_rows(comm.size(), {{4}});
  Rows hint = truth;
  if (comm.rank() == 1) {
    hint[0][0] = {2, 2};
  }
  const Inputs in = inputs_for(truth, dtypes, comm.rank());
  return simple("M6", comm, ctx, "Mismatch", {"differs between rank 0 and rank 1"}, in, hint,
                Expected{truth, dtypes, {}});
}

// M7a: rank 1's op sequence is one ahead (it consumed a number without a matching call).
Outcome m7a_seq_skew(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(2, DType::kFloat32);
  const Rows rows = same_rows(comm.size(), {{5}, {6}});
  const Inputs in = inputs_for(rows, dtypes, comm.rank());
  const ForeachAllGatherOptions o = opts(ctx);
  // The skew persists, so the follow-up call must raise the same Mismatch again rather than
  // pair calls that belong to different steps.
  return attempt(
      "M7a", comm, ctx, "Mismatch", {"op sequence number", "rank 1 has"}, in,
      [&]() {
        if (comm.rank() == 1) {
          (void)detail::next_op_seq(comm);
        }
        return foreach_all_gather(in.views, comm, rows, o);
      },
      Expected{rows, dtypes, {}}, "Mismatch");
}

// M7b: rank 1 skips the call: the others must time out, never pair with a later call.
Outcome m7b_skipped_call(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(2, DType::kFloat32);
  const Rows rows = same_rows(comm.size(), {{5}, {6}});
  const Inputs in = inputs_for(rows, dtypes, comm.rank());
  if (comm.rank() != 1) {
    return simple("M7b", comm, ctx, "Timeout", {"all_gather"}, in, rows,
                  Expected{rows, dtypes, {}});
  }
  Outcome o;
  o.case_id = "M7b";
  o.backend = ctx.backend;
  o.rank = comm.rank();
  o.world = comm.size();
  o.naked = !ctx.preflight;
  o.expect = o.naked ? "any" : "NotCalled";
  valid_call(comm, ctx.timeout);  // the peers' "prior" call
  o.outcome = "skipped";
  o.err_class = "NotCalled";
  // The peers' follow-up fails fast on their poisoned communicators and sends nothing, so
  // this rank has nothing to pair with; it only waits until they have given up.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return o;
}

// M8: a different operation: rank 1 builds a plan (AllGatherPlan::create) while the others call
// foreach_all_gather, both without a hint; every rank must raise the same Mismatch from the
// header, before the shape records move.
Outcome m8_op_kind(Communicator& comm, const CaseContext& ctx);

// M9: 1000 good calls, then a count mismatch: earlier state must not mask it.
Outcome m9_after_many(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(3, DType::kBFloat16);
  const Rows rows = same_rows(comm.size(), {{5}, {6, 2}, {7}});
  const Inputs good = inputs_for(rows, dtypes, comm.rank());
  const int calls = std::getenv("SHARDGATHER_M9_CALLS") != nullptr
                        ? std::atoi(std::getenv("SHARDGATHER_M9_CALLS"))
                        : 1000;
  std::uint64_t bad_bytes = 0;
  for (int k = 0; k < calls; ++k) {
    bad_bytes += mismatch_bytes(foreach_all_gather(good.views, comm, rows, opts(ctx)),
                                Expected{rows, dtypes, {}});
  }
  Inputs in = inputs_for(rows, dtypes, comm.rank());
  Rows hint = rows;
  if (comm.rank() == 1) {
    in.views.pop_back();
    for (auto& row : hint) {
      row.pop_back();
    }
  }
  Outcome o = simple("M9", comm, ctx, "Mismatch", {"tensor count"}, in, hint, std::nullopt);
  o.out_mismatch_bytes += bad_bytes;
  o.note += std::to_string(calls) + " good calls first; ";
  return o;
}

const CaseDef kCases[] = {
    {"B1", b1_empty_all, 1, false, "empty list on every rank: a no-op"},
    {"B2", b2_empty_on_one, 2, false, "empty list on rank 1 only"},
    {"B3a", b3a, 1, false, "0-size tensors mixed with normal ones"},
    {"B3b", b3b, 1, false, "every tensor 0-size"},
    {"B4", b4_mixed_dtypes, 1, false, "mixed dtypes in one list (byte-packed)"},
    {"B5", b5_non_contiguous, 1, false, "non-contiguous inputs (packed copy)"},
    {"B6", b6_hint_one_element_off, 2, false, "hint sizes rank 1's output one element off"},
    {"B7c", b7c_overlapping_views, 1, false, "two inputs viewing the same storage"},
    {"B8", b8_misaligned, 1, false, "float32 at byte offset 1"},
    {"B9a", b9a_null_data, 2, false, "null data with numel > 0 on rank 1"},
    {"B9b", b9b_null_empty, 1, false, "null data with numel == 0"},
    {"B10", b10_shape_overflow, 2, false, "shape [2^32, 2^32] on rank 1"},
    {"B11a", b11a, 2, false, "gathered total overflows uint64 (hint)"},
    {"B11b", b11b, 2, false, "gathered total overflows uint64 (no hint)"},
    {"B12", b12_bad_dtype, 2, false, "unsupported dtype code on rank 1"},
    {"B13", b13_world_one, 1, false, "world size 1"},
    {"B14", b14_bad_init, 1, false, "invalid construction"},
    {"M1", m1_count, 2, true, "different tensor count"},
    {"M2", m2_shapes, 2, true, "same bytes, different shapes"},
    {"M3", m3_bytes, 2, true, "different per-rank bytes"},
    {"M4", m4_dtype, 2, true, "different dtype, same bytes"},
    {"M5a", m5a, 2, true, "rank 1 hint vs its tensor, same bytes"},
    {"M5b", m5b, 2, true, "rank 1 hint vs its tensor, different bytes"},
    {"M6", m6_hint_differs, 2, true, "rank 1's hint differs from the others'"},
    {"M7a", m7a_seq_skew, 2, true, "op sequence skew"},
    {"M7b", m7b_skipped_call, 2, false, "rank 1 skips a call"},
    {"M8", m8_op_kind, 2, false, "a different op kind"},
    {"M9", m9_after_many, 2, false, "1000 good calls, then a mismatch"},
};

}  // namespace

namespace {

Outcome m8_op_kind(Communicator& comm, const CaseContext& ctx) {
  const std::vector<DType> dtypes(2, DType::kFloat32);
  const Rows rows = same_rows(comm.size(), {{5}, {6}});
  const Inputs in = inputs_for(rows, dtypes, comm.rank());
  const ForeachAllGatherOptions o = opts(ctx);
  return attempt(
      "M8", comm, ctx, "Mismatch", {"operation differs", "AllGatherPlan::create"}, in,
      [&]() {
        if (comm.rank() == 1) {
          (void)AllGatherPlan::create(in.views, comm, {}, {.timeout = o.timeout});
          return GatherResult{};
        }
        return foreach_all_gather(in.views, comm, {}, o);
      },
      std::nullopt);
}

// ---- D: the generated disagreement family (RELIABILITY round 2) -------------------------
// One row per (parameter, disagreeing value): every rank but the last makes the reference call,
// the last rank makes the same call with one thing changed. Every rank must raise the same
// class, naming the disagreement, from the pre-flight header alone (exactly one collective:
// no payload moves), well within the deadline, and the communicator must stay usable.

enum class DOp : std::uint8_t {
  kForeach,
  kCreate,
  kExecute,
  kUnshard,
  kUnshardExecute,
  kStream,
  kReshard,
  kRounds  // a compound operation's call of rounds (RoundCall: the weight sync's)
};

struct DCall {
  DOp op = DOp::kForeach;
  bool hint = true;
  Strategy strategy = Strategy::kDirect;
  int extra_tensors = 0;  // more tensors than the reference
  bool many = false;      // 131 tensors, so one differs past the 128 inline dtypes
  DType dtype0 = DType::kFloat32;
  DType dtype130 = DType::kFloat32;
  int plan_world_delta = 0;  // the plan was built for world + delta ranks
  int shape_shift = 0;       // the hint's (or plan's) row of rank 0 is this much longer
  int timeout_ms = 0;        // negative: a bad timeout; 0: the context's
  bool swap_sizes = false;   // unshard: the specs' sizes of ranks 0 and 1 swapped
  int dst = -1;              // unshard plans and streams: the rank that receives (-1: every rank)
  std::uint64_t bucket_bytes = 64;  // streams
  int prefetch = 1;                 // streams
  int reshard_shift = 1;            // reshards: rank r wants the shards of rank r + shift
  bool fan_out = true;              // reshards: RegionOptions::fan_out
  std::size_t fan_out_waves = 4;    // reshards: RegionOptions::fan_out_waves
  std::uint64_t device_bucket = std::uint64_t{256} << 20;  // RegionOptions::device_bucket_bytes
  const char* stage = "";       // the call's stage (a step of a compound operation; "" for none)
  std::size_t round_width = 7;  // rounds: the values per row
  const char* round = "state";  // rounds: the round the call opens with
  // Reshards: destination 0 of this rank (a [rows, 4] box) is a view with these strides over
  // storage just large enough (alias_rows 0: contiguous). {1, 1}, {2, 1}: rows that overlap;
  // {0, 1}: one row repeated. Family A: such views must be refused on every rank, unwritten.
  std::int64_t alias_rows = 0;
  std::int64_t alias_cols = 1;
};

struct DRow {
  const char* id;
  const char* what;
  const char* expect;  // the class every rank raises
  const char* needle;  // what every message names
  int min_world;
  DCall ref;
  DCall odd;  // the last rank's
};

constexpr DCall kRefForeach{};
constexpr DCall kRefExecute{.op = DOp::kExecute};

const DRow kDRows[] = {
    {"D-op-foreach-nohint",
     "foreach with and without a hint",
     "Mismatch",
     "shapes hint",
     2,
     kRefForeach,
     {.hint = false}},
    {"D-op-create",
     "foreach against AllGatherPlan::create",
     "Mismatch",
     "operation differs",
     2,
     kRefForeach,
     {.op = DOp::kCreate}},
    {"D-op-create-nohint",
     "foreach against create without a hint",
     "Mismatch",
     "operation differs",
     2,
     kRefForeach,
     {.op = DOp::kCreate, .hint = false}},
    {"D-op-execute",
     "foreach against a plan's execute",
     "Mismatch",
     "operation differs",
     2,
     kRefForeach,
     {.op = DOp::kExecute}},
    {"D-op-unshard",
     "foreach against unshard",
     "Mismatch",
     "operation differs",
     2,
     kRefForeach,
     {.op = DOp::kUnshard}},
    {"D-op-unshard-execute",
     "a plan's execute against UnshardPlan::execute",
     "Mismatch",
     "operation differs",
     2,
     kRefExecute,
     {.op = DOp::kUnshardExecute}},
    {"D-strategy-packed",
     "plans moving with direct and packed",
     "Mismatch",
     "strategy differs",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .strategy = Strategy::kPacked}},
    {"D-strategy-per-tensor",
     "plans moving with direct and per_tensor",
     "Mismatch",
     "strategy differs",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .strategy = Strategy::kPerTensor}},
    {"D-strategy-shared",
     "plans moving with direct and shared",
     "Mismatch",
     "strategy differs",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .strategy = Strategy::kShared}},
    {"D-strategy-foreach",
     "one-shot gathers moving with direct and packed, with a hint",
     "Mismatch",
     "strategy differs",
     2,
     kRefForeach,
     {.op = DOp::kForeach, .strategy = Strategy::kPacked}},
    {"D-strategy-foreach-nohint",
     "one-shot gathers moving with direct and packed, without a hint",
     "Mismatch",
     "strategy differs",
     2,
     {.op = DOp::kForeach, .hint = false},
     {.op = DOp::kForeach, .hint = false, .strategy = Strategy::kPacked}},
    {"D-strategy-create",
     "plans created with direct and packed",
     "Mismatch",
     "strategy differs",
     2,
     {.op = DOp::kCreate},
     {.op = DOp::kCreate, .strategy = Strategy::kPacked}},
    {"D-count-foreach",
     "one tensor more, with a hint",
     "Mismatch",
     "tensor count",
     2,
     kRefForeach,
     {.extra_tensors = 1}},
    {"D-count-nohint",
     "one tensor more, without a hint",
     "Mismatch",
     "tensor count",
     2,
     {.hint = false},
     {.hint = false, .extra_tensors = 1}},
    {"D-count-execute",
     "plans of different tensor counts",
     "Mismatch",
     "tensor count",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .extra_tensors = 1}},
    {"D-dtype-0",
     "dtype of tensor 0",
     "Mismatch",
     "dtype of tensor 0",
     2,
     kRefForeach,
     {.dtype0 = DType::kFloat64}},
    {"D-dtype-130",
     "dtype of tensor 130 (past the inline dtypes)",
     "Mismatch",
     "index >= 128",
     2,
     {.many = true},
     {.many = true, .dtype130 = DType::kInt32}},
    {"D-dtype-execute",
     "plans of different dtypes",
     "Mismatch",
     "dtype of tensor 0",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .dtype0 = DType::kFloat64}},
    {"D-hint-row",
     "the hint's row of rank 0",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     kRefForeach,
     {.shape_shift = 1}},
    {"D-plan-shapes",
     "plans of different shapes",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .shape_shift = 1}},
    {"D-plan-world",
     "a plan built for another world size",
     "InvalidArgument",
     "the plan was built for",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .plan_world_delta = 1}},
    {"D-timeout",
     "a negative timeout",
     "InvalidArgument",
     "timeout must be >= 0",
     2,
     kRefForeach,
     {.timeout_ms = -5}},
    {"D-unshard-sizes",
     "unshard specs whose sizes differ",
     "Mismatch",
     "shapes hint / plan differs",
     3,
     {.op = DOp::kUnshardExecute},
     {.op = DOp::kUnshardExecute, .swap_sizes = true}},
    {"D-unshard-dst",
     "an unshard plan gathering to rank 0 against one gathering to every rank",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kUnshardExecute},
     {.op = DOp::kUnshardExecute, .dst = 0}},
    {"D-unshard-oneshot-dst",
     "a one-shot unshard to rank 0 (PlanOptions::dst) against one to every rank",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kUnshard},
     {.op = DOp::kUnshard, .dst = 0}},
    {"D-stream-bucket",
     "a stream cut into buckets of another size",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kStream},
     {.op = DOp::kStream, .bucket_bytes = 128}},
    {"D-stream-prefetch",
     "a stream with another prefetch depth",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kStream},
     {.op = DOp::kStream, .prefetch = 0}},
    {"D-stream-dst",
     "a stream to rank 0 against one to every rank",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kStream},
     {.op = DOp::kStream, .dst = 0}},
    {"D-reshard-layout",
     "a reshard whose destinations differ",
     "Mismatch",
     "shapes hint / plan differs",
     3,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .reshard_shift = 2}},
    {"D-reshard-op",
     "a reshard against an unshard plan's execute",
     "Mismatch",
     "operation differs",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kUnshardExecute}},
    {"D-reshard-dtype",
     "a reshard planned for another dtype of tensor 0",
     "Mismatch",
     "dtype of tensor 0",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .dtype0 = DType::kFloat64}},
    {"D-reshard-world",
     "a reshard planned for W + 1 ranks",
     "InvalidArgument",
     "the plan was built for",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .plan_world_delta = 1}},
    {"D-reshard-fan-out",
     "a reshard planned without the fan-out inside hosts",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .fan_out = false}},
    {"D-reshard-waves",
     "a reshard planned with another number of fan-out waves",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .fan_out_waves = 1}},
    {"D-reshard-device-bucket",
     "a reshard planned with another device bucket",
     "Mismatch",
     "shapes hint / plan differs",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .device_bucket = 4096}},
    {"D-reshard-timeout",
     "a reshard with a negative timeout",
     "InvalidArgument",
     "timeout must be >= 0",
     2,
     {.op = DOp::kReshard},
     {.op = DOp::kReshard, .timeout_ms = -5}},
    // A step of a compound operation (Stage) never pairs with a call of its own, or with
    // another step: the header names both.
    {"D-stage-foreach",
     "a foreach against the same foreach as a step of another operation",
     "Mismatch",
     "as the step 'unshard(quantize): shapes'",
     2,
     kRefForeach,
     {.stage = "unshard(quantize): shapes"}},
    {"D-stage-foreach-nohint",
     "a foreach without a hint against the same as a step (its bytes would pair alike)",
     "Mismatch",
     "operation differs",
     2,
     {.hint = false},
     {.hint = false, .stage = "WeightSync.sync: state"}},
    {"D-stage-steps",
     "two steps of one operation: a reshard plan's executions at different stages",
     "Mismatch",
     "as the step 'WeightSync.sync: vote'",
     2,
     {.op = DOp::kReshard, .stage = "WeightSync.sync: state"},
     {.op = DOp::kReshard, .stage = "WeightSync.sync: vote"}},
    {"D-stage-unshard",
     "an unshard against the same unshard as a step",
     "Mismatch",
     "operation differs",
     2,
     {.op = DOp::kUnshard},
     {.op = DOp::kUnshard, .stage = "full_tensors(quantize): payload"}},
    {"D-rounds-width",
     "a call of rounds whose rows are wider on one rank",
     "Mismatch",
     "the call's rows differ",
     2,
     {.op = DOp::kRounds},
     {.op = DOp::kRounds, .round_width = 9}},
    {"D-rounds-round",
     "a call of rounds opened at another round",
     "Mismatch",
     "as the step 'WeightSync.sync: vote'",
     2,
     {.op = DOp::kRounds},
     {.op = DOp::kRounds, .round = "vote"}},
    {"D-rounds-foreach",
     "a call of rounds against a foreach",
     "Mismatch",
     "operation differs",
     2,
     kRefForeach,
     {.op = DOp::kRounds}},
    {"D-rounds-timeout",
     "a call of rounds with a negative timeout",
     "InvalidArgument",
     "timeout must be >= 0",
     2,
     {.op = DOp::kRounds},
     {.op = DOp::kRounds, .timeout_ms = -5}},
    {"D-stage-plan",
     "a plan's execute against the same plan's execute as a step",
     "Mismatch",
     "operation differs",
     2,
     kRefExecute,
     {.op = DOp::kExecute, .stage = "foreach_all_gather(quantize): payload"}},
    // Family A: a destination whose elements share memory, on the last rank only.
    {"A-reshard-rows-overlap",
     "a reshard destination whose rows overlap (strides {1, 1})",
     "InvalidArgument",
     "share memory",
     2,
     {.op = DOp::kReshard, .reshard_shift = 0},
     {.op = DOp::kReshard, .reshard_shift = 0, .alias_rows = 1, .alias_cols = 1}},
    {"A-reshard-half-overlap",
     "a reshard destination whose rows overlap by half (strides {2, 1})",
     "InvalidArgument",
     "share memory",
     2,
     {.op = DOp::kReshard, .reshard_shift = 0},
     {.op = DOp::kReshard, .reshard_shift = 0, .alias_rows = 2, .alias_cols = 1}},
    {"A-reshard-rows-touch",
     "a reshard destination whose rows share one element each (strides {3, 1})",
     "InvalidArgument",
     "share memory",
     2,
     {.op = DOp::kReshard, .reshard_shift = 0},
     {.op = DOp::kReshard, .reshard_shift = 0, .alias_rows = 3, .alias_cols = 1}},
    {"A-reshard-expanded",
     "a reshard destination that repeats one row (strides {0, 1})",
     "InvalidArgument",
     "share memory",
     2,
     {.op = DOp::kReshard, .reshard_shift = 0},
     {.op = DOp::kReshard, .reshard_shift = 0, .alias_rows = 0, .alias_cols = -1}},
    {"A-reshard-columns-collide",
     "a reshard destination whose columns land on one element (strides {4, 0})",
     "InvalidArgument",
     "share memory",
     2,
     {.op = DOp::kReshard, .reshard_shift = 0},
     {.op = DOp::kReshard, .reshard_shift = 0, .alias_rows = 4, .alias_cols = 0}},
};

// Rank r's shape of tensor i (tensor 2 is sharded along dim 1).
Shape d_shape(const DCall& c, int r, std::size_t i) {
  if (i == 0) {
    return {r + 1 + (r == 0 ? c.shape_shift : 0), 4};
  }
  if (i == 1) {
    return {6};
  }
  if (i == 2) {
    return {2, r};
  }
  return {static_cast<std::int64_t>(i % 3)};
}

std::vector<DType> d_dtypes(const DCall& c) {
  const std::size_t n = (c.many ? 131 : 3) + static_cast<std::size_t>(c.extra_tensors);
  std::vector<DType> d(n, DType::kFloat32);
  d[0] = c.dtype0;
  d[1] = DType::kBFloat16;
  d[2] = DType::kInt64;
  if (c.many) {
    d[130] = c.dtype130;
  }
  return d;
}

Rows d_rows(const DCall& c, int world) {
  Rows rows(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (std::size_t i = 0; i < d_dtypes(c).size(); ++i) {
      rows[static_cast<std::size_t>(r)].push_back(d_shape(c, r, i));
    }
  }
  return rows;
}

// The specs that make each rank's tensors its shards: tensors 0 and 1 along dim 0, 2 along 1.
std::vector<ShardSpec> d_specs(const DCall& c, int world) {
  const Rows rows = d_rows(c, world);
  const std::vector<DType> dtypes = d_dtypes(c);
  std::vector<ShardSpec> specs;
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    const int dim = i == 2 ? 1 : 0;
    ShardSpec s{dtypes[i], rows[0][i], dim, {}, 0};
    std::int64_t full = 0;
    for (const auto& row : rows) {
      s.sizes.push_back(row[i][static_cast<std::size_t>(dim)]);
      full += row[i][static_cast<std::size_t>(dim)];
    }
    if (c.swap_sizes) {
      std::swap(s.sizes[0], s.sizes[1]);
    }
    s.full_shape[static_cast<std::size_t>(dim)] = full;
    specs.push_back(std::move(s));
  }
  return specs;
}

// The specs as a reshard: every rank holds its shards and wants those of rank r + shift.
std::vector<TensorRegions> d_layout(const DCall& c, int world) {
  std::vector<TensorRegions> layout;
  for (const ShardSpec& s : d_specs(c, world)) {
    TensorRegions t{.dtype = s.dtype, .shape = s.full_shape, .sources = {}, .destinations = {}};
    std::int64_t at = 0;
    std::vector<Box> boxes;
    for (const std::int64_t n : s.sizes) {
      Box b{Shape(s.full_shape.size(), 0), s.full_shape};
      b.offset[static_cast<std::size_t>(s.shard_dim)] = at;
      b.size[static_cast<std::size_t>(s.shard_dim)] = n;
      at += n;
      boxes.push_back(b);
    }
    for (int r = 0; r < world; ++r) {
      t.sources.push_back({r, boxes[static_cast<std::size_t>(r)]});
      t.destinations.push_back({r, boxes[static_cast<std::size_t>((r + c.reshard_shift) % world)]});
    }
    layout.push_back(std::move(t));
  }
  return layout;
}

// Destination v's view: contiguous, or (family A, destination 0) the aliasing strides of `c`
// over storage that holds exactly the elements they reach.
TensorView d_destination(const DCall& c, std::size_t v, DType dtype, const Shape& size,
                         std::vector<std::byte>& storage) {
  const bool alias = v == 0 && (c.alias_rows != 0 || c.alias_cols != 1) && size.size() == 2;
  if (!alias) {
    storage.assign(checked_nbytes(dtype, size), std::byte{0xEE});
    return {storage.data(), dtype, size, {}, kCpu};
  }
  const std::int64_t cols = c.alias_cols < 0 ? 1 : c.alias_cols;  // -1: {0, 1}
  const std::int64_t rows = c.alias_cols < 0 ? 0 : c.alias_rows;
  const std::int64_t reach = rows * (size[0] - 1) + cols * (size[1] - 1) + 1;
  storage.assign(static_cast<std::size_t>(reach) * dtype_size(dtype), std::byte{0xEE});
  return {storage.data(), dtype, size, {rows, cols}, kCpu};
}

void d_reshard(const DCall& c, Communicator& comm, const PlanOptions& po, const Inputs& in) {
  RegionOptions regions;
  regions.fan_out = c.fan_out;
  regions.fan_out_waves = c.fan_out_waves;
  regions.device_bucket_bytes = c.device_bucket;
  ReshardPlan plan(d_layout(c, comm.size() + c.plan_world_delta), comm.size() + c.plan_world_delta,
                   comm.rank(), po, regions);
  std::vector<std::vector<std::byte>> storage(plan.destination_count());
  std::vector<TensorView> dst;
  for (std::size_t v = 0; v < plan.destination_count(); ++v) {
    const Shape& size = plan.destination(v).box.size;
    const DType dtype = plan.tensor(plan.regions().destination_views[v].tensor).dtype;
    dst.push_back(d_destination(c, v, dtype, size, storage[v]));
  }
  try {
    (void)plan.execute(in.views, comm, dst);
  } catch (const Error&) {
    // Refused before anything moved: every destination byte still the sentinel.
    for (const auto& bytes : storage) {
      for (const std::byte b : bytes) {
        if (b != std::byte{0xEE}) {
          throw std::logic_error("a refused reshard wrote its destination");
        }
      }
    }
    throw;
  }
}

GatherResult d_call(const DCall& c, Communicator& comm, const CaseContext& ctx, const Inputs& in) {
  const int world = comm.size();
  const std::optional<std::chrono::milliseconds> timeout =
      c.timeout_ms < 0 ? std::optional(std::chrono::milliseconds(c.timeout_ms))
                       : std::optional(ctx.timeout);
  const Rows rows = d_rows(c, world + c.plan_world_delta);
  const Rows none;
  const PlanOptions po{.timeout = timeout,
                       .preflight = true,
                       .strategy = c.strategy,
                       .copy_threads = 0,
                       .dst = -1,
                       .stage = Stage(c.stage)};
  switch (c.op) {
    case DOp::kForeach:
      return foreach_all_gather(
          in.views, comm, c.hint ? rows : none,
          {.timeout = timeout, .preflight = true, .strategy = c.strategy, .stage = po.stage});
    case DOp::kCreate:
      (void)AllGatherPlan::create(in.views, comm, c.hint ? rows : none, po);
      return {};
    case DOp::kExecute: {
      AllGatherPlan plan(d_dtypes(c), rows, comm.rank(), po);
      std::vector<std::byte> out(plan.output_bytes());
      (void)plan.execute(in.views, comm, out);
      return {};
    }
    case DOp::kUnshard: {
      PlanOptions to = po;
      to.dst = c.dst;  // PlanOptions::dst, the one place a gather to one rank is asked for
      (void)unshard(in.views, comm, d_specs(c, world), to);
      return {};
    }
    case DOp::kUnshardExecute: {
      UnshardPlan plan(d_specs(c, world), world, comm.rank(), po, c.dst);
      std::vector<std::byte> out(plan.output_bytes());
      (void)plan.execute(in.views, comm, out);
      return {};
    }
    case DOp::kStream: {
      UnshardStream stream(
          d_specs(c, world), world, comm.rank(),
          {.bucket_bytes = c.bucket_bytes, .prefetch = c.prefetch, .dst = c.dst, .plan = po});
      stream.begin(in.views, comm);
      while (stream.next()) {
      }
      return {};
    }
    case DOp::kReshard:
      d_reshard(c, comm, po, in);
      return {};
    case DOp::kRounds: {
      RoundCall call(comm, Operation::kWeightSync, "WeightSync.sync", timeout, c.round_width);
      call.open(c.round);
      const std::vector<std::int64_t> row{comm.rank()};
      (void)call.rows(row, "state");
      return {};
    }
  }
  return {};
}

Outcome run_d(const DRow& row, Communicator& comm, const CaseContext& ctx) {
  const bool odd = comm.rank() == comm.size() - 1;
  const DCall& c = odd ? row.odd : row.ref;
  Inputs in;
  const std::vector<DType> dtypes = d_dtypes(c);
  for (std::size_t i = 0; i < dtypes.size(); ++i) {
    in.add(dtypes[i], d_shape(c, comm.rank(), i), comm.rank());
  }
  std::uint64_t moved = 0;
  Outcome o = attempt(
      row.id, comm, ctx, row.expect, {row.needle}, in,
      [&]() {
        const std::uint64_t before = comm.collectives_issued();
        try {
          return d_call(c, comm, ctx, in);
        } catch (...) {
          moved = comm.collectives_issued() - before;
          throw;
        }
      },
      std::nullopt);
  if (o.outcome == "error" && moved != 1) {
    o.msg_ok = false;
    o.note += std::to_string(moved) + " collectives before the error, not just the header; ";
  }
  if (o.outcome == "error" &&
      o.t_err_s > 0.5 * std::chrono::duration<double>(ctx.timeout).count()) {
    o.msg_ok = false;
    o.note += "raised late (the deadline, not the header); ";
  }
  return o;
}

template <std::size_t... K>
constexpr auto d_defs(std::index_sequence<K...> /*rows*/) {
  return std::array<CaseDef, sizeof...(K)>{CaseDef{
      kDRows[K].id,
      [](Communicator& comm, const CaseContext& ctx) { return run_d(kDRows[K], comm, ctx); },
      kDRows[K].min_world, false, kDRows[K].what}...};
}

const auto kDCases = d_defs(std::make_index_sequence<std::size(kDRows)>());

}  // namespace

std::span<const CaseDef> bm_cases() { return kCases; }

std::span<const CaseDef> d_cases() { return kDCases; }

const CaseDef* find_case(std::string_view id) {
  for (const std::span<const CaseDef> family : {bm_cases(), d_cases()}) {
    for (const CaseDef& c : family) {
      if (id == c.id) {
        return &c;
      }
    }
  }
  return nullptr;
}

std::vector<std::string> check_case(std::span<const Outcome> outcomes, int world) {
  std::vector<std::string> problems;
  std::set<int> ranks;
  for (const Outcome& o : outcomes) {
    ranks.insert(o.rank);
  }
  for (int r = 0; r < world; ++r) {
    if (ranks.count(r) == 0) {
      problems.push_back("rank " + std::to_string(r) + " reported nothing (killed or hung)");
    }
  }
  for (const Outcome& o : outcomes) {
    if (o.naked) {
      continue;
    }
    const std::string who = o.case_id + " rank " + std::to_string(o.rank) + ": ";
    if (o.err_class != o.expect) {
      problems.push_back(who + "expected " + o.expect + ", got " + o.err_class + " (" + o.err_msg +
                         ")");
    }
    if (!o.msg_ok) {
      problems.push_back(who + "message: " + o.note + " in \"" + o.err_msg + "\"");
    }
    if (o.in_changed) {
      problems.push_back(who + "inputs changed");
    }
    if (!o.sentinel_ok) {
      problems.push_back(who + "sentinel violated: " + o.note);
    }
    if (o.out_mismatch_bytes != 0) {
      problems.push_back(who + std::to_string(o.out_mismatch_bytes) + " bytes differ");
    }
    if (!o.followup_ok) {
      problems.push_back(who + "follow-up call failed: " + o.note);
    }
  }
  return problems;
}

std::string to_json(const Outcome& o) {
  const auto str = [](const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
        out += buf;
      } else {
        out += c;
      }
    }
    return out + "\"";
  };
  const auto b = [](bool v) { return v ? "true" : "false"; };
  std::ostringstream s;
  s << "{\"case\":" << str(o.case_id) << ",\"backend\":" << str(o.backend) << ",\"rank\":" << o.rank
    << ",\"world\":" << o.world << ",\"naked\":" << b(o.naked) << ",\"expect\":" << str(o.expect)
    << ",\"outcome\":" << str(o.outcome) << ",\"err_class\":" << str(o.err_class)
    << ",\"err_msg\":" << str(o.err_msg) << ",\"t_err_s\":" << o.t_err_s
    << ",\"out_mismatch_bytes\":" << o.out_mismatch_bytes << ",\"in_changed\":" << b(o.in_changed)
    << ",\"sentinel_ok\":" << b(o.sentinel_ok) << ",\"msg_ok\":" << b(o.msg_ok)
    << ",\"followup_ok\":" << b(o.followup_ok) << ",\"note\":" << str(o.note) << "}";
  return s.str();
}

void append_result(const Outcome& o) {
  static std::mutex mu;
  const char* path = std::getenv("SHARDGATHER_RESULTS");
  if (path == nullptr || *path == '\0') {
    return;
  }
  const std::lock_guard<std::mutex> lock(mu);
  std::ofstream(path, std::ios::app) << to_json(o) << "\n";
}

std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
  std::uint64_t h = 1469598103934665603ULL;
  for (const std::byte b : bytes) {
    h = (h ^ static_cast<std::uint64_t>(b)) * 1099511628211ULL;
  }
  return h;
}

namespace {

std::uint64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::size_t n = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, n, key) == 0) {
      return std::strtoull(line.c_str() + n, nullptr, 10);
    }
  }
  return 0;
}

}  // namespace

std::uint64_t rss_bytes() { return status_kib("VmRSS:") * 1024; }
std::uint64_t peak_rss_bytes() { return status_kib("VmHWM:") * 1024; }
int thread_count() {
  // Read until the count holds still: a thread that was just joined can be listed for a moment
  // longer (the kernel wakes the joiner before it releases the task), which made L1 compare a
  // count taken right after the previous test's rank threads with one taken later.
  int last = static_cast<int>(status_kib("Threads:"));
  for (int stable = 0, tries = 0; stable < 10 && tries < 400; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const int now = static_cast<int>(status_kib("Threads:"));
    stable = now == last ? stable + 1 : 0;
    last = now;
  }
  return last;
}

int open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) {
      ++n;
    }
    closedir(d);
  }
  return n - 3;  // ".", ".." and the directory's own descriptor
}

}  // namespace shardgather::reliability
