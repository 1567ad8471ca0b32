// The embedding interface's helpers that are not a call (fail_call lives with the protocol).
#include "shardgather/embedding.h"

#include <functional>

#include "ops/start.h"
#include "transport/op_queue.h"

namespace shardgather {

void run_in_order(Communicator& comm, const std::function<void()>& fn) {
  detail::run_blocking(comm, fn);
}

AwaitingStarted::AwaitingStarted(Communicator& comm) noexcept : comm_(comm) {
  comm_.operations().awaiting(1);
}

AwaitingStarted::~AwaitingStarted() { comm_.operations().awaiting(-1); }

}  // namespace shardgather
