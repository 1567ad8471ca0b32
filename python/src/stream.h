// UnshardStream for Python: the core stream plus the parsed shards it reads, and the full
// tensors of each bucket as views of that bucket's buffer. A view keeps the stream (and so the
// buffer) alive; its bytes are those of its bucket until the stream moves past it, after which
// the buffer holds a later bucket (copy what must outlive that, or use copy=True in Python).
//
// Threading: begin(), next() and fail() release the GIL and are interruptible by Ctrl-C; one
// thread drives a stream.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "params.h"

#include "shardgather/communicator.h"
#include "shardgather/unshard_stream.h"

namespace shardgather::python {

class PyUnshardStream {
 public:
  PyUnshardStream(const std::vector<ShardSpec>& specs, int world_size, int rank,
                  const StreamOptions& options, const std::vector<QuantFormat>& quantize)
      : stream_(std::make_shared<UnshardStream>(specs, world_size, rank, options, quantize)) {}
  PyUnshardStream(const PyUnshardStream&) = delete;
  PyUnshardStream& operator=(const PyUnshardStream&) = delete;
  PyUnshardStream(PyUnshardStream&&) = delete;
  PyUnshardStream& operator=(PyUnshardStream&&) = delete;
  // Waits for the buckets still gathering before the shards they read are let go (a loop left
  // with `break` and no `with`); the stream may live on in the bucket tensors.
  ~PyUnshardStream();

  // A local error in `shards` fails the stream's first call on every rank.
  void begin(pybind11::handle shards, const std::shared_ptr<Communicator>& comm);
  // None after the last bucket, else (index, first_param, [full tensors]) ([] where this rank
  // does not receive).
  pybind11::object next();
  [[noreturn]] void fail(const std::string& message, bool is_type_error);
  [[nodiscard]] bool running() const noexcept { return stream_->running(); }

  [[nodiscard]] const UnshardStream& stream() const noexcept { return *stream_; }

 private:
  // Destroyed in reverse: the shards, then the stream (which may still need the communicator).
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<UnshardStream> stream_;
  Params shards_;
};

}  // namespace shardgather::python
