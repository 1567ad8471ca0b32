// A fake CUDA device for the CPU tests of the device path (tests/unit/device_path_test.cc): the
// library's sources linked with this runtime instead of device_cuda.cu, so that everything
// above the CUDA calls (the entry checks, the deferred packs, the copy tables, their upload,
// the device strategy, the threads transport's device gather) runs on a machine without a GPU.
// "Device memory" is host memory this runtime allocated; a kernel launch runs the table with
// run_on_host, after checking that every byte it touches is such memory (the kernel cannot
// read host memory). Counters let a test see what an execution launched, uploaded and allocated.
#pragma once

#include <cstdint>

namespace shardgather::testing {

struct FakeDeviceCounters {
  // The default allocator's pool (cudaMallocAsync / cudaFreeAsync). The fake has no cudaMalloc:
  // the library calls none.
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t largest_allocation = 0;  // bytes of the largest of those
  std::uint64_t launches = 0;            // non-empty kernel launches
  std::uint64_t copies = 0;              // copy_async calls (uploads and transport moves)
  std::uint64_t host_to_device = 0;      // of those, from host memory (table uploads, zeros)
  // The host looking at the device's progress (DeviceEvent::query; the runtime has no other host
  // wait: no stream or device synchronisation).
  std::uint64_t host_waits = 0;
  std::uint64_t event_records = 0;  // DeviceEvent::record
  std::uint64_t event_waits = 0;    // DeviceEvent::order_after on a recorded event
  std::uint64_t stray = 0;          // kernel descriptors touching memory that is not the device's
};

// A snapshot (all threads together).
FakeDeviceCounters fake_device_counters();
void reset_fake_device_counters();

// `bytes` of fake device memory on device 0, for a test's tensors (not counted); free with
// free_fake.
void* alloc_fake(std::uint64_t bytes);
void free_fake(void* p) noexcept;

}  // namespace shardgather::testing
