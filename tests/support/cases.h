// End-to-end cases shared by the threads suite (one thread per rank) and the MPI suite (one
// process per rank). Each runs on one rank's communicator and reports through EXPECT_*.
#pragma once

#include <cstdint>

#include "shardgather/shardgather.h"

namespace shardgather::testing {

// The FSDP2 odd shapes, dim-0 sharded torch.chunk-style (uneven, some shards empty).
void case_fsdp_shapes(Communicator& comm, bool with_hint, bool preflight);
// 0-d, empty shards, (n, 0), 1-element tensors, and a list whose tensors are all empty.
void case_edge_shapes(Communicator& comm);
void case_empty_list(Communicator& comm);
// The seed's broken case: one tensor per rank, dim-0 sizes 2, 3, 1, 2 (repeating).
void case_single_tensor_uneven(Communicator& comm, bool with_hint);
void case_mixed_dtypes(Communicator& comm);
void case_non_contiguous(Communicator& comm);
// Rank 1's hint row disagrees with its tensor: InvalidArgument on every rank.
void case_wrong_hint(Communicator& comm);
// Rank 1 passes one tensor fewer / a different dtype: Mismatch on every rank.
void case_count_mismatch(Communicator& comm);
void case_dtype_mismatch(Communicator& comm);
// Random lists against the naive per-tensor reference, bit-exact.
void case_random_vs_reference(Communicator& comm, std::uint64_t seed, int iterations);

}  // namespace shardgather::testing
