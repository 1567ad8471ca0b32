// The few c10d calls whose names changed within torch 2.x, so that the binding builds against
// the torch CI tests (2.15) and the one on the GPU machines (2.11): each picks, at compile time,
// the call the torch it is compiled against has.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shardgather::detail {

// One equal-size gather into a flat output: all_gather_single (torch >= 2.15), _allgather_base
// before.
template <typename Group>
c10::intrusive_ptr<c10d::Work> all_gather_single(Group& group, at::Tensor& output,
                                                 at::Tensor& input) {
  if constexpr (requires { group.all_gather_single(output, input); }) {
    return group.all_gather_single(output, input);
  } else {
    return group._allgather_base(output, input);
  }
}

// One personal exchange of contiguous blocks (split sizes per rank): all_to_all_single (torch >=
// 2.15), alltoall_base before (deprecated from 2.15 on).
template <typename Group>
c10::intrusive_ptr<c10d::Work> all_to_all_single(Group& group, at::Tensor& output,
                                                 at::Tensor& input,
                                                 std::vector<std::int64_t>& output_splits,
                                                 std::vector<std::int64_t>& input_splits) {
  if constexpr (requires { group.all_to_all_single(output, input, output_splits, input_splits); }) {
    return group.all_to_all_single(output, input, output_splits, input_splits);
  } else {
    return group.alltoall_base(output, input, output_splits, input_splits);
  }
}

// The name of the backend that carries `device`'s tensors on a group with one backend per
// device type; the group's own name where it has none for that device.
template <typename Group>
std::string backend_name_for(Group& group, c10::DeviceType device) {
  if constexpr (requires { group.hasBackendForDeviceType(device); }) {
    if (group.hasBackendForDeviceType(device)) {
      return group.getBackend(device)->getBackendName();
    }
    return group.getBackendName();
  } else {
    try {
      return group.getBackend(device)->getBackendName();
    } catch (const std::exception&) {
      return group.getBackendName();
    }
  }
}

}  // namespace shardgather::detail
