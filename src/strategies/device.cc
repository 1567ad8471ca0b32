// The device path: how a job over CUDA memory moves. Whatever strategy was asked for, device
// bytes move as kPacked does on the host (copy-in, one collective, copy-out), with each copy one
// launch of the fused kernel (copies/) and the collective the transport's all_gather_v_device
// (NCCL or Gloo on torch groups, cudaMemcpyAsync between threads). Every step is enqueued on
// job.stream and the host does not wait for them (DeviceWait::kStream), unless asked to
// (DeviceWait::kHost).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include "strategies/strategy.h"

#include "shardgather/copy.h"
#include "shardgather/errors.h"

namespace shardgather::detail {

namespace {

// The one tuning number of the device gather's form (docs/gpu.md). Padding costs its bytes on
// the wire and a copy out of the padded buffer; one broadcast per rank costs one collective per
// rank (one coalesced group on NCCL). Unmeasured: no GPU has run this path yet.
constexpr std::uint64_t kPaddingDivisor = 8;

// The three tables (stage, in, out) in one device buffer, uploaded only when a descriptor or
// the stream changed (a plan over the same tensors on one stream uploads once). Returns each
// table's device copy.
std::array<const CopyDesc*, 3> upload_tables(StrategyScratch& s, const Device& device,
                                             void* stream) {
  const std::array<const CopyTable*, 3> tables{&s.copy_stage, &s.copy_in, &s.copy_out};
  std::size_t total = 0;
  // Memory for another stream is given back and allocated anew (DeviceMemory::reserve).
  bool same = s.device_table.stream() == stream;
  for (const CopyTable* t : tables) {
    const std::span<const CopyDesc> d = t->descs();
    same = same && total + d.size() <= s.uploaded.size() &&
           std::equal(d.begin(), d.end(), s.uploaded.begin() + static_cast<std::ptrdiff_t>(total));
    total += d.size();
  }
  if (!same || total != s.uploaded.size()) {
    // s.uploaded says what the device holds: empty until the upload is enqueued, so that a
    // failed one is redone, never skipped.
    s.uploaded.clear();
    const std::uint64_t bytes = total * sizeof(CopyDesc);
    s.device_table.reserve(bytes, device.index, stream);
    std::vector<CopyDesc>& staged = s.upload_staging;
    staged.clear();
    for (const CopyTable* t : tables) {
      staged.insert(staged.end(), t->descs().begin(), t->descs().end());
    }
    // From pageable memory: the runtime has staged the bytes when this returns, so the vector
    // may change afterwards.
    copy_async(s.device_table.data(), staged.data(), bytes, stream);
    s.uploaded.swap(staged);
  }
  const auto* base = reinterpret_cast<const CopyDesc*>(s.device_table.data());
  return {base, base + s.copy_stage.descs().size(),
          base + s.copy_stage.descs().size() + s.copy_in.descs().size()};
}

void launch(const CopyTable& table, const CopyDesc* on_device, void* stream) {
  launch_copies(on_device, table.descs().size(), table.blocks(), stream);
}

// Where the gather lands: in place where every rank's pieces are one run (and this rank keeps
// what it receives), else rank-major in the gathered buffer, with the copy-out recorded.
std::byte* gather_target(const ExchangeJob& job, int me, StrategyScratch& s) {
  std::byte* base = nullptr;
  const bool receives = job.shape != ExchangeShape::kGather || job.root == me;
  if (job.shape == ExchangeShape::kAllGather &&
      contiguous_per_rank(job.pieces, job.first, job.counts, base, s.displs)) {
    return base;
  }
  const std::size_t world = job.counts.size();
  s.displs.resize(world);
  std::uint64_t total = 0;
  for (std::size_t r = 0; r < world; ++r) {
    s.displs[r] = total;
    total += job.counts[r];
  }
  s.device_gathered.reserve(total, job.device.index, job.stream);
  base = s.device_gathered.data();
  if (receives) {
    for (std::size_t r = 0; r < world; ++r) {
      const ConstSegment from{base + s.displs[r], job.counts[r]};
      s.copy_out.add_stream(std::span(&from, 1), rank_part(job.pieces, job.first, r));
    }
  }
  return base;
}

}  // namespace

namespace {

// A process-wide setting of the device path: its environment variable, read once (getenv is not
// safe against a setenv on another thread, such as os.environ in Python, and calls run on
// progress threads too), or what the setter said last. An unknown value is kept as text, so that
// every device call names it.
template <typename E>
class ProcessSetting {
 public:
  using Parse = E (*)(std::string_view);

  ProcessSetting(const char* variable, Parse parse, std::string_view expected)
      : variable_(variable), parse_(parse), expected_(expected) {}

  E get() {
    read_once();
    const std::lock_guard<std::mutex> lock(mu_);
    if (!unknown_.empty()) {
      throw InvalidArgument(std::string(variable_) + "=" + unknown_ + ": expected " +
                            std::string(expected_));
    }
    return value_;
  }

  void set(E value) {
    read_once();
    const std::lock_guard<std::mutex> lock(mu_);
    value_ = value;
    unknown_.clear();
  }

 private:
  void read_once() {
    std::call_once(read_, [this] {
      const char* env = std::getenv(variable_);
      if (env == nullptr || *env == '\0') {
        return;
      }
      try {
        value_ = parse_(env);
      } catch (const InvalidArgument&) {
        unknown_ = env;
      }
    });
  }

  const char* variable_;
  Parse parse_;
  std::string_view expected_;
  std::once_flag read_;
  std::mutex mu_;
  E value_{};  // the enums' first value is the default
  std::string unknown_;
};

// What each setting accepts, for the messages of the variable and of the parser alike.
constexpr std::string_view kGatherValues = "auto, padded or broadcast";
constexpr std::string_view kWaitValues = "stream or host";

ProcessSetting<DeviceGather>& gather_setting() {
  static ProcessSetting<DeviceGather> s("SHARDGATHER_DEVICE_GATHER", &parse_device_gather,
                                        kGatherValues);
  return s;
}

ProcessSetting<DeviceWait>& wait_setting() {
  static ProcessSetting<DeviceWait> s("SHARDGATHER_DEVICE_WAIT", &parse_device_wait, kWaitValues);
  return s;
}

// The operation's completion slot on this thread (DeviceCompletionScope), or null.
thread_local DeviceCompletion* completion_slot = nullptr;

}  // namespace

}  // namespace shardgather::detail

namespace shardgather {

DeviceGather device_gather() { return detail::gather_setting().get(); }

void set_device_gather(DeviceGather request) { detail::gather_setting().set(request); }

std::string_view device_gather_name(DeviceGather request) noexcept {
  switch (request) {
    case DeviceGather::kAuto:
      return "auto";
    case DeviceGather::kPadded:
      return "padded";
    case DeviceGather::kBroadcast:
      return "broadcast";
  }
  return "invalid";
}

DeviceGather parse_device_gather(std::string_view name) {
  for (const DeviceGather g :
       {DeviceGather::kAuto, DeviceGather::kPadded, DeviceGather::kBroadcast}) {
    if (name == device_gather_name(g)) {
      return g;
    }
  }
  throw InvalidArgument("unknown device gather \"" + std::string(name) + "\": expected " +
                        std::string(detail::kGatherValues));
}

DeviceWait device_wait() { return detail::wait_setting().get(); }

void set_device_wait(DeviceWait mode) { detail::wait_setting().set(mode); }

std::string_view device_wait_name(DeviceWait mode) noexcept {
  switch (mode) {
    case DeviceWait::kStream:
      return "stream";
    case DeviceWait::kHost:
      return "host";
  }
  return "invalid";
}

DeviceWait parse_device_wait(std::string_view name) {
  for (const DeviceWait w : {DeviceWait::kStream, DeviceWait::kHost}) {
    if (name == device_wait_name(w)) {
      return w;
    }
  }
  throw InvalidArgument("unknown device wait \"" + std::string(name) + "\": expected " +
                        std::string(detail::kWaitValues));
}

}  // namespace shardgather

namespace shardgather::detail {

DeviceCompletionScope::DeviceCompletionScope(DeviceCompletion& slot) noexcept
    : previous_(std::exchange(completion_slot, &slot)) {}

DeviceCompletionScope::~DeviceCompletionScope() { completion_slot = previous_; }

DeviceGatherForm device_gather_form(std::span<const std::uint64_t> counts,
                                    DeviceGather request) noexcept {
  const std::uint64_t widest = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  const std::uint64_t total = std::accumulate(counts.begin(), counts.end(), std::uint64_t{0});
  const std::uint64_t padding = widest * counts.size() - total;
  if (padding == 0 || request == DeviceGather::kPadded) {
    return DeviceGatherForm::kPadded;
  }
  if (request == DeviceGather::kBroadcast) {
    return DeviceGatherForm::kBroadcast;
  }
  return kPaddingDivisor * padding <= total ? DeviceGatherForm::kPadded
                                            : DeviceGatherForm::kBroadcast;
}

namespace {

// How often the host looks at the device's progress under DeviceWait::kHost: a query costs about
// a microsecond, and a call this waits for has a collective in it.
constexpr std::chrono::microseconds kHostPoll{50};

// DeviceWait::kHost: the host waits until the device has run what `stream` holds, within the
// deadline. The enqueued work cannot be called back: after Timeout or Aborted it still runs when
// the peers' does, into memory released in stream order (safe to reuse only after it).
void wait_on_host(void* stream, Communicator& comm, Deadline deadline) {
  DeviceEvent done;
  done.record(stream);
  while (!done.query()) {
    comm.check_interrupt();
    if (comm.is_poisoned()) {
      throw Aborted("rank " + std::to_string(comm.rank()) +
                    ": the communicator was aborted while the host waited for the call's "
                    "device work (which stays enqueued)");
    }
    if (Clock::now() >= deadline) {
      throw Timeout("rank " + std::to_string(comm.rank()) +
                    ": the call's device work had not run by its deadline (a peer's "
                    "collective is late; the work stays enqueued on the stream)");
    }
    std::this_thread::sleep_for(kHostPoll);
  }
}

}  // namespace

void run_device(const ExchangeJob& job, DeviceGather request, Communicator& comm, Deadline deadline,
                StrategyScratch& s) {
  if (job.shape == ExchangeShape::kPersonal || job.combine.op != Combine::Op::kNone) {
    throw InvalidArgument("the device path runs gathers only (all-gather and gather shapes)");
  }
  const int me = comm.rank();
  const std::uint64_t mine = job.counts[static_cast<std::size_t>(me)];
  const CurrentDevice on(job.device.index);
  s.copy_in.clear();
  s.copy_out.clear();
  s.copy_stage.finish();
  const std::byte* send = nullptr;
  std::byte* base = nullptr;
  if (comm.size() == 1) {
    s.copy_out.add_stream(job.send, job.pieces);  // nothing to gather: straight to the pieces
  } else {
    if (job.send.size() == 1) {
      send = job.send.front().data;  // one contiguous run already: no copy-in
    } else if (mine != 0) {
      s.device_send.reserve(mine, job.device.index, job.stream);
      const RecvPiece whole{s.device_send.data(), mine, 1, 0};
      s.copy_in.add_stream(job.send, std::span(&whole, 1));
      send = s.device_send.data();
    }
    base = gather_target(job, me, s);
  }
  s.copy_in.finish();
  s.copy_out.finish();
  const std::array<const CopyDesc*, 3> on_device = upload_tables(s, job.device, job.stream);
  launch(s.copy_stage, on_device[0], job.stream);
  launch(s.copy_in, on_device[1], job.stream);
  if (comm.size() > 1) {
    const ConstSegment segment{send, mine};
    comm.all_gather_v_device(std::span(&segment, mine == 0 ? 0 : 1), base, job.counts, s.displs,
                             device_gather_form(job.counts, request), job.device, job.stream,
                             deadline);
  }
  launch(s.copy_out, on_device[2], job.stream);
  if (completion_slot != nullptr) {
    completion_slot->event.record(job.stream);
    completion_slot->recorded = true;
    completion_slot->device = job.device.index;
  }
  if (device_wait() == DeviceWait::kHost) {
    wait_on_host(job.stream, comm, deadline);
  }
}

}  // namespace shardgather::detail
