#include "backends/mpi/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <string>

#include "detail/check_mpi.h"
#include <sched.h>

#include "shardgather/copy.h"
#include "shardgather/errors.h"

namespace shardgather {

namespace detail {

namespace {

constexpr std::size_t kTypeCacheSize = 8;
constexpr auto kIntMax = static_cast<std::uint64_t>(INT_MAX);

bool same_segments(std::span<const ConstSegment> a, std::span<const ConstSegment> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](auto& x, auto& y) {
           return x.data == y.data && x.size == y.size;
         });
}

// Pieces of the byte range [begin, end) of the concatenation of `segments`.
std::vector<ConstSegment> slice_segments(std::span<const ConstSegment> segments,
                                         std::uint64_t begin, std::uint64_t end) {
  std::vector<ConstSegment> out;
  std::uint64_t pos = 0;
  for (const ConstSegment& s : segments) {
    const std::uint64_t lo = std::max(begin, pos);
    const std::uint64_t hi = std::min(end, pos + s.size);
    if (lo < hi) {
      out.push_back({s.data + (lo - pos), hi - lo});
    }
    pos += s.size;
    if (pos >= end) {
      break;
    }
  }
  return out;
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
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) {
    return;
  }
  for (SendType& cached : type_cache_) {
    MPI_Type_free(&cached.type);
  }
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::wait(MPI_Request& request, Deadline deadline, const char* what) {
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
    if (spins > 64) {
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
  std::vector<int> lengths;
  std::vector<MPI_Aint> addresses;
  for (const ConstSegment& s : segments) {
    // A segment longer than INT_MAX becomes several blocks, so no length narrows.
    for (std::uint64_t done = 0; done < s.size;) {
      const std::uint64_t len = std::min(s.size - done, kIntMax);
      MPI_Aint address = 0;
      SHARDGATHER_CHECK_MPI(rank_, MPI_Get_address(s.data + done, &address));
      lengths.push_back(static_cast<int>(len));
      addresses.push_back(address);
      done += len;
    }
  }
  if (lengths.size() > kIntMax) {
    throw CountOverflow("rank " + std::to_string(rank_) + ": " + std::to_string(lengths.size()) +
                        " send blocks exceed MPI's int count");
  }
  MPI_Datatype type = MPI_DATATYPE_NULL;
  SHARDGATHER_CHECK_MPI(rank_,
                        MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                                 addresses.data(), MPI_BYTE, &type));
  SHARDGATHER_CHECK_MPI(rank_, MPI_Type_commit(&type));
  if (type_cache_.size() == kTypeCacheSize) {
    MPI_Type_free(&type_cache_.front().type);
    type_cache_.erase(type_cache_.begin());
  }
  type_cache_.push_back({std::vector<ConstSegment>(segments.begin(), segments.end()), type});
  return type;
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
        const std::vector<ConstSegment> pieces = slice_segments(send, begin, begin + len);
        if (pieces.size() == 1) {
          SHARDGATHER_CHECK_MPI(
              rank_, MPI_Ibcast(const_cast<std::byte*>(pieces[0].data), static_cast<int>(len),
                                MPI_BYTE, root, comm_, &request));
          wait(request, deadline, "all_gather_v (chunked)");
        } else {
          std::vector<int> lengths;
          std::vector<MPI_Aint> addresses;
          for (const ConstSegment& p : pieces) {
            MPI_Aint address = 0;
            SHARDGATHER_CHECK_MPI(rank_, MPI_Get_address(p.data, &address));
            lengths.push_back(static_cast<int>(p.size));
            addresses.push_back(address);
          }
          MPI_Datatype type = MPI_DATATYPE_NULL;
          SHARDGATHER_CHECK_MPI(
              rank_, MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                              addresses.data(), MPI_BYTE, &type));
          SHARDGATHER_CHECK_MPI(rank_, MPI_Type_commit(&type));
          SHARDGATHER_CHECK_MPI(rank_, MPI_Ibcast(MPI_BOTTOM, 1, type, root, comm_, &request));
          MPI_Type_free(&type);  // MPI keeps it alive until the broadcast completes
          wait(request, deadline, "all_gather_v (chunked)");
        }
      } else {
        SHARDGATHER_CHECK_MPI(rank_, MPI_Ibcast(recv + displs[r] + begin, static_cast<int>(len),
                                                MPI_BYTE, root, comm_, &request));
        wait(request, deadline, "all_gather_v (chunked)");
      }
    }
  }
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
