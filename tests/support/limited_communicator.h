// A test transport: forwards to another communicator (a thread rank) while stating other
// capabilities, so that the strategy layer's and the entry path's reactions to them can be
// tested on threads. Header-only: the CPU suites link it against either build of the library.
#pragma once

#include <vector>

#include <gtest/gtest.h>

#include "shardgather/communicator.h"

namespace shardgather::testing {

// Forwards to a thread rank, stating `caps`; what the caps deny is never reached (the base
// raises first), and the test fails if it is.
class LimitedCommunicator final : public Communicator {
 public:
  LimitedCommunicator(Communicator& inner, Capabilities caps) : inner_(inner), caps_(caps) {}
  LimitedCommunicator(const LimitedCommunicator&) = delete;
  LimitedCommunicator& operator=(const LimitedCommunicator&) = delete;
  LimitedCommunicator(LimitedCommunicator&&) = delete;
  LimitedCommunicator& operator=(LimitedCommunicator&&) = delete;
  ~LimitedCommunicator() override { finish_operations(); }
  [[nodiscard]] int rank() const noexcept override { return inner_.rank(); }
  [[nodiscard]] int size() const noexcept override { return inner_.size(); }
  [[nodiscard]] std::string_view backend_name() const noexcept override { return "limited"; }
  [[nodiscard]] int ranks_on_host() const noexcept override { return inner_.ranks_on_host(); }
  [[nodiscard]] std::span<const int> hosts() const noexcept override { return inner_.hosts(); }
  [[nodiscard]] Capabilities capabilities() const noexcept override { return caps_; }

  // The form of every all_gather_v_device this rank was asked for, in order.
  std::vector<DeviceGatherForm> device_forms;

 protected:
  void do_all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                     Deadline deadline) override {
    inner_.all_gather(send, recv, deadline);
  }
  void do_all_gather_v(std::span<const ConstSegment> send, std::byte* recv,
                       std::span<const std::uint64_t> counts, std::span<const std::uint64_t> displs,
                       Deadline deadline) override {
    EXPECT_TRUE(caps_.gather_v) << "all_gather_v reached on a transport without it";
    inner_.all_gather_v(send, recv, counts, displs, deadline);
  }
  void do_all_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                             std::span<const std::size_t> first,
                             std::span<const std::uint64_t> counts, Deadline deadline) override {
    EXPECT_TRUE(caps_.scatter) << "all_gather_scatter reached on a transport without it";
    inner_.all_gather_scatter(send, pieces, first, counts, deadline);
  }
  void do_gather_scatter(std::span<const ConstSegment> send, std::span<const RecvPiece> pieces,
                         std::span<const std::size_t> first, std::span<const std::uint64_t> counts,
                         int root, Deadline deadline) override {
    inner_.gather_scatter(send, pieces, first, counts, root, deadline);
  }
  void do_all_to_all_scatter(std::span<const ConstSegment> send,
                             std::span<const std::size_t> send_first,
                             std::span<const RecvPiece> pieces, std::span<const std::size_t> first,
                             Deadline deadline) override {
    EXPECT_TRUE(caps_.all_to_all) << "all_to_all_scatter reached on a transport without it";
    inner_.all_to_all_scatter(send, send_first, pieces, first, deadline);
  }
  void do_all_gather_v_device(std::span<const ConstSegment> send, std::byte* recv,
                              std::span<const std::uint64_t> counts,
                              std::span<const std::uint64_t> displs, DeviceGatherForm form,
                              const Device& device, void* stream, Deadline deadline) override {
    EXPECT_TRUE(caps_.device_memory) << "all_gather_v_device reached on a host-only transport";
    device_forms.push_back(form);
    inner_.all_gather_v_device(send, recv, counts, displs, form, device, stream, deadline);
  }
  void do_all_to_all_v_device(const std::byte* send, std::span<const std::uint64_t> send_counts,
                              std::byte* recv, std::span<const std::uint64_t> recv_counts,
                              const Device& device, void* stream, Deadline deadline) override {
    EXPECT_TRUE(caps_.device_memory) << "all_to_all_v_device reached on a host-only transport";
    inner_.all_to_all_v_device(send, send_counts, recv, recv_counts, device, stream, deadline);
  }
  void do_barrier(Deadline deadline) override { inner_.barrier(deadline); }
  void do_abort() noexcept override { inner_.abort(); }

 private:
  Communicator& inner_;
  Capabilities caps_;
};

}  // namespace shardgather::testing
