#include "round_call.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "params.h"

#include "shardgather/communicator.h"
#include "shardgather/errors.h"
#include "shardgather/round_call.h"

namespace py = pybind11;

namespace shardgather::python {
namespace {

// A contiguous CPU tensor of `dtype` and 1 dim (a row, a message), or InvalidArgument naming it.
void check_flat(const at::Tensor& t, at::ScalarType dtype, const std::string& what) {
  if (!t.device().is_cpu() || t.scalar_type() != dtype || t.dim() != 1 || !t.is_contiguous()) {
    throw InvalidArgument(what + " must be a contiguous 1-d " + std::string(at::toString(dtype)) +
                          " CPU tensor, got " + std::to_string(t.dim()) + "-d " +
                          std::string(at::toString(t.scalar_type())) + " on " + t.device().str());
  }
}

// A failed collective may still touch the tensors it was given (graveyard.h): they are kept
// alive forever, on purpose, as the core parks its own buffers.
void keep_forever(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    static_cast<void>(new at::Tensor(t));  // NOLINT(cppcoreguidelines-owning-memory)
  }
}

class PyRoundCall {
 public:
  PyRoundCall(const std::shared_ptr<Communicator>& comm, const std::string& op,
              const std::string& name, std::optional<double> timeout, std::size_t width)
      : comm_(comm) {
    const Operation operation = operation_named(op);
    const py::gil_scoped_release unlocked;
    call_ = std::make_unique<RoundCall>(*comm, operation, name, to_timeout(timeout), width);
  }

  void open(const std::string& round) {
    const auto mine = claim();
    call_interruptible([&] { call_->open(round); });
  }

  void fail(const std::string& code, const std::string& message) {
    const auto mine = claim();
    const py::gil_scoped_release unlocked;
    call_->fail(error_code_named(code), message);
  }

  // A row that is not a 1-d int64 CPU tensor fails the round on every rank.
  at::Tensor rows(const at::Tensor& row, const std::string& round) {
    const auto mine = claim();
    std::span<const std::int64_t> values;
    try {
      check_flat(row, at::kLong, "a round's row");
      values = {row.data_ptr<std::int64_t>(), static_cast<std::size_t>(row.numel())};
    } catch (const Error& e) {
      call_->fail(e.code(), e.what());
    }
    const std::span<const std::int64_t> table =
        call_interruptible([&] { return call_->rows(values, round); });
    return table_tensor(table, call_->width());
  }

  // (peer -> the bytes it sent here, the [world, world] size table, the receive buffer: `recv`
  // or a larger one that replaced it). Received bytes are views of that buffer; this rank's own
  // message is handed back as it was given. An argument that is not what it must be (a peer out
  // of range, a message or buffer that is not a 1-d uint8 CPU tensor) fails the round on every
  // rank.
  py::tuple messages(const py::dict& outgoing, const std::string& round, at::Tensor recv) {
    const auto mine = claim();
    const auto world = static_cast<std::size_t>(comm_->size());
    std::vector<at::Tensor> held(world);
    std::vector<std::span<const std::byte>> out(world);
    std::size_t capacity = 0;
    try {
      parse_messages(outgoing, held, out);
      check_flat(recv, at::kByte, "the receive buffer");
      capacity = static_cast<std::size_t>(recv.numel());
    } catch (const Error& e) {
      call_->fail(e.code(), e.what());
      out.assign(world, {});
      recv = at::empty({0}, at::kByte);
    }
    auto receive = [&recv](std::size_t n) {
      if (static_cast<std::size_t>(recv.numel()) < n) {
        recv = at::empty({static_cast<std::int64_t>(n)}, at::kByte);
      }
      return std::span<std::byte>(static_cast<std::byte*>(recv.data_ptr()), n);
    };
    RoundCall::Messages got;
    try {
      got = call_interruptible([&] { return call_->messages(out, round, capacity, receive); });
    } catch (const CommunicationError&) {
      held.push_back(recv);
      keep_forever(held);
      throw;
    }
    return py::make_tuple(received_from(got, held, recv), sizes_of(got), recv);
  }

 private:
  // One call at a time: a round driven from two threads would interleave its collectives.
  [[nodiscard]] std::unique_lock<std::mutex> claim() {
    std::unique_lock<std::mutex> mine(busy_, std::try_to_lock);
    if (!mine.owns_lock()) {
      throw InvalidArgument("a call of rounds is driven by one thread at a time");
    }
    return mine;
  }

  void parse_messages(const py::dict& outgoing, std::vector<at::Tensor>& held,
                      std::vector<std::span<const std::byte>>& out) const {
    const auto world = static_cast<std::size_t>(comm_->size());
    for (const auto& [key, value] : outgoing) {
      const auto peer = py::isinstance<py::int_>(key) ? key.cast<std::int64_t>() : -1;
      if (peer < 0 || static_cast<std::size_t>(peer) >= world) {
        throw InvalidArgument("a message to " + std::string(py::str(key)) + ", not a rank of " +
                              std::to_string(world));
      }
      const auto p = static_cast<std::size_t>(peer);
      if (!THPVariable_Check(value.ptr())) {
        throw InvalidType("the message to rank " + std::to_string(p) + " is not a tensor");
      }
      held[p] = value.cast<at::Tensor>();
      check_flat(held[p], at::kByte, "the message to rank " + std::to_string(p));
      out[p] = {static_cast<const std::byte*>(held[p].data_ptr()),
                static_cast<std::size_t>(held[p].numel())};
    }
  }

  [[nodiscard]] at::Tensor sizes_of(const RoundCall::Messages& got) const {
    return table_tensor(got.sizes, call_->width())
        .narrow(1, 0, static_cast<std::int64_t>(comm_->size()));
  }

  [[nodiscard]] py::dict received_from(const RoundCall::Messages& got,
                                       const std::vector<at::Tensor>& held,
                                       const at::Tensor& recv) const {
    const auto world = static_cast<std::size_t>(comm_->size());
    const auto me = static_cast<std::size_t>(comm_->rank());
    py::dict received;
    if (held[me].defined() && held[me].numel() > 0) {
      received[py::int_(me)] = held[me];
    }
    std::int64_t at = 0;
    for (std::size_t s = 0; s < world; ++s) {
      const std::int64_t n = s == me ? 0 : got.sizes[s * call_->width() + me];
      if (n > 0) {
        received[py::int_(s)] = recv.narrow(0, at, n);
      }
      at += n;
    }
    return received;
  }

  [[nodiscard]] at::Tensor table_tensor(std::span<const std::int64_t> table,
                                        std::size_t width) const {
    const auto world = static_cast<std::int64_t>(comm_->size());
    at::Tensor t = at::empty({world, static_cast<std::int64_t>(width)}, at::kLong);
    std::copy(table.begin(), table.end(), t.data_ptr<std::int64_t>());
    return t;
  }

  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<RoundCall> call_;
  std::mutex busy_;
};

}  // namespace

void register_round_call(py::module_& m) {
  py::class_<PyRoundCall>(m, "_RoundCall",
                          "A compound operation's call of rounds (shardgather/round_call.h): the "
                          "weight sync runs every round of one sync through one.")
      .def(py::init<const std::shared_ptr<Communicator>&, const std::string&, const std::string&,
                    std::optional<double>, std::size_t>(),
           py::arg("comm"), py::arg("op"), py::arg("name"), py::arg("timeout"), py::arg("width"))
      .def("open", &PyRoundCall::open, py::arg("round"))
      .def("fail", &PyRoundCall::fail, py::arg("code"), py::arg("message"))
      .def("rows", &PyRoundCall::rows, py::arg("row"), py::arg("round"))
      .def("messages", &PyRoundCall::messages, py::arg("outgoing"), py::arg("round"),
           py::arg("recv"));
}

}  // namespace shardgather::python
