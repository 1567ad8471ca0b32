// SHARDGATHER_CHECK_MPI: every MPI call goes through it. A failure throws CommunicationError
// naming the rank, the call's text, file:line and MPI's own message (NCCL's checks.h
// discipline, but throwing).
#pragma once

#include <string>

#include <mpi.h>

#include "shardgather/errors.h"

namespace shardgather::detail {

[[noreturn]] inline void throw_mpi_error(int rc, int rank, const char* call, const char* file,
                                         int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) {
    len = 0;
  }
  throw CommunicationError("rank " + std::to_string(rank) + ": " + call + " failed at " + file +
                           ":" + std::to_string(line) + ": " +
                           std::string(text, static_cast<std::size_t>(len)));
}

}  // namespace shardgather::detail

#define SHARDGATHER_CHECK_MPI(rank, call)                                                         \
  do {                                                                                            \
    const int shardgather_rc_ = (call);                                                           \
    if (shardgather_rc_ != MPI_SUCCESS) {                                                         \
      ::shardgather::detail::throw_mpi_error(shardgather_rc_, (rank), #call, __FILE__, __LINE__); \
    }                                                                                             \
  } while (false)
