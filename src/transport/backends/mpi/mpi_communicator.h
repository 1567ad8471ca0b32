// The MPI backend's communicator. Public contract: include/shardgather/mpi.h.
//
// Design:
//  - Every collective is nonblocking (MPI_Iallgather / MPI_Iallgatherv / MPI_Ibarrier /
//    MPI_Ibcast) and completed by a test loop that watches the deadline and the abort flag.
//    Open MPI progresses only inside MPI calls, so the loop never sleeps; it yields the CPU
//    between tests so that oversubscribed ranks still make progress.
//  - A send of several segments is one MPI_Type_create_hindexed over absolute addresses sent
//    from MPI_BOTTOM: the tensors go on the wire from their own memory. Datatypes are cached
//    by segment list, so a training loop that gathers the same shards every step builds its
//    type once.
//  - all_to_all_scatter is point to point (MPI_Isend / MPI_Irecv of the same cached datatypes),
//    one message per pair that has bytes to move, or one per chunk above max_chunk_bytes.
//  - Counts above INT_MAX bytes (or displacements) never narrow: such gathers are done as a
//    sequence of MPI_Ibcast chunks of at most max_chunk_bytes, one root at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include <mpi.h>

#include "shardgather/communicator.h"
#include "shardgather/mpi.h"

namespace shardgather::detail {

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, const MpiOptions& options);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  MpiCommunicator(MpiCommunicator&&) = delete;
  MpiCommunicator& operator=(MpiCommunicator&&) = delete;

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  [[nodiscard]] std::string_view backend_name() const noexcept override { return "mpi"; }
  [[nodiscard]] int ranks_on_host() const noexcept override { return ranks_on_host_; }
  [[nodiscard]] std::span<const int> hosts() const noexcept override { return hosts_; }
  [[nodiscard]] Capabilities capabilities() const noexcept override {
    Capabilities c;
    c.exchange_form = static_cast<std::uint8_t>(options_.exchange);
    return c;
  }

 protected:
  void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                     Deadline deadline) override;
  void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                       std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                       Deadline deadline) override;
  void do_all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                             std::span<const std::size_t> first,
                             std::span<const std::uint64_t> counts, Deadline deadline) override;
  void do_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                         std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                         int root, Deadline deadline) override;
  void do_all_to_all_scatter(std::span<const ConstSegment> send,
                             std::span<const std::size_t> send_first,
                             std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                             Deadline deadline) override;
  void do_barrier(Deadline deadline) override;
  void do_abort() noexcept override { abort_requested_.store(true); }

 private:
  struct SendType {
    std::vector<ConstSegment> segments;
    MPI_Datatype type = MPI_DATATYPE_NULL;
  };
  struct RecvTypes {
    std::vector<RecvPiece> pieces;
    std::vector<std::size_t> first;
    std::vector<MPI_Datatype> types;  // per rank; MPI_DATATYPE_NULL where nothing arrives
  };

  void wait(MPI_Request& request, Deadline deadline, const char* what);
  // A committed hindexed type over `segments` (absolute addresses), from the cache.
  MPI_Datatype send_type(std::span<const ConstSegment> segments);
  // Committed per-rank receive types over the pieces (absolute addresses), from the cache.
  const std::vector<MPI_Datatype>& recv_types(std::span<const RecvPiece> pieces,
                                              std::span<const std::size_t> first);
  // The in-place scatter through one MPI_Ialltoallw: from every rank to every rank (root < 0) or
  // to `root` only.
  void scatter_alltoallw(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                         std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                         int root, Deadline deadline, const char* what);
  // A personal exchange's pairs point to point (all of them, or with `above_chunk` only those
  // above max_chunk_bytes), and its pairs up to max_chunk_bytes in one MPI_Ialltoallw.
  void personal_point_to_point(std::span<const ConstSegment> send,
                               std::span<const std::size_t> send_first,
                               std::span<const RecvPiece> pieces,
                               std::span<const std::size_t> first, bool above_chunk,
                               Deadline deadline);
  void personal_alltoallw(std::span<const ConstSegment> send,
                          std::span<const std::size_t> send_first,
                          std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                          Deadline deadline);
  // Sender by sender, chunk by chunk point to point to the root: for gathers to one rank above
  // max_chunk_bytes per rank.
  void gather_scatter_chunked(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                              std::span<const std::size_t> first,
                              std::span<const std::uint64_t> counts, int root, Deadline deadline);
  // Root by root, chunk by chunk broadcasts: for gathers above max_chunk_bytes per rank.
  void all_gather_scatter_chunked(std::span<const ConstSegment> send,
                                  std::span<const RecvPiece> pieces,
                                  std::span<const std::size_t> first,
                                  std::span<const std::uint64_t> counts, Deadline deadline);
  void all_gather_v_chunked(std::span<const ConstSegment> send, std::byte* recv,
                            std::span<const std::uint64_t> counts,
                            std::span<const std::uint64_t> displs, Deadline deadline);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int ranks_on_host_ = 1;
  std::vector<int> hosts_;       // rank -> host, from MPI_COMM_TYPE_SHARED
  bool oversubscribed_ = false;  // yield between tests: more ranks here than cores, or kYield
  MpiOptions options_;
  std::atomic<bool> abort_requested_{false};
  std::vector<SendType> type_cache_;   // most recently used last
  std::vector<RecvTypes> recv_cache_;  // most recently used last
  std::vector<int> zeros_;
  std::vector<int> send_counts_;
  std::vector<int> recv_counts_;
  std::vector<MPI_Datatype> send_types_;
  std::vector<int> int_counts_;
  std::vector<int> int_displs_;
  std::vector<MPI_Request> requests_;      // all_to_all_scatter's, one per message
  std::vector<MPI_Datatype> owned_types_;  // a large group's alltoallw send types, this call's
};

}  // namespace shardgather::detail
