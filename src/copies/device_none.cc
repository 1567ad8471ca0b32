// A build without CUDA: every device operation says so. The validated entry path raises the
// same error, on every rank, before any of these could be reached (ops/call.cc).
#include <string>
#include <utility>

#include "copies/device_runtime.h"

#include "shardgather/errors.h"

namespace shardgather {

bool cuda_built() noexcept { return false; }

namespace detail {

namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw InvalidArgument(std::string(what) +
                        ": shardgather was built without CUDA (SHARDGATHER_WITH_CUDA=OFF)");
}

}  // namespace

void* pool_allocate(std::uint64_t /*bytes*/, int /*device*/, void* /*stream*/) {
  no_cuda("device memory");
}
void pool_free(void* /*data*/, int /*device*/, void* /*stream*/) noexcept {}
CurrentDevice::CurrentDevice(int /*device*/) { no_cuda("CurrentDevice"); }
CurrentDevice::~CurrentDevice() { (void)previous_; }  // nothing was changed
Device device_of(const void* /*p*/) { return kCpu; }
void copy_async(void* /*dst*/, const void* /*src*/, std::uint64_t /*bytes*/, void* /*stream*/) {
  no_cuda("copy_async");
}
void launch_copies(const CopyDesc* /*device_descs*/, std::size_t /*count*/,
                   std::uint64_t /*blocks*/, void* /*stream*/) {
  no_cuda("launch_copies");
}
void launch_quant(const QuantBoxDesc& /*desc*/, void* /*stream*/) { no_cuda("launch_quant"); }
DeviceEvent::DeviceEvent(DeviceEvent&& other) noexcept : event_(other.event_) {
  other.event_ = nullptr;
}
DeviceEvent& DeviceEvent::operator=(DeviceEvent&& other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}
DeviceEvent::~DeviceEvent() { (void)event_; }  // never created here
void DeviceEvent::record(void* /*stream*/) { no_cuda("DeviceEvent::record"); }
void DeviceEvent::order_after(void* /*stream*/) const {}
bool DeviceEvent::query() const { return true; }
DeviceStream::DeviceStream(DeviceStream&& other) noexcept : stream_(other.stream_) {
  other.stream_ = nullptr;
}
DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept {
  std::swap(stream_, other.stream_);
  return *this;
}
DeviceStream::~DeviceStream() { (void)stream_; }  // never created here
void* DeviceStream::get(int /*device*/) { no_cuda("DeviceStream::get"); }

}  // namespace detail
}  // namespace shardgather
