#include "stream.h"

#include <torch/csrc/autograd/python_variable.h>

#include "torch_tensors.h"

#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/torch.h"

namespace py = pybind11;

namespace shardgather::python {

namespace {

// What a bucket's storage keeps alive: the stream that owns the buffer, and the communicator the
// stream's destructor may still ask (declared first, so destroyed last).
struct BucketOwner {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<UnshardStream> stream;
};

}  // namespace

PyUnshardStream::~PyUnshardStream() {
  const py::gil_scoped_release release;
  stream_->settle();
}

void PyUnshardStream::begin(py::handle shards, const std::shared_ptr<Communicator>& comm) {
  comm_ = comm;
  shards_ = parse_params(shards, "shards");
  if (shards_.error.kind != LocalError::kNone) {
    fail_call(*comm, shards_.error,
              {Operation::kUnshardStream, true, stream_->options().plan.timeout});
  }
  call_interruptible([&] { stream_->begin(shards_.views, *comm); });
}

py::object PyUnshardStream::next() {
  if (!comm_) {
    throw InvalidArgument("UnshardStream.next: begin() was not called");
  }
  if (!shards_.tensors.empty() && shards_.tensors.front().is_cuda()) {
    // The bucket is handed over on torch's current stream, which waits for its gather.
    set_current_cuda_stream(torch_current_stream(shards_.tensors.front().device().index()));
  }
  std::optional<StreamBucket> bucket;
  call_interruptible([&] { bucket = stream_->next(); });
  if (!bucket) {
    shards_.tensors.clear();  // the stream no longer reads them
    return py::none();
  }
  py::list full(bucket->full.size());
  if (!bucket->full.empty()) {
    // One storage over the bucket's buffer; it holds the stream, which owns it.
    auto* base = static_cast<std::byte*>(bucket->full.front().data);
    const std::uint64_t bytes = stream_->buffer_bytes();
    const c10::Storage storage =
        adopt_storage(std::make_unique<BucketOwner>(BucketOwner{comm_, stream_}), base, bytes,
                      bucket->full.front().device);
    for (std::size_t j = 0; j < bucket->full.size(); ++j) {
      PyObject* obj = THPVariable_Wrap(tensor_over(storage, base, bucket->full[j]));
      if (obj == nullptr) {
        throw py::error_already_set();
      }
      full[j] = py::reinterpret_steal<py::object>(obj);
    }
  }
  return py::make_tuple(bucket->index, bucket->first_param, full);
}

void PyUnshardStream::fail(const std::string& message, bool is_type_error) {
  const ErrorCode code = is_type_error ? ErrorCode::kInvalidType : ErrorCode::kInvalidArgument;
  try {
    call_interruptible([&] { stream_->fail(code, message); });
  } catch (...) {
    shards_.tensors.clear();
    throw;
  }
  throw InvalidArgument("unreachable: UnshardStream::fail always raises");
}

}  // namespace shardgather::python
