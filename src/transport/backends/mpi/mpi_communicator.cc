#include "transport/backends/mpi/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <string>
#include <thread>

#include "transport/backends/mpi/check_mpi.h"
#include "transport/op_queue.h"
#include <sched.h>

#include "shardgather/copy.h"
#include "shardgather/errors.h"

namespace shardgather {

namespace detail {

namespace {

// Cached datatypes: a gather needs one send type and one set of receive types per call, a
// personal exchange a send type per peer and one set of receive types, and a reshard with a
// fan-out runs up to its waves + 1 exchanges per execution (5 by default). Room for 16 exchanges
// to every peer keeps a plan's steady state from rebuilding them, up to 64 peers; the search is
// linear, so past that the send cache stops growing (and larger groups rebuild their send types
// per exchange, as every group did before).
constexpr std::size_t kTypeCacheSize = 16;
constexpr std::size_t kMaxSendCache = 1024;
std::size_t send_cache_size(int world) {
  return std::min(kTypeCacheSize * (1 + static_cast<std::size_t>(world)), kMaxSendCache);
}
constexpr std::chrono::microseconds kProgressPoll{200};
constexpr auto kIntMax = static_cast<std::uint64_t>(INT_MAX);

// One run of memory in a datatype: `count` blocks of `block` bytes, `stride` apart.
struct Run {
  const std::byte* data;
  std::uint64_t block;
  std::uint64_t count;
  std::uint64_t stride;
};

bool same_segments(std::span<const ConstSegment> a, std::span<const ConstSegment> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](auto& x, auto& y) {
           return x.data == y.data && x.size == y.size;
         });
}

bool same_pieces(std::span<const RecvPiece> a, std::span<const RecvPiece> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](auto& x, auto& y) {
           return x.data == y.data && x.block == y.block && x.count == y.count &&
                  x.stride == y.stride;
         });
}

std::vector<Run> runs_of(std::span<const ConstSegment> segments) {
  std::vector<Run> runs;
  for (const ConstSegment& s : segments) {
    if (s.size != 0) {
      runs.push_back({s.data, s.size, 1, 0});
    }
  }
  return runs;
}

std::vector<Run> runs_of(std::span<const RecvPiece> pieces) {
  std::vector<Run> runs;
  for (const RecvPiece& p : pieces) {
    if (p.block != 0 && p.count != 0) {
      runs.push_back({p.data, p.block, p.count, p.stride});
    }
  }
  return runs;
}

// A committed datatype over absolute addresses (use with MPI_BOTTOM) covering `runs` in order.
// Blocks and counts above INT_MAX are split, so nothing narrows.
MPI_Datatype build_type(std::span<const Run> runs, int rank) {
  std::vector<int> ones;
  std::vector<MPI_Aint> addresses;
  std::vector<MPI_Datatype> types;
  const auto add = [&](const std::byte* data, MPI_Datatype type) {
    MPI_Aint address = 0;
    SHARDGATHER_CHECK_MPI(rank, MPI_Get_address(data, &address));
    ones.push_back(1);
    addresses.push_back(address);
    types.push_back(type);
  };
  const auto add_bytes = [&](const std::byte* data, std::uint64_t n) {
    for (std::uint64_t done = 0; done < n;) {
      const std::uint64_t len = std::min(n - done, kIntMax);
      MPI_Datatype type = MPI_DATATYPE_NULL;
      SHARDGATHER_CHECK_MPI(rank, MPI_Type_contiguous(static_cast<int>(len), MPI_BYTE, &type));
      add(data + done, type);
      done += len;
    }
  };
  for (const Run& run : runs) {
    if (run.count == 1 || run.block > kIntMax) {
      for (std::uint64_t k = 0; k < run.count; ++k) {
        add_bytes(run.data + k * run.stride, run.block);
      }
      continue;
    }
    for (std::uint64_t done = 0; done < run.count;) {
      const std::uint64_t n = std::min(run.count - done, kIntMax);
      MPI_Datatype type = MPI_DATATYPE_NULL;
      // A byte-type block of `block` bytes, repeated `n` times `stride` apart.
      MPI_Datatype row = MPI_DATATYPE_NULL;
      SHARDGATHER_CHECK_MPI(rank, MPI_Type_contiguous(static_cast<int>(run.block), MPI_BYTE, &row));
      SHARDGATHER_CHECK_MPI(
          rank, MPI_Type_create_hvector(static_cast<int>(n), 1, static_cast<MPI_Aint>(run.stride),
                                        row, &type));
      MPI_Type_free(&row);
      add(run.data + done * run.stride, type);
      done += n;
    }
  }
  if (ones.size() > kIntMax) {
    throw CountOverflow("rank " + std::to_string(rank) + ": " + std::to_string(ones.size()) +
                        " datatype blocks exceed MPI's int count");
  }
  MPI_Datatype type = MPI_DATATYPE_NULL;
  SHARDGATHER_CHECK_MPI(rank, MPI_Type_create_struct(static_cast<int>(ones.size()), ones.data(),
                                                     addresses.data(), types.data(), &type));
  SHARDGATHER_CHECK_MPI(rank, MPI_Type_commit(&type));
  for (MPI_Datatype& t : types) {
    MPI_Type_free(&t);  // the struct keeps what it needs
  }
  return type;
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, const MpiOptions& options) : options_(options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) {
    throw InvalidArgument("make_mpi_communicator: MPI is not initialised (call MPI_Init first)");
  }
  if (comm == MPI_COMM_NULL) {
    throw InvalidArgument("make_mpi_communicator: MPI_COMM_NULL");
  }
  if (options_.max_chunk_bytes == 0 || options_.max_chunk_bytes > kIntMax) {
    throw InvalidArgument("make_mpi_communicator: max_chunk_bytes must be in [1, INT_MAX]");
  }
  SHARDGATHER_CHECK_MPI(-1, MPI_Comm_dup(comm, &comm_));
  // Errors come back as return codes and become exceptions; MPI must not abort the job.
  SHARDGATHER_CHECK_MPI(-1, MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  SHARDGATHER_CHECK_MPI(-1, MPI_Comm_rank(comm_, &rank_));
  SHARDGATHER_CHECK_MPI(-1, MPI_Comm_size(comm_, &size_));
  MPI_Comm local = MPI_COMM_NULL;
  SHARDGATHER_CHECK_MPI(
      rank_, MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
  SHARDGATHER_CHECK_MPI(rank_, MPI_Comm_size(local, &ranks_on_host_));
  // A host is named by its lowest rank; every rank learns every rank's host.
  int leader = rank_;
  SHARDGATHER_CHECK_MPI(rank_, MPI_Allreduce(&rank_, &leader, 1, MPI_INT, MPI_MIN, local));
  SHARDGATHER_CHECK_MPI(rank_, MPI_Comm_free(&local));
  std::vector<int> leaders(static_cast<std::size_t>(size_));
  SHARDGATHER_CHECK_MPI(rank_,
                        MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, comm_));
  hosts_.resize(leaders.size());
  int next_host = 0;
  for (std::size_t r = 0; r < leaders.size(); ++r) {
    // A host's leader is its lowest rank, so it is numbered before any of its other ranks.
    hosts_[r] = leaders[r] == static_cast<int>(r) ? next_host++
                                                  : hosts_[static_cast<std::size_t>(leaders[r])];
  }
  const unsigned cores = std::thread::hardware_concurrency();
  oversubscribed_ = options_.wait == MpiOptions::Wait::kYield ||
                    (options_.wait == MpiOptions::Wait::kAuto && cores != 0 &&
                     static_cast<unsigned>(ranks_on_host_) > cores);
}

MpiCommunicator::~MpiCommunicator() {
  finish_operations();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) {
    return;
  }
  for (SendType& cached : type_cache_) {
    MPI_Type_free(&cached.type);
  }
  for (RecvTypes& cached : recv_cache_) {
    for (MPI_Datatype& type : cached.types) {
      if (type != MPI_DATATYPE_NULL) {
        MPI_Type_free(&type);
      }
    }
  }
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::wait(MPI_Request& request, Deadline deadline, const char* what) {
  const bool started = OpQueue::on_progress_thread();
  for (std::uint64_t spins = 0;; ++spins) {
    int done = 0;
    SHARDGATHER_CHECK_MPI(rank_, MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done != 0) {
      return;
    }
    if (abort_requested_.load(std::memory_order_relaxed)) {
      throw Aborted("rank " + std::to_string(rank_) + ": abort() while in " + what +
                    "; the posted MPI operation cannot be cancelled, end the process");
    }
    if ((spins & 0xffU) == 0 && Clock::now() >= deadline) {
      throw Timeout("rank " + std::to_string(rank_) + ": " + what +
                    " passed its deadline waiting for peers (MPI cannot cancel it: the "
                    "communicator is poisoned; end the process or the job)");
    }
    if (started && spins > 16 && !operations().awaited()) {
      // A started operation: its caller computes meanwhile, so poll without holding a core.
      // Open MPI progresses only inside MPI calls; between polls the kernel's socket buffers
      // keep the transfer going, and kProgressPoll is short against the time they take to drain.
      // Once the caller waits for it there is no computation to protect: full speed (over
      // shared memory each poll moves one fragment, so sleeping would bound the bandwidth).
      std::this_thread::sleep_for(kProgressPoll);
    } else if (oversubscribed_ && spins > 64) {
      // Yield only when ranks outnumber cores here: otherwise it costs a syscall per test and
      // delays the progress that only MPI_Test makes.
      sched_yield();
    }
  }
}

MPI_Datatype MpiCommunicator::send_type(std::span<const ConstSegment> segments) {
  for (std::size_t k = 0; k < type_cache_.size(); ++k) {
    if (same_segments(type_cache_[k].segments, segments)) {
      std::rotate(type_cache_.begin() + static_cast<std::ptrdiff_t>(k),
                  type_cache_.begin() + static_cast<std::ptrdiff_t>(k) + 1, type_cache_.end());
      return type_cache_.back().type;
    }
  }
  const std::vector<Run> runs = runs_of(segments);
  MPI_Datatype type = build_type(runs, rank_);
  if (type_cache_.size() >= send_cache_size(size_)) {
    MPI_Type_free(&type_cache_.front().type);
    type_cache_.erase(type_cache_.begin());
  }
  type_cache_.push_back({std::vector<ConstSegment>(segments.begin(), segments.end()), type});
  return type;
}

const std::vector<MPI_Datatype>& MpiCommunicator::recv_types(std::span<const RecvPiece> pieces,
                                                             std::span<const std::size_t> first) {
  for (std::size_t k = 0; k < recv_cache_.size(); ++k) {
    if (same_pieces(recv_cache_[k].pieces, pieces) &&
        std::equal(first.begin(), first.end(), recv_cache_[k].first.begin(),
                   recv_cache_[k].first.end())) {
      std::rotate(recv_cache_.begin() + static_cast<std::ptrdiff_t>(k),
                  recv_cache_.begin() + static_cast<std::ptrdiff_t>(k) + 1, recv_cache_.end());
      return recv_cache_.back().types;
    }
  }
  RecvTypes entry{std::vector<RecvPiece>(pieces.begin(), pieces.end()),
                  std::vector<std::size_t>(first.begin(), first.end()),
                  {}};
  for (std::size_t r = 0; r + 1 < first.size(); ++r) {
    const std::vector<Run> runs = runs_of(rank_part(pieces, first, r));
    entry.types.push_back(runs.empty() ? MPI_DATATYPE_NULL : build_type(runs, rank_));
  }
  if (recv_cache_.size() == kTypeCacheSize) {
    for (MPI_Datatype& type : recv_cache_.front().types) {
      if (type != MPI_DATATYPE_NULL) {
        MPI_Type_free(&type);
      }
    }
    recv_cache_.erase(recv_cache_.begin());
  }
  recv_cache_.push_back(std::move(entry));
  return recv_cache_.back().types;
}

void MpiCommunicator::do_all_gather_scatter(std::span<const ConstSegment> send,
                                            std::span<const RecvPiece> pieces,
                                            std::span<const std::size_t> first,
                                            std::span<const std::uint64_t> counts,
                                            Deadline deadline) {
  const std::uint64_t largest = *std::max_element(counts.begin(), counts.end());
  if (largest > options_.max_chunk_bytes) {
    all_gather_scatter_chunked(send, pieces, first, counts, deadline);
    return;
  }
  scatter_alltoallw(send, pieces, first, counts, -1, deadline, "all_gather_scatter");
}

void MpiCommunicator::scatter_alltoallw(std::span<const ConstSegment> send,
                                        std::span<const RecvPiece> pieces,
                                        std::span<const std::size_t> first,
                                        std::span<const std::uint64_t> counts, int root,
                                        Deadline deadline, const char* what) {
  // One MPI_Ialltoallw: the same send type to every receiver, a receive type per source rank
  // that lands every byte in its final place. Both are over absolute addresses (MPI_BOTTOM).
  const auto world = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  MPI_Datatype send_dt = counts[me] == 0 ? MPI_BYTE : send_type(send);
  zeros_.assign(world, 0);
  send_counts_.assign(world, 0);
  recv_counts_.assign(world, 0);
  send_types_.assign(2 * world, MPI_BYTE);
  for (std::size_t r = 0; r < world; ++r) {
    if (root < 0 || r == static_cast<std::size_t>(root)) {
      send_counts_[r] = counts[me] == 0 ? 0 : 1;
      send_types_[r] = send_dt;
    }
  }
  if (root < 0 || root == rank_) {
    const std::vector<MPI_Datatype>& recv = recv_types(pieces, first);
    for (std::size_t r = 0; r < world; ++r) {
      recv_counts_[r] = counts[r] == 0 ? 0 : 1;
      send_types_[world + r] = counts[r] == 0 ? MPI_BYTE : recv[r];
    }
  }
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDGATHER_CHECK_MPI(
      rank_, MPI_Ialltoallw(MPI_BOTTOM, send_counts_.data(), zeros_.data(), send_types_.data(),
                            MPI_BOTTOM, recv_counts_.data(), zeros_.data(),
                            send_types_.data() + world, comm_, &request));
  wait(request, deadline, what);
}

void MpiCommunicator::all_gather_scatter_chunked(std::span<const ConstSegment> send,
                                                 std::span<const RecvPiece> pieces,
                                                 std::span<const std::size_t> first,
                                                 std::span<const std::uint64_t> counts,
                                                 Deadline deadline) {
  const std::uint64_t chunk = options_.max_chunk_bytes;
  const auto me = static_cast<std::size_t>(rank_);
  copy_stream(send, rank_part(pieces, first, me));
  for (int root = 0; root < size_; ++root) {
    const auto r = static_cast<std::size_t>(root);
    const auto mine = rank_part(pieces, first, r);
    for (std::uint64_t begin = 0; begin < counts[r]; begin += chunk) {
      const std::uint64_t end = std::min(counts[r], begin + chunk);
      const std::vector<RecvPiece> slice =
          root == rank_ ? slice_segments(send, begin, end) : slice_pieces(mine, begin, end);
      const std::vector<Run> runs = runs_of(std::span<const RecvPiece>(slice));
      MPI_Datatype type = build_type(runs, rank_);
      MPI_Request request = MPI_REQUEST_NULL;
      SHARDGATHER_CHECK_MPI(rank_, MPI_Ibcast(MPI_BOTTOM, 1, type, root, comm_, &request));
      MPI_Type_free(&type);  // MPI keeps it alive until the broadcast completes
      wait(request, deadline, "all_gather_scatter (chunked)");
    }
  }
}

void MpiCommunicator::do_gather_scatter(std::span<const ConstSegment> send,
                                        std::span<const RecvPiece> pieces,
                                        std::span<const std::size_t> first,
                                        std::span<const std::uint64_t> counts, int root,
                                        Deadline deadline) {
  const std::uint64_t largest = *std::max_element(counts.begin(), counts.end());
  if (largest > options_.max_chunk_bytes) {
    gather_scatter_chunked(send, pieces, first, counts, root, deadline);
    return;
  }
  // One MPI_Ialltoallw in which only the root receives: MPI_Igatherv takes one receive type for
  // every sender, so it could not land each sender's bytes in its scattered final place as a
  // receive type per sender does. Every non-root sends its stream once, to the root only.
  scatter_alltoallw(send, pieces, first, counts, root, deadline, "gather_scatter");
}

void MpiCommunicator::gather_scatter_chunked(std::span<const ConstSegment> send,
                                             std::span<const RecvPiece> pieces,
                                             std::span<const std::size_t> first,
                                             std::span<const std::uint64_t> counts, int root,
                                             Deadline deadline) {
  constexpr int kTag = 0x5347;  // on this communicator's own duplicate: nothing else sends
  const std::uint64_t chunk = options_.max_chunk_bytes;
  const auto me = static_cast<std::size_t>(rank_);
  if (rank_ == root) {
    copy_stream(send, rank_part(pieces, first, me));
  }
  for (int sender = 0; sender < size_; ++sender) {
    if (sender == root || (rank_ != root && rank_ != sender)) {
      continue;
    }
    const auto s = static_cast<std::size_t>(sender);
    const auto theirs =
        pieces.subspan(rank_ == root ? first[s] : 0, rank_ == root ? first[s + 1] - first[s] : 0);
    for (std::uint64_t begin = 0; begin < counts[s]; begin += chunk) {
      const std::uint64_t end = std::min(counts[s], begin + chunk);
      const std::vector<RecvPiece> slice =
          rank_ == root ? slice_pieces(theirs, begin, end) : slice_segments(send, begin, end);
      MPI_Datatype type = build_type(runs_of(std::span<const RecvPiece>(slice)), rank_);
      MPI_Request request = MPI_REQUEST_NULL;
      const int status = rank_ == root
                             ? MPI_Irecv(MPI_BOTTOM, 1, type, sender, kTag, comm_, &request)
                             : MPI_Isend(MPI_BOTTOM, 1, type, root, kTag, comm_, &request);
      MPI_Type_free(&type);  // MPI keeps it alive until the transfer completes
      SHARDGATHER_CHECK_MPI(rank_, status);
      wait(request, deadline, "gather_scatter (chunked)");
    }
  }
}

void MpiCommunicator::do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                                    Deadline deadline) {
  if (recv.size() > kIntMax) {
    throw CountOverflow("rank " + std::to_string(rank_) + ": all_gather of " +
                        std::to_string(recv.size()) + " bytes exceeds INT_MAX");
  }
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDGATHER_CHECK_MPI(
      rank_, MPI_Iallgather(send.data(), static_cast<int>(send.size()), MPI_BYTE, recv.data(),
                            static_cast<int>(send.size()), MPI_BYTE, comm_, &request));
  wait(request, deadline, "all_gather");
}

void MpiCommunicator::do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                                      std::span<const std::uint64_t> counts,
                                      std::span<const std::uint64_t> displs, Deadline deadline) {
  const bool fits_int =
      std::all_of(counts.begin(), counts.end(), [](std::uint64_t c) { return c <= kIntMax; }) &&
      std::all_of(displs.begin(), displs.end(), [](std::uint64_t d) { return d <= kIntMax; });
  const std::uint64_t largest = *std::max_element(counts.begin(), counts.end());
  if (!fits_int || largest > options_.max_chunk_bytes) {
    all_gather_v_chunked(send, recv, counts, displs, deadline);
    return;
  }
  int_counts_.resize(counts.size());
  int_displs_.resize(displs.size());
  std::transform(counts.begin(), counts.end(), int_counts_.begin(),
                 [](std::uint64_t c) { return static_cast<int>(c); });
  std::transform(displs.begin(), displs.end(), int_displs_.begin(),
                 [](std::uint64_t d) { return static_cast<int>(d); });

  const void* send_buf = recv;  // any valid address when nothing is sent
  int send_count = 0;
  MPI_Datatype type = MPI_BYTE;
  std::size_t nonempty = 0;
  const ConstSegment* only = nullptr;
  for (const ConstSegment& s : send) {
    if (s.size != 0) {
      ++nonempty;
      only = &s;
    }
  }
  if (nonempty == 1) {
    send_buf = only->data;
    send_count = static_cast<int>(only->size);
  } else if (nonempty > 1) {
    send_buf = MPI_BOTTOM;
    send_count = 1;
    type = send_type(send);
  }
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDGATHER_CHECK_MPI(rank_, MPI_Iallgatherv(send_buf, send_count, type, recv, int_counts_.data(),
                                               int_displs_.data(), MPI_BYTE, comm_, &request));
  wait(request, deadline, "all_gather_v");
}

void MpiCommunicator::all_gather_v_chunked(std::span<const ConstSegment> send, std::byte* recv,
                                           std::span<const std::uint64_t> counts,
                                           std::span<const std::uint64_t> displs,
                                           Deadline deadline) {
  const std::uint64_t chunk = options_.max_chunk_bytes;
  const auto me = static_cast<std::size_t>(rank_);
  copy_segments(send, recv + displs[me]);
  for (int root = 0; root < size_; ++root) {
    const auto r = static_cast<std::size_t>(root);
    for (std::uint64_t begin = 0; begin < counts[r]; begin += chunk) {
      const std::uint64_t len = std::min(chunk, counts[r] - begin);
      MPI_Request request = MPI_REQUEST_NULL;
      if (root == rank_) {
        // Broadcast straight from the segments; the datatype covers just this chunk.
        const std::vector<RecvPiece> slice = slice_segments(send, begin, begin + len);
        MPI_Datatype type = build_type(runs_of(std::span<const RecvPiece>(slice)), rank_);
        SHARDGATHER_CHECK_MPI(rank_, MPI_Ibcast(MPI_BOTTOM, 1, type, root, comm_, &request));
        MPI_Type_free(&type);  // MPI keeps it alive until the broadcast completes
      } else {
        SHARDGATHER_CHECK_MPI(rank_, MPI_Ibcast(recv + displs[r] + begin, static_cast<int>(len),
                                                MPI_BYTE, root, comm_, &request));
      }
      wait(request, deadline, "all_gather_v (chunked)");
    }
  }
}

void MpiCommunicator::do_all_to_all_scatter(std::span<const ConstSegment> send,
                                            std::span<const std::size_t> send_first,
                                            std::span<const RecvPiece> pieces,
                                            std::span<const std::size_t> first, Deadline deadline) {
  const auto me = static_cast<std::size_t>(rank_);
  copy_stream(rank_part(send, send_first, me), rank_part(pieces, first, me));
  if (options_.exchange == MpiOptions::Exchange::kAlltoallw) {
    personal_alltoallw(send, send_first, pieces, first, deadline);
    personal_point_to_point(send, send_first, pieces, first, true, deadline);
  } else {
    personal_point_to_point(send, send_first, pieces, first, false, deadline);
  }
}

void MpiCommunicator::personal_point_to_point(std::span<const ConstSegment> send,
                                              std::span<const std::size_t> send_first,
                                              std::span<const RecvPiece> pieces,
                                              std::span<const std::size_t> first, bool above_chunk,
                                              Deadline deadline) {
  constexpr int kTag = 0x5348;  // on this communicator's own duplicate, one call at a time
  const std::uint64_t chunk = options_.max_chunk_bytes;
  const auto world = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  const auto to = [&](std::size_t p) { return rank_part(send, send_first, p); };
  const auto from = [&](std::size_t q) { return rank_part(pieces, first, q); };
  requests_.clear();
  // One message per pair from the datatype caches; above max_chunk_bytes, one per chunk.
  const auto post = [&](MPI_Datatype type, bool owned, int peer, bool recv) {
    MPI_Request request = MPI_REQUEST_NULL;
    const int status = recv ? MPI_Irecv(MPI_BOTTOM, 1, type, peer, kTag, comm_, &request)
                            : MPI_Isend(MPI_BOTTOM, 1, type, peer, kTag, comm_, &request);
    if (owned) {
      MPI_Type_free(&type);  // MPI keeps it alive until the transfer completes
    }
    SHARDGATHER_CHECK_MPI(rank_, status);
    requests_.push_back(request);
  };
  const auto post_chunks = [&](const std::vector<RecvPiece>& run, std::uint64_t bytes, int peer,
                               bool recv) {
    for (std::uint64_t begin = 0; begin < bytes; begin += chunk) {
      const std::vector<RecvPiece> slice = slice_pieces(run, begin, std::min(bytes, begin + chunk));
      post(build_type(runs_of(std::span<const RecvPiece>(slice)), rank_), true, peer, recv);
    }
  };
  // Receives first, then sends, each starting at a different peer on every rank.
  const std::vector<MPI_Datatype>* recv_dt = nullptr;
  for (std::size_t k = 1; k < world; ++k) {
    const std::size_t q = (me + world - k) % world;
    const std::uint64_t bytes = stream_bytes(from(q));
    if (bytes > chunk) {
      post_chunks(std::vector<RecvPiece>(from(q).begin(), from(q).end()), bytes,
                  static_cast<int>(q), true);
    } else if (bytes != 0 && !above_chunk) {
      recv_dt = recv_dt != nullptr ? recv_dt : &recv_types(pieces, first);
      post((*recv_dt)[q], false, static_cast<int>(q), true);
    }
  }
  for (std::size_t k = 1; k < world; ++k) {
    const std::size_t p = (me + k) % world;
    const std::uint64_t bytes = stream_bytes(to(p));
    if (bytes > chunk) {
      post_chunks(slice_segments(to(p), 0, bytes), bytes, static_cast<int>(p), false);
    } else if (bytes != 0 && !above_chunk) {
      post(send_type(to(p)), false, static_cast<int>(p), false);
    }
  }
  for (MPI_Request& request : requests_) {
    wait(request, deadline, "all_to_all_scatter");
  }
}

void MpiCommunicator::personal_alltoallw(std::span<const ConstSegment> send,
                                         std::span<const std::size_t> send_first,
                                         std::span<const RecvPiece> pieces,
                                         std::span<const std::size_t> first, Deadline deadline) {
  const std::uint64_t chunk = options_.max_chunk_bytes;
  const auto world = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  zeros_.assign(world, 0);
  send_counts_.assign(world, 0);
  recv_counts_.assign(world, 0);
  send_types_.assign(2 * world, MPI_BYTE);
  // Fetched types are the most recently used, and the send cache holds more than world of them
  // up to 63 peers; past that one could be evicted (and freed) before the collective below, so a
  // large group's send types are built for this call and freed once it is posted (MPI keeps
  // them until the exchange completes).
  const bool cached = send_cache_size(size_) > world;
  owned_types_.clear();
  const std::vector<MPI_Datatype>* recv_dt = nullptr;
  for (std::size_t p = 0; p < world; ++p) {
    const std::uint64_t out = stream_bytes(rank_part(send, send_first, p));
    const std::uint64_t in = stream_bytes(rank_part(pieces, first, p));
    if (p != me && out != 0 && out <= chunk) {
      send_counts_[p] = 1;
      if (cached) {
        send_types_[p] = send_type(rank_part(send, send_first, p));
      } else {
        send_types_[p] = build_type(runs_of(rank_part(send, send_first, p)), rank_);
        owned_types_.push_back(send_types_[p]);
      }
    }
    if (p != me && in != 0 && in <= chunk) {
      recv_dt = recv_dt != nullptr ? recv_dt : &recv_types(pieces, first);
      recv_counts_[p] = 1;
      send_types_[world + p] = (*recv_dt)[p];
    }
  }
  MPI_Request request = MPI_REQUEST_NULL;
  const int mpi_ialltoallw_rc = MPI_Ialltoallw(
      MPI_BOTTOM, send_counts_.data(), zeros_.data(), send_types_.data(), MPI_BOTTOM,
      recv_counts_.data(), zeros_.data(), send_types_.data() + world, comm_, &request);
  for (MPI_Datatype& type : owned_types_) {
    MPI_Type_free(&type);
  }
  SHARDGATHER_CHECK_MPI(rank_, mpi_ialltoallw_rc);
  wait(request, deadline, "all_to_all_scatter (alltoallw)");
}

void MpiCommunicator::do_barrier(Deadline deadline) {
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDGATHER_CHECK_MPI(rank_, MPI_Ibarrier(comm_, &request));
  wait(request, deadline, "barrier");
}

}  // namespace detail

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const MpiOptions& options) {
  return std::make_unique<detail::MpiCommunicator>(comm, options);
}

}  // namespace shardgather
