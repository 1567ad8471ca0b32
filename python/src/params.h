// Argument conversion shared by every entry point of the module: Python lists of tensors to
// TensorViews, timeouts, and the way a rank's local argument error is made to fail the same
// call on its peers.
//
// Threading: everything here runs with the GIL held.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <pybind11/pybind11.h>

#include "shardgather/communicator.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/types.h"

namespace shardgather::python {

// While alive, this thread's blocking waits check for Python signals about every 100 ms
// (taking the GIL briefly; only the main thread runs signal handlers). When a handler raises
// (Ctrl-C: KeyboardInterrupt) the call is aborted and the exception is kept for restore().
class SignalWatch {
 public:
  SignalWatch();
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;
  SignalWatch(SignalWatch&&) = delete;
  SignalWatch& operator=(SignalWatch&&) = delete;
  ~SignalWatch();
  [[nodiscard]] bool interrupted() const noexcept { return type_ != nullptr; }
  // With the GIL held: makes the handler's exception the current Python error.
  void restore() noexcept;

 private:
  PyObject* type_ = nullptr;
  PyObject* value_ = nullptr;
  PyObject* traceback_ = nullptr;
};

// Runs `call` with the GIL released, interruptible by Ctrl-C: a KeyboardInterrupt raised by a
// signal handler during the call ends it within about 100 ms, poisons the communicator (as
// abort() does), and is what the caller sees. Call with the GIL held.
template <typename Fn>
decltype(auto) call_interruptible(Fn&& call) {
  SignalWatch watch;
  try {
    const pybind11::gil_scoped_release release;
    return call();
  } catch (const Error&) {
    if (watch.interrupted()) {
      watch.restore();
      throw pybind11::error_already_set();
    }
    throw;
  }
}

// Seconds (None: unset) to the core's milliseconds; InvalidArgument for negative or non-finite.
std::optional<std::chrono::milliseconds> to_timeout(std::optional<double> seconds);

// A problem the binding finds before the core runs: raised on every rank of the call as
// InvalidTypeError (a TypeError) or InvalidArgumentError (a ValueError), see fail_call.
struct LocalError {
  enum Kind { kNone, kType, kValue } kind = kNone;
  std::size_t index = 0;
  std::string message;
};

// A parsed list of tensors: views into `tensors`, which hold the inputs alive during the call.
struct Params {
  std::vector<at::Tensor> tensors;
  std::vector<TensorView> views;
  LocalError error;
};

// `what` names the argument in messages ("params", "shards", "outputs").
Params parse_params(pybind11::handle params, const char* what = "params");
// The same into `out`, reusing its vectors (a plan parses the same list every step, so this
// allocates nothing after the first call). On error, `out.views` holds the tensors before it.
void parse_params_into(pybind11::handle params, const char* what, Params& out);

// params_shapes_across_group: None (no hint, `out` left empty) or, per rank, per tensor, a shape
// (torch.Size, tuple or list of ints). Converted here rather than by pybind11's casters, which
// rejected a malformed hint with a TypeError naming neither position nor rank, raised on this
// rank alone while its peers waited for it until their deadline.
LocalError parse_hint(pybind11::handle hint, ShapesHint& out);

// A collective call's hint and tensors, parsed; a local error in either fails the call on this
// rank and, where the peers exchange a header, on them too (fail_call). `inputs.params` holds
// the tensors alive for the call.
struct CallInputs {
  ShapesHint hint;
  Params params;
};
CallInputs parse_call_or_fail(pybind11::handle params, pybind11::handle hint, Communicator& comm,
                              Operation op, const ForeachAllGatherOptions& options);

// Whether a foreach or plan create exchanges its header (and so can tell the peers).
inline bool header_exchanged(bool hint_given, bool preflight) { return preflight || !hint_given; }

// Whether `hint` counts as given, as the core reads it: not None and not empty (an object
// that has no length counts as given: parsing it fails, and that is reported like any hint).
bool hint_given(pybind11::handle hint);

// A local error before a collective call: fails that call on every rank, through the header
// when the peers exchange one (shardgather::fail_call, with the GIL released), else here only.
[[noreturn]] void fail_call(Communicator& comm, const LocalError& error, const CallShape& call);
// The same with the class every rank raises given as its code.
[[noreturn]] void fail_call(Communicator& comm, ErrorCode code, const std::string& message,
                            const CallShape& call);

// The operation operation_name() calls `name` (an unknown name is this binding's own bug).
Operation operation_named(const std::string& name);

// The error class error_code_name() calls `name` (an unknown name is this binding's own bug).
ErrorCode error_code_named(const std::string& name);

// The timeout argument of a collective call; a bad one (negative, NaN) fails the call on every
// rank, as any argument error does.
std::optional<std::chrono::milliseconds> timeout_or_fail(Communicator& comm,
                                                         std::optional<double> seconds,
                                                         CallShape call);

}  // namespace shardgather::python
