// The region planner (include/shardgather/regions.h). Per destination box: intersect it with
// every source box; where the intersections are disjoint (sources without replicas, the common
// case) each is one transfer; where they overlap, cut the box into the grid their edges make,
// give each cell to one holder (its own rank, else its host, else the least-loaded), split large
// cells among replicas, and merge neighbouring cells of one holder back into boxes.
#include "shardgather/regions.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <string>
#include <tuple>

#include "vocabulary/checked_math.h"
#include "vocabulary/hash.h"

#include "shardgather/errors.h"
#include "shardgather/layout.h"

namespace shardgather {

namespace {

// More grid cells than this for one destination box is a layout we refuse rather than plan
// for minutes (a real layout's replicas share their edges and cut a box into few cells).
constexpr std::uint64_t kMaxGridWork = std::uint64_t{1} << 26;

std::string tuple_str(std::span<const std::int64_t> values) {
  std::string s = "(";
  for (std::size_t d = 0; d < values.size(); ++d) {
    s += (d == 0 ? "" : ", ") + std::to_string(values[d]);
  }
  return s + ")";
}

std::string box_str(const Box& box) {
  return "offset " + tuple_str(box.offset) + " size " + tuple_str(box.size);
}

std::string entry_str(std::size_t tensor, const char* side, std::size_t entry, int rank) {
  return "tensor " + std::to_string(tensor) + ": " + side + " " + std::to_string(entry) +
         " (rank " + std::to_string(rank) + ")";
}

void check_box(const TensorRegions& t, const RankBox& rb, int world, const std::string& where) {
  const Box& b = rb.box;
  if (rb.rank < 0 || rb.rank >= world) {
    throw InvalidArgument(where + ": rank is not in [0, " + std::to_string(world) + ")");
  }
  if (b.offset.size() != t.shape.size() || b.size.size() != t.shape.size()) {
    throw InvalidArgument(where + ": a box of " + std::to_string(b.offset.size()) +
                          " offsets and " + std::to_string(b.size.size()) +
                          " sizes for a tensor of shape " + tuple_str(t.shape));
  }
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    const std::int64_t lo = b.offset[d];
    const std::int64_t n = b.size[d];
    if (lo < 0 || n < 0 || lo > t.shape[d] || n > t.shape[d] - lo) {
      throw InvalidArgument(where + ": box " + box_str(b) + " does not fit shape " +
                            tuple_str(t.shape) + " (dim " + std::to_string(d) + ")");
    }
  }
}

bool contains(const Box& outer, const Box& inner) {
  for (std::size_t d = 0; d < outer.offset.size(); ++d) {
    if (inner.offset[d] < outer.offset[d] ||
        inner.offset[d] + inner.size[d] > outer.offset[d] + outer.size[d]) {
      return false;
    }
  }
  return true;
}

// Whether no two of `boxes` share an element: a sweep along the dim whose offsets vary most
// (dim 0 for FSDP shards, the TP dim for column shards), comparing only boxes that meet on it.
bool disjoint(std::span<const RankBox> boxes) {
  if (boxes.size() < 2 || boxes[0].box.offset.empty()) {
    return boxes.size() < 2;
  }
  const std::size_t ndim = boxes[0].box.offset.size();
  std::size_t sweep = 0;
  std::size_t most = 0;
  for (std::size_t d = 0; d < ndim; ++d) {
    std::vector<std::int64_t> offsets;
    for (const RankBox& rb : boxes) {
      offsets.push_back(rb.box.offset[d]);
    }
    std::sort(offsets.begin(), offsets.end());
    const auto distinct =
        static_cast<std::size_t>(std::unique(offsets.begin(), offsets.end()) - offsets.begin());
    if (distinct > most) {
      most = distinct;
      sweep = d;
    }
  }
  std::vector<std::size_t> order(boxes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return boxes[a].box.offset[sweep] < boxes[b].box.offset[sweep];
  });
  for (std::size_t a = 0; a < order.size(); ++a) {
    const Box& box_a = boxes[order[a]].box;
    const std::int64_t end = box_a.offset[sweep] + box_a.size[sweep];
    for (std::size_t b = a + 1; b < order.size(); ++b) {
      const Box& box_b = boxes[order[b]].box;
      if (box_b.offset[sweep] >= end) {
        break;
      }
      if (box_elements(box_a) != 0 && box_elements(intersect(box_a, box_b)) != 0) {
        return false;
      }
    }
  }
  return true;
}

// `cell` cut into min(wanted, n) slabs along its first dim of n >= 2 elements, the first ones
// an element larger where n does not divide; `cell` alone where no dim has two elements.
std::vector<Box> slabs_of(const Box& cell, std::size_t wanted) {
  const auto dim = static_cast<std::size_t>(
      std::find_if(cell.size.begin(), cell.size.end(), [](std::int64_t n) { return n >= 2; }) -
      cell.size.begin());
  if (dim == cell.size.size() || wanted < 2) {
    return {cell};
  }
  const std::int64_t n = cell.size[dim];
  const auto parts = std::min<std::int64_t>(static_cast<std::int64_t>(wanted), n);
  std::vector<Box> slabs;
  std::int64_t offset = cell.offset[dim];
  for (std::int64_t p = 0; p < parts; ++p) {
    Box& slab = slabs.emplace_back(cell);
    slab.offset[dim] = offset;
    slab.size[dim] = n / parts + (p < n % parts ? 1 : 0);
    offset += slab.size[dim];
  }
  return slabs;
}

// A piece of a destination box and the source entry it comes from.
struct Piece {
  std::size_t src = 0;
  Box box;
};

// Merges pieces of one source that touch along a dim and match in every other, dim by dim from
// the last (so a grid's rows join first, then the rows into slabs).
void merge_pieces(std::vector<Piece>& pieces) {
  if (pieces.empty()) {
    return;
  }
  const std::size_t ndim = pieces[0].box.offset.size();
  for (std::size_t d = ndim; d-- > 0;) {
    const auto key = [d](const Piece& p) {
      Shape k{static_cast<std::int64_t>(p.src)};
      for (std::size_t e = 0; e < p.box.offset.size(); ++e) {
        if (e != d) {
          k.push_back(p.box.offset[e]);
          k.push_back(p.box.size[e]);
        }
      }
      k.push_back(p.box.offset[d]);
      return k;
    };
    std::sort(pieces.begin(), pieces.end(),
              [&](const Piece& a, const Piece& b) { return key(a) < key(b); });
    std::vector<Piece> merged;
    for (Piece& p : pieces) {
      if (!merged.empty()) {
        Piece& last = merged.back();
        Shape a = key(last);
        Shape b = key(p);
        a.pop_back();
        b.pop_back();
        if (a == b && last.box.offset[d] + last.box.size[d] == p.box.offset[d]) {
          last.box.size[d] += p.box.size[d];
          continue;
        }
      }
      merged.push_back(std::move(p));
    }
    pieces = std::move(merged);
  }
}

class Planner {
 public:
  Planner(std::span<const TensorRegions> tensors, int world, const RegionOptions& options)
      : tensors_(tensors),
        world_(world),
        options_(options),
        load_(static_cast<std::size_t>(world), 0),
        relay_load_(static_cast<std::size_t>(world), 0) {}

  std::vector<Transfer> run() {
    number_views();
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const TensorRegions& t = tensors_[i];
      const bool replicas = !disjoint(t.sources);
      for (const std::vector<std::size_t>& group : fan_out_groups(t)) {
        if (group.size() == 1) {
          plan_destination(i, group[0], replicas);
        } else {
          plan_group(i, group, replicas);
        }
      }
    }
    rounds = assign_rounds();
    return std::move(transfers_);
  }

  std::size_t rounds = 1;  // exchanges per execution (run() sets it)

  // The second exchange's transfers (run() first).
  std::vector<Transfer> take_forwards() { return std::move(forwards_); }

  std::vector<std::vector<std::size_t>> src_view;  // [tensor][entry]: its view on its rank
  std::vector<std::vector<std::size_t>> dst_view;

 private:
  void number_views() {
    std::vector<std::size_t> srcs(static_cast<std::size_t>(world_), 0);
    std::vector<std::size_t> dsts(static_cast<std::size_t>(world_), 0);
    for (const TensorRegions& t : tensors_) {
      auto& s = src_view.emplace_back();
      for (const RankBox& rb : t.sources) {
        s.push_back(srcs[static_cast<std::size_t>(rb.rank)]++);
      }
      auto& d = dst_view.emplace_back();
      for (const RankBox& rb : t.destinations) {
        d.push_back(dsts[static_cast<std::size_t>(rb.rank)]++);
      }
    }
  }

  // Destination entries of one tensor that receive alike: each entry alone, except (with
  // fan_out and hosts) the entries of one host that want the same non-empty box, in entry order.
  [[nodiscard]] std::vector<std::vector<std::size_t>> fan_out_groups(const TensorRegions& t) const {
    std::vector<std::vector<std::size_t>> groups;
    const bool fan = options_.fan_out && !options_.hosts.empty();
    std::vector<std::tuple<int, const Shape*, const Shape*, std::size_t>> keys;
    for (std::size_t k = 0; k < t.destinations.size(); ++k) {
      const RankBox& d = t.destinations[k];
      if (!fan || box_elements(d.box) == 0) {
        groups.push_back({k});
      } else {
        keys.emplace_back(host_of(d.rank), &d.box.offset, &d.box.size, k);
      }
    }
    const auto less = [](const auto& a, const auto& b) {
      return std::tie(std::get<0>(a), *std::get<1>(a), *std::get<2>(a), std::get<3>(a)) <
             std::tie(std::get<0>(b), *std::get<1>(b), *std::get<2>(b), std::get<3>(b));
    };
    std::sort(keys.begin(), keys.end(), less);
    for (std::size_t n = 0; n < keys.size(); ++n) {
      const auto& [host, offset, size, k] = keys[n];
      const bool same = n > 0 && std::get<0>(keys[n - 1]) == host &&
                        *std::get<1>(keys[n - 1]) == *offset && *std::get<2>(keys[n - 1]) == *size;
      if (same) {
        groups.back().push_back(k);
      } else {
        groups.push_back({k});
      }
    }
    return groups;
  }

  // The intersections of a destination box with every source box, and whether they cover it.
  std::vector<Piece> sources_of(const TensorRegions& t, const Box& want, bool& covered) const {
    std::vector<Piece> found;
    std::uint64_t got = 0;
    for (std::size_t j = 0; j < t.sources.size(); ++j) {
      Box meet = intersect(t.sources[j].box, want);
      const std::uint64_t n = box_elements(meet);
      if (n != 0) {
        got += n;
        found.push_back({j, std::move(meet)});
      }
    }
    covered = got == box_elements(want);
    return found;
  }

  void plan_destination(std::size_t i, std::size_t k, bool replicas) {
    const TensorRegions& t = tensors_[i];
    const RankBox& want = t.destinations[k];
    if (box_elements(want.box) == 0) {
      return;
    }
    bool covered = false;
    std::vector<Piece> found = sources_of(t, want.box, covered);
    std::vector<Piece> pieces;
    if (!replicas && covered) {
      for (Piece& p : found) {
        const std::size_t only[] = {p.src};
        charge(t, only, p.box);
        pieces.push_back(std::move(p));
      }
    } else {
      for_each_cell(i, k, found, [&](Box cell, std::span<const std::size_t> holders) {
        assign(t, want.rank, holders, std::move(cell), pieces);
      });
      merge_pieces(pieces);
    }
    emit(i, k, pieces, transfers_);
  }

  // Entries `group` of tensor i: ranks of one host wanting one box. A cell held on their host
  // goes to each of them as plan_destination would; a cell held only on other hosts crosses the
  // network once, to one of them (a large one split among them), which forwards it to the rest.
  void plan_group(std::size_t i, const std::vector<std::size_t>& group, bool replicas) {
    const TensorRegions& t = tensors_[i];
    const Box& box = t.destinations[group[0]].box;
    const int host = host_of(t.destinations[group[0]].rank);
    bool covered = false;
    std::vector<Piece> found = sources_of(t, box, covered);
    std::vector<std::vector<Piece>> direct(group.size());
    std::vector<std::vector<Piece>> relayed(group.size());
    const auto place = [&](Box cell, std::span<const std::size_t> holders) {
      const bool on_host = std::any_of(holders.begin(), holders.end(), [&](std::size_t j) {
        return host_of(t.sources[j].rank) == host;
      });
      if (on_host) {
        for (std::size_t m = 0; m < group.size(); ++m) {
          assign(t, t.destinations[group[m]].rank, holders, cell, direct[m]);
        }
        return;
      }
      for (auto& [m, slab] : split_among(t, group, std::move(cell))) {
        assign(t, t.destinations[group[m]].rank, holders, std::move(slab), relayed[m]);
      }
    };
    if (!replicas && covered) {
      for (Piece& p : found) {
        const std::size_t only[] = {p.src};
        place(std::move(p.box), only);
      }
    } else {
      for_each_cell(i, group[0], found, place);
    }
    for (std::size_t m = 0; m < group.size(); ++m) {
      merge_pieces(direct[m]);
      emit(i, group[m], direct[m], transfers_);
      merge_pieces(relayed[m]);
      RelayUnit unit{.moves = transfers_.size(), .forwards = forwards_.size()};
      emit(i, group[m], relayed[m], transfers_);
      std::vector<Piece> forward;
      for (const Piece& p : relayed[m]) {
        forward.push_back({group[m], p.box});
        unit.bytes = detail::add_checked(
            unit.bytes, detail::mul_checked(box_elements(p.box), dtype_size(t.dtype), "bytes"),
            "relayed bytes");
      }
      merge_pieces(forward);
      for (std::size_t n = 0; n < group.size(); ++n) {
        if (n != m) {
          emit(i, group[n], forward, forwards_, /*forward=*/true);
        }
      }
      if (unit.bytes != 0) {
        unit.moves_end = transfers_.size();
        unit.forwards_end = forwards_.size();
        units_.push_back(unit);
      }
    }
  }

  // Puts the relayed pieces in waves of about equal bytes, in plan order (a unit: what one rank
  // relays of one tensor for its group, with its forwards, stays in one wave). A relayed move of
  // wave w goes in exchange w, its forwards in exchange w + 1; every other move in exchange 0.
  // Waves left empty (one unit larger than a wave) are dropped, so no exchange moves nothing.
  // Returns the number of exchanges.
  std::size_t assign_rounds() {
    if (units_.empty()) {
      return 1;
    }
    const std::uint64_t waves = std::min(options_.fan_out_waves, units_.size());
    std::uint64_t total = 0;
    for (const RelayUnit& u : units_) {
      total = detail::add_checked(total, u.bytes, "relayed bytes");
    }
    const std::uint64_t per_wave = std::max<std::uint64_t>(total / waves + (total % waves != 0), 1);
    std::uint64_t before = 0;
    std::size_t used = 0;  // waves holding a unit so far
    std::uint64_t last = waves;
    for (const RelayUnit& u : units_) {
      const std::uint64_t wave = std::min(waves - 1, before / per_wave);
      before += u.bytes;
      used += wave != last ? 1 : 0;
      last = wave;
      for (std::size_t n = u.moves; n < u.moves_end; ++n) {
        transfers_[n].round = used - 1;
      }
      for (std::size_t n = u.forwards; n < u.forwards_end; ++n) {
        forwards_[n].round = used;
      }
    }
    return used + 1;
  }

  // A cell that crosses to a host, as slabs for members of `group` (indices into it): one slab
  // to the member that has relayed least, or, from split_bytes up, one slab to each member along
  // the cell's first dim of two or more elements.
  std::vector<std::pair<std::size_t, Box>> split_among(const TensorRegions& t,
                                                       const std::vector<std::size_t>& group,
                                                       Box cell) {
    std::vector<std::size_t> members(group.size());
    std::iota(members.begin(), members.end(), std::size_t{0});
    std::sort(members.begin(), members.end(), [&](std::size_t a, std::size_t b) {
      return std::tie(relay_load_[rank_of_dst(t, group[a])], a) <
             std::tie(relay_load_[rank_of_dst(t, group[b])], b);
    });
    const std::uint64_t bytes = box_elements(cell) * dtype_size(t.dtype);
    std::vector<std::pair<std::size_t, Box>> slabs;
    if (bytes < options_.split_bytes) {
      slabs.emplace_back(members[0], std::move(cell));
    } else {
      std::vector<Box> cut = slabs_of(cell, members.size());
      for (std::size_t p = 0; p < cut.size(); ++p) {
        slabs.emplace_back(members[p], std::move(cut[p]));
      }
    }
    for (const auto& [m, slab] : slabs) {
      relay_load_[rank_of_dst(t, group[m])] += box_elements(slab) * dtype_size(t.dtype);
    }
    return slabs;
  }

  // Transfers into destination entry k of tensor i, one per piece (a piece's src: a source
  // entry, or for a forward the forwarding destination entry).
  void emit(std::size_t i, std::size_t k, const std::vector<Piece>& pieces,
            std::vector<Transfer>& out, bool forward = false) {
    const TensorRegions& t = tensors_[i];
    for (const Piece& p : pieces) {
      const std::uint64_t bytes =
          detail::mul_checked(box_elements(p.box), dtype_size(t.dtype), "transfer bytes");
      out.push_back(Transfer{.tensor = i,
                             .src = p.src,
                             .dst = k,
                             .src_view = forward ? dst_view[i][p.src] : src_view[i][p.src],
                             .dst_view = dst_view[i][k],
                             .box = p.box,
                             .bytes = bytes});
    }
  }

  // Destination entry k's box cut into the grid of every intersection's edges: fn(cell,
  // holders) for each cell, holders being the source entries that hold it.
  template <typename Fn>
  void for_each_cell(std::size_t i, std::size_t k, const std::vector<Piece>& found, Fn&& fn) {
    const TensorRegions& t = tensors_[i];
    const RankBox& want = t.destinations[k];
    const std::size_t ndim = t.shape.size();
    std::vector<Shape> cuts(ndim);
    std::uint64_t cells = 1;
    for (std::size_t d = 0; d < ndim; ++d) {
      cuts[d] = {want.box.offset[d], want.box.offset[d] + want.box.size[d]};
      for (const Piece& p : found) {
        cuts[d].push_back(p.box.offset[d]);
        cuts[d].push_back(p.box.offset[d] + p.box.size[d]);
      }
      std::sort(cuts[d].begin(), cuts[d].end());
      cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
      cells = detail::mul_checked(cells, cuts[d].size() - 1, "grid cells");
    }
    if (cells > kMaxGridWork / std::max<std::size_t>(found.size(), 1)) {
      throw InvalidArgument(entry_str(i, "destination", k, want.rank) + ": its sources cut box " +
                            box_str(want.box) + " into " + std::to_string(cells) +
                            " cells, more than the planner takes");
    }
    std::vector<std::size_t> at(ndim, 0);  // the cell's index per dim
    std::vector<std::size_t> holders;
    for (std::uint64_t c = 0; c < cells; ++c) {
      Box cell{Shape(ndim), Shape(ndim)};
      for (std::size_t d = 0; d < ndim; ++d) {
        cell.offset[d] = cuts[d][at[d]];
        cell.size[d] = cuts[d][at[d] + 1] - cuts[d][at[d]];
      }
      holders.clear();
      for (const Piece& p : found) {
        if (contains(p.box, cell)) {
          holders.push_back(p.src);
        }
      }
      if (holders.empty()) {
        throw InvalidArgument(entry_str(i, "destination", k, want.rank) + ": element " +
                              tuple_str(cell.offset) + " of its box " + box_str(want.box) +
                              " is held by no source");
      }
      fn(std::move(cell), std::span<const std::size_t>(holders));
      for (std::size_t d = ndim; d-- > 0;) {  // the next cell, row-major
        if (++at[d] + 1 < cuts[d].size()) {
          break;
        }
        at[d] = 0;
      }
    }
  }

  // Gives `cell` to one of `holders` (source entries), split among several where it is large.
  void assign(const TensorRegions& t, int dst_rank, std::span<const std::size_t> holders, Box cell,
              std::vector<Piece>& pieces) {
    const std::uint64_t bytes = box_elements(cell) * dtype_size(t.dtype);
    std::vector<std::size_t> near = nearest(t, dst_rank, holders);
    const bool local = t.sources[near[0]].rank == dst_rank;
    if (local || near.size() < 2 || bytes < options_.split_bytes) {
      const std::size_t src = charge(t, near, cell);
      pieces.push_back({src, std::move(cell)});
      return;
    }
    for (Box& slab : slabs_of(cell, near.size())) {
      const std::size_t src = charge(t, near, slab);
      pieces.push_back({src, std::move(slab)});
      // Each replica sends one slab: the chosen one leaves the candidates.
      near.erase(std::find(near.begin(), near.end(), src));
    }
  }

  // The holders to choose among: those on the destination's rank, else on its host, else all.
  [[nodiscard]] std::vector<std::size_t> nearest(const TensorRegions& t, int dst_rank,
                                                 std::span<const std::size_t> holders) const {
    std::vector<std::size_t> same_rank;
    std::vector<std::size_t> same_host;
    for (const std::size_t j : holders) {
      const int r = t.sources[j].rank;
      if (r == dst_rank) {
        same_rank.push_back(j);
      } else if (!options_.hosts.empty() &&
                 options_.hosts[static_cast<std::size_t>(r)] ==
                     options_.hosts[static_cast<std::size_t>(dst_rank)]) {
        same_host.push_back(j);
      }
    }
    if (!same_rank.empty()) {
      return same_rank;
    }
    if (!same_host.empty()) {
      return same_host;
    }
    return {holders.begin(), holders.end()};
  }

  // The least-loaded of `candidates` (the first on a tie), charged with `box`'s bytes.
  std::size_t charge(const TensorRegions& t, std::span<const std::size_t> candidates,
                     const Box& box) {
    std::size_t best = candidates[0];
    for (const std::size_t j : candidates) {
      if (load_[rank_of(t, j)] < load_[rank_of(t, best)]) {
        best = j;
      }
    }
    load_[rank_of(t, best)] += box_elements(box) * dtype_size(t.dtype);
    return best;
  }

  static std::size_t rank_of(const TensorRegions& t, std::size_t j) {
    return static_cast<std::size_t>(t.sources[j].rank);
  }
  static std::size_t rank_of_dst(const TensorRegions& t, std::size_t k) {
    return static_cast<std::size_t>(t.destinations[k].rank);
  }
  [[nodiscard]] int host_of(int rank) const {
    return options_.hosts.empty() ? 0 : options_.hosts[static_cast<std::size_t>(rank)];
  }

  std::span<const TensorRegions> tensors_;
  int world_;
  const RegionOptions& options_;
  std::vector<std::uint64_t> load_;        // bytes each rank sends so far
  std::vector<std::uint64_t> relay_load_;  // bytes each rank receives to forward, so far
  std::vector<Transfer> transfers_;
  std::vector<Transfer> forwards_;
  // What one rank relays of one tensor for its group: its moves and forwards (index ranges).
  struct RelayUnit {
    std::size_t moves = 0;
    std::size_t moves_end = 0;
    std::size_t forwards = 0;
    std::size_t forwards_end = 0;
    std::uint64_t bytes = 0;
  };
  std::vector<RelayUnit> units_;
};

std::uint64_t fingerprint_of(std::span<const TensorRegions> tensors, int world,
                             const RegionOptions& options) {
  detail::Hasher h;
  h.add(static_cast<std::uint64_t>(world));
  h.add(tensors.size());
  h.add(options.split_bytes);
  h.add(options.fan_out ? 1 : 0);
  h.add(options.fan_out_waves);
  h.add(options.device_bucket_bytes);
  h.add(options.hosts.size());
  for (const int host : options.hosts) {
    h.add(static_cast<std::uint64_t>(host));
  }
  const auto add_boxes = [&](const std::vector<RankBox>& boxes) {
    h.add(boxes.size());
    for (const RankBox& rb : boxes) {
      h.add(static_cast<std::uint64_t>(rb.rank));
      for (std::size_t d = 0; d < rb.box.offset.size(); ++d) {
        h.add(static_cast<std::uint64_t>(rb.box.offset[d]));
        h.add(static_cast<std::uint64_t>(rb.box.size[d]));
      }
    }
  };
  for (const TensorRegions& t : tensors) {
    h.add(static_cast<std::uint64_t>(t.dtype));
    h.add(t.shape.size());
    for (const std::int64_t dim : t.shape) {
      h.add(static_cast<std::uint64_t>(dim));
    }
    add_boxes(t.sources);
    add_boxes(t.destinations);
  }
  return h.value() == 0 ? 1 : h.value();
}

// Where each (round, peer) group of one rank's side (sorted by round, then peer) begins, and the
// bytes per peer over every round.
void group_by_peer(std::vector<Transfer>& side, std::vector<std::size_t>& first,
                   std::vector<std::uint64_t>& counts, int world, std::size_t rounds,
                   const std::vector<int>& peer_of_transfer) {
  const auto w = static_cast<std::size_t>(world);
  first.assign(rounds * w + 1, 0);
  counts.assign(w, 0);
  for (std::size_t n = 0; n < side.size(); ++n) {
    const auto p = static_cast<std::size_t>(peer_of_transfer[n]);
    ++first[side[n].round * w + p + 1];
    counts[p] = detail::add_checked(counts[p], side[n].bytes, "bytes per peer");
  }
  std::partial_sum(first.begin(), first.end(), first.begin());
}

// This rank's sends and receives among `all`, each side grouped by peer in the canonical order
// (tensor, destination entry, source entry, box offset), the same on both ends of a pair.
template <typename SrcRank, typename DstRank>
void split_sides(std::vector<Transfer> all, SrcRank&& src_rank, DstRank&& dst_rank, int rank,
                 int world, std::size_t rounds, std::vector<Transfer>& sends,
                 std::vector<std::size_t>& send_first, std::vector<std::uint64_t>& send_counts,
                 std::vector<Transfer>& receives, std::vector<std::size_t>& recv_first,
                 std::vector<std::uint64_t>& recv_counts) {
  for (Transfer& x : all) {
    if (src_rank(x) == rank) {
      sends.push_back(x);
    }
    if (dst_rank(x) == rank) {
      receives.push_back(std::move(x));
    }
  }
  const auto canonical = [](const Transfer& x) {
    return std::tie(x.tensor, x.dst, x.src, x.box.offset);
  };
  std::sort(sends.begin(), sends.end(), [&](const Transfer& a, const Transfer& b) {
    return std::make_tuple(a.round, dst_rank(a), canonical(a)) <
           std::make_tuple(b.round, dst_rank(b), canonical(b));
  });
  std::sort(receives.begin(), receives.end(), [&](const Transfer& a, const Transfer& b) {
    return std::make_tuple(a.round, src_rank(a), canonical(a)) <
           std::make_tuple(b.round, src_rank(b), canonical(b));
  });
  std::vector<int> send_peer;
  std::vector<int> recv_peer;
  send_peer.reserve(sends.size());
  recv_peer.reserve(receives.size());
  for (const Transfer& x : sends) {
    send_peer.push_back(dst_rank(x));
  }
  for (const Transfer& x : receives) {
    recv_peer.push_back(src_rank(x));
  }
  group_by_peer(sends, send_first, send_counts, world, rounds, send_peer);
  group_by_peer(receives, recv_first, recv_counts, world, rounds, recv_peer);
}

}  // namespace

std::uint64_t box_elements(const Box& box) {
  std::uint64_t n = 1;
  for (const std::int64_t s : box.size) {
    n = detail::mul_checked(n, static_cast<std::uint64_t>(std::max<std::int64_t>(s, 0)),
                            "box elements");
  }
  return n;
}

Box intersect(const Box& a, const Box& b) {
  Box out{Shape(a.offset.size()), Shape(a.offset.size())};
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const std::int64_t lo = std::max(a.offset[d], b.offset[d]);
    const std::int64_t hi = std::min(a.offset[d] + a.size[d], b.offset[d] + b.size[d]);
    out.offset[d] = lo;
    out.size[d] = std::max<std::int64_t>(hi - lo, 0);
  }
  return out;
}

void check_regions(std::span<const TensorRegions> tensors, int world_size) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorRegions& t = tensors[i];
    try {
      (void)checked_nbytes(t.dtype, t.shape);
    } catch (const CountOverflow& e) {
      throw CountOverflow("tensor " + std::to_string(i) + ": " + e.what());
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("tensor " + std::to_string(i) + ": " + e.what());
    }
    for (std::size_t j = 0; j < t.sources.size(); ++j) {
      check_box(t, t.sources[j], world_size, entry_str(i, "source", j, t.sources[j].rank));
    }
    for (std::size_t k = 0; k < t.destinations.size(); ++k) {
      check_box(t, t.destinations[k], world_size,
                entry_str(i, "destination", k, t.destinations[k].rank));
    }
  }
}

namespace {

void check_region_options(int world_size, int rank, const RegionOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw InvalidArgument("plan_regions: rank " + std::to_string(rank) + " of " +
                          std::to_string(world_size));
  }
  if (!options.hosts.empty() && options.hosts.size() != static_cast<std::size_t>(world_size)) {
    throw InvalidArgument("plan_regions: " + std::to_string(options.hosts.size()) + " hosts for " +
                          std::to_string(world_size) + " ranks");
  }
  for (std::size_t r = 0; r < options.hosts.size(); ++r) {
    if (options.hosts[r] < 0 || options.hosts[r] >= world_size) {
      throw InvalidArgument("plan_regions: rank " + std::to_string(r) + "'s host is " +
                            std::to_string(options.hosts[r]) + ", not in [0, " +
                            std::to_string(world_size) + ")");
    }
  }
  if (options.fan_out_waves < 1) {
    throw InvalidArgument(
        "plan_regions: fan_out_waves is 0 (1 or more: 1 forwards after the "
        "whole first exchange)");
  }
  if (options.device_bucket_bytes < 1) {
    throw InvalidArgument("plan_regions: device_bucket_bytes is 0 (1 or more)");
  }
}

// The byte figures per rank and per host (RegionPlan's rank_* and host_*), over all transfers.
template <typename SrcRank, typename DstRank>
void count_bytes(RegionPlan& plan, const std::vector<Transfer>& all, SrcRank&& src_rank,
                 DstRank&& dst_rank, const std::vector<int>& hosts) {
  for (const Transfer& x : all) {
    const auto s = static_cast<std::size_t>(src_rank(x));
    const auto d = static_cast<std::size_t>(dst_rank(x));
    plan.rank_sent[s] = detail::add_checked(plan.rank_sent[s], x.bytes, "bytes a rank sends");
    plan.rank_received[d] =
        detail::add_checked(plan.rank_received[d], x.bytes, "bytes a rank receives");
    plan.rank_local[s] += s == d ? x.bytes : 0;  // at most rank_sent[s]
    if (!hosts.empty() && hosts[s] != hosts[d]) {
      std::uint64_t& out = plan.host_sent[static_cast<std::size_t>(hosts[s])];
      std::uint64_t& in = plan.host_received[static_cast<std::size_t>(hosts[d])];
      out = detail::add_checked(out, x.bytes, "bytes a host sends");
      in = detail::add_checked(in, x.bytes, "bytes a host receives");
    }
  }
}

// Adds each transfer's bytes to what its two ranks move to and from others in its exchange
// (`moved`: rounds x world).
template <typename SrcRank, typename DstRank>
void tally_exchanges(std::vector<std::uint64_t>& moved, std::size_t world,
                     const std::vector<Transfer>& all, SrcRank&& src_rank, DstRank&& dst_rank) {
  for (const Transfer& x : all) {
    const auto s = static_cast<std::size_t>(src_rank(x));
    const auto d = static_cast<std::size_t>(dst_rank(x));
    if (s != d) {
      for (const std::size_t r : {s, d}) {
        std::uint64_t& m = moved[x.round * world + r];
        m = detail::add_checked(m, x.bytes, "bytes a rank moves in one exchange");
      }
    }
  }
}

void add_local_views(RegionPlan& plan, std::span<const TensorRegions> tensors, int rank) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    for (std::size_t j = 0; j < tensors[i].sources.size(); ++j) {
      if (tensors[i].sources[j].rank == rank) {
        plan.source_views.push_back({i, j});
      }
    }
    for (std::size_t k = 0; k < tensors[i].destinations.size(); ++k) {
      if (tensors[i].destinations[k].rank == rank) {
        plan.destination_views.push_back({i, k});
      }
    }
  }
}

}  // namespace

namespace {
std::atomic<std::uint64_t> g_plan_regions_runs{0};
}  // namespace

std::uint64_t plan_regions_runs() noexcept {
  return g_plan_regions_runs.load(std::memory_order_relaxed);
}

RegionPlan plan_regions(std::span<const TensorRegions> tensors, int world_size, int rank,
                        const RegionOptions& options) {
  g_plan_regions_runs.fetch_add(1, std::memory_order_relaxed);
  check_region_options(world_size, rank, options);
  check_regions(tensors, world_size);
  Planner planner(tensors, world_size, options);
  std::vector<Transfer> moves = planner.run();
  std::vector<Transfer> forwards = planner.take_forwards();
  RegionPlan plan;
  plan.world_size = world_size;
  plan.rank = rank;
  plan.fingerprint = fingerprint_of(tensors, world_size, options);
  const auto world = static_cast<std::size_t>(world_size);
  plan.rank_sent.assign(world, 0);
  plan.rank_received.assign(world, 0);
  plan.rank_local.assign(world, 0);
  if (!options.hosts.empty()) {
    const auto hosts =
        static_cast<std::size_t>(*std::max_element(options.hosts.begin(), options.hosts.end())) + 1;
    plan.host_sent.assign(hosts, 0);
    plan.host_received.assign(hosts, 0);
  }
  plan.forwarding = !forwards.empty();
  const auto dst_rank = [&](const Transfer& x) {
    return tensors[x.tensor].destinations[x.dst].rank;
  };
  // A move's sender holds a source entry; a forward's, a destination entry.
  const auto source_rank = [&](const Transfer& x) { return tensors[x.tensor].sources[x.src].rank; };
  const auto forwarder_rank = [&](const Transfer& x) {
    return tensors[x.tensor].destinations[x.src].rank;
  };
  count_bytes(plan, moves, source_rank, dst_rank, options.hosts);
  count_bytes(plan, forwards, forwarder_rank, dst_rank, options.hosts);
  plan.rounds = planner.rounds;
  // The busiest rank's bytes sent plus received to and from others, in its busiest exchange.
  std::vector<std::uint64_t> moved(plan.rounds * world, 0);
  tally_exchanges(moved, world, moves, source_rank, dst_rank);
  tally_exchanges(moved, world, forwards, forwarder_rank, dst_rank);
  const std::uint64_t bucket = options.device_bucket_bytes;
  for (const std::uint64_t m : moved) {
    plan.device_parts = std::max(plan.device_parts, m / bucket + (m % bucket != 0 ? 1 : 0));
  }
  split_sides(std::move(moves), source_rank, dst_rank, plan.rank, world_size, plan.rounds,
              plan.sends, plan.send_first, plan.send_counts, plan.receives, plan.recv_first,
              plan.recv_counts);
  split_sides(std::move(forwards), forwarder_rank, dst_rank, plan.rank, world_size, plan.rounds,
              plan.forwards, plan.forward_first, plan.forward_counts, plan.forwarded,
              plan.forwarded_first, plan.forwarded_counts);
  add_local_views(plan, tensors, rank);
  return plan;
}

}  // namespace shardgather
