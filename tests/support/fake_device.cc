#include "support/fake_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

#include "copies/copy_table.h"
#include "copies/device_runtime.h"

#include "shardgather/errors.h"

namespace shardgather {

bool cuda_built() noexcept { return true; }

namespace testing {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::uintptr_t, std::uint64_t> blocks;  // start -> size
  FakeDeviceCounters counters;
};

Registry& registry() {
  static Registry r;
  return r;
}

// Whether [p, p + n) lies inside one fake allocation.
bool on_device(std::uintptr_t p, std::uint64_t n) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.blocks.upper_bound(p);
  if (it == r.blocks.begin()) {
    return false;
  }
  --it;
  return p + n <= it->first + it->second;
}

}  // namespace

FakeDeviceCounters fake_device_counters() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return r.counters;
}

void reset_fake_device_counters() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.counters = {};
}

namespace {

// Host memory registered as "device" memory, 256-byte aligned, never zero when fresh.
void* fake_allocate(std::uint64_t bytes) {
  const std::uint64_t rounded = (bytes + 255) / 256 * 256 + 256;
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) {
    throw OutOfMemory("fake device: cannot allocate " + std::to_string(bytes) + " bytes");
  }
  std::memset(p, 0xA5, rounded);  // not zero: nothing may rely on fresh memory being zero
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.blocks[reinterpret_cast<std::uintptr_t>(p)] = bytes == 0 ? 1 : bytes;
  return p;
}

void fake_free(void* p) noexcept {
  if (p == nullptr) {
    return;
  }
  {
    Registry& r = registry();
    const std::lock_guard<std::mutex> lock(r.mu);
    r.blocks.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  std::free(p);
}

}  // namespace

void* alloc_fake(std::uint64_t bytes) { return fake_allocate(bytes); }
void free_fake(void* p) noexcept { fake_free(p); }

}  // namespace testing

namespace detail {

void* pool_allocate(std::uint64_t bytes, int /*device*/, void* /*stream*/) {
  void* p = testing::fake_allocate(bytes);
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.allocations;
  r.counters.largest_allocation = std::max(r.counters.largest_allocation, bytes);
  return p;
}

void pool_free(void* data, int /*device*/, void* /*stream*/) noexcept {
  if (data == nullptr) {
    return;
  }
  testing::fake_free(data);
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.frees;
}

CurrentDevice::CurrentDevice(int /*device*/) {}
CurrentDevice::~CurrentDevice() { (void)previous_; }  // nothing was changed

Device device_of(const void* p) {
  return testing::on_device(reinterpret_cast<std::uintptr_t>(p), 1) ? cuda_device(0) : kCpu;
}

void copy_async(void* dst, const void* src, std::uint64_t bytes, void* /*stream*/) {
  if (bytes == 0) {
    return;
  }
  const bool from_host = !testing::on_device(reinterpret_cast<std::uintptr_t>(src), bytes);
  std::memcpy(dst, src, bytes);
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.copies;
  r.counters.host_to_device += from_host ? 1 : 0;
}

void launch_copies(const CopyDesc* device_descs, std::size_t count, std::uint64_t blocks,
                   void* /*stream*/) {
  if (blocks == 0) {
    return;
  }
  std::uint64_t stray =
      testing::on_device(reinterpret_cast<std::uintptr_t>(device_descs), count * sizeof(CopyDesc))
          ? 0U
          : 1U;
  // Every descriptor's first and last unit must be device memory on both sides.
  for (std::size_t i = 0; i < count; ++i) {
    const CopyDesc& d = device_descs[i];
    const std::uint64_t units = units_of(d);
    for (const std::uint64_t u : {std::uint64_t{0}, units - 1}) {
      const UnitAddress a = unit_address(d, u);
      stray += testing::on_device(a.src, d.width) && testing::on_device(a.dst, d.width) ? 0U : 1U;
    }
  }
  run_on_host(std::span(device_descs, count), blocks);
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.launches;
  r.counters.stray += stray;
}

// The kernel's own element code on the host, after checking that the box's first and last
// elements, its codes and the scales it reads are device memory.
void launch_quant(const QuantBoxDesc& desc, void* /*stream*/) {
  if (desc.elements == 0) {
    return;
  }
  std::uint64_t stray = 0;
  const auto check = [&](const void* base, std::int64_t element, std::uint64_t size) {
    const auto p = reinterpret_cast<std::uintptr_t>(base) +
                   static_cast<std::uintptr_t>(element) * static_cast<std::uintptr_t>(size);
    stray += testing::on_device(p, size) ? 0U : 1U;
  };
  const std::uint64_t element_size = desc.element == QuantElement::kF32 ? 4 : 2;
  for (const std::int64_t e : {std::int64_t{0}, desc.elements - 1}) {
    const QuantPlace place = quant_place(desc, e);
    check(desc.view, place.at, element_size);
    check(desc.scales, place.block, desc.mxfp8 && desc.step != QuantStep::kFoldAmax ? 1 : 4);
    if (desc.step != QuantStep::kFoldAmax) {
      check(desc.codes, e, 1);
    }
  }
  if (stray == 0) {
    run_quant_on_host(desc);
  }
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.launches;
  r.counters.stray += stray;
}

// Work runs when it is enqueued here, so an event only counts: what ordering it gives cannot be
// checked on the fake (tools/device-check runs the real thing).
DeviceEvent::DeviceEvent(DeviceEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)) {}
DeviceEvent& DeviceEvent::operator=(DeviceEvent&& other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}
DeviceEvent::~DeviceEvent() = default;

void DeviceEvent::record(void* /*stream*/) {
  event_ = this;
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.event_records;
}

void DeviceEvent::order_after(void* /*stream*/) const {
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.counters.event_waits += event_ != nullptr ? 1 : 0;
}

// Work runs when it is enqueued: a stream is only a name, this object's address.
DeviceStream::DeviceStream(DeviceStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}
DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept {
  std::swap(stream_, other.stream_);
  return *this;
}
DeviceStream::~DeviceStream() = default;
void* DeviceStream::get(int /*device*/) {
  stream_ = this;
  return stream_;
}

// The work ran when it was enqueued: done at the first look, which the host made.
bool DeviceEvent::query() const {
  testing::Registry& r = testing::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  ++r.counters.host_waits;
  return true;
}

}  // namespace detail
}  // namespace shardgather
