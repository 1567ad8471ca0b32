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

// The launches' tables in one device buffer, uploaded only when a descriptor or the stream
// changed (a plan over the same tensors on one stream uploads once per slot). Fills s.on_device
// with each table's device copy, in the order given.
void upload_tables(StrategyScratch& s, std::size_t slot, std::span<const CopyTable* const> tables,
                   const Device& device, void* stream) {
  if (s.uploads.size() <= slot) {
    s.uploads.resize(slot + 1);
  }
  StrategyScratch::Upload& u = s.uploads[slot];
  std::size_t total = 0;
  // Memory for another stream is given back and allocated anew (DeviceMemory::reserve).
  bool same = u.memory.stream() == stream;
  for (const CopyTable* t : tables) {
    const std::span<const CopyDesc> d = t->descs();
    same = same && total + d.size() <= u.descs.size() &&
           std::equal(d.begin(), d.end(), u.descs.begin() + static_cast<std::ptrdiff_t>(total));
    total += d.size();
  }
  if (!same || total != u.descs.size()) {
    // u.descs says what the device holds: empty until the upload is enqueued, so that a failed
    // one is redone, never skipped.
    u.descs.clear();
    const std::uint64_t bytes = total * sizeof(CopyDesc);
    u.memory.reserve(bytes, device.index, stream);
    std::vector<CopyDesc>& staged = s.upload_staging;
    staged.clear();
    for (const CopyTable* t : tables) {
      staged.insert(staged.end(), t->descs().begin(), t->descs().end());
    }
    // From pageable memory: the runtime has staged the bytes when this returns, so the vector
    // may change afterwards.
    copy_async(u.memory.data(), staged.data(), bytes, stream);
    u.descs.swap(staged);
  }
  const auto* at = reinterpret_cast<const CopyDesc*>(u.memory.data());
  s.on_device.clear();
  for (const CopyTable* t : tables) {
    s.on_device.push_back(at);
    at += t->descs().size();
  }
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

// The end of every device job: the started operation's completion mark, and the host wait
// where asked.
void finish_device_job(const ExchangeJob& job, Communicator& comm, Deadline deadline) {
  if (completion_slot != nullptr) {
    completion_slot->event.record(job.stream);
    completion_slot->recorded = true;
    completion_slot->device = job.device.index;
  }
  if (device_wait() == DeviceWait::kHost) {
    wait_on_host(job.stream, comm, deadline);
  }
}

// Where a walk over a list of segments or pieces stands (item `item` starts at byte `at` of the
// list's concatenation): parts are cut in order, so each peer's walk resumes where it stopped.
using Cursor = StrategyScratch::Cursor;

template <typename Item, typename Bytes>
void advance(std::span<const Item> items, std::uint64_t begin, Cursor& c, Bytes&& bytes) {
  while (c.item < items.size() && c.at + bytes(items[c.item]) <= begin) {
    c.at += bytes(items[c.item]);
    ++c.item;
  }
}

// Appends to `out` bytes [begin, end) of the contiguous segments' concatenation, from `c` on.
void slice_of(std::span<const ConstSegment> segments, std::uint64_t begin, std::uint64_t end,
              Cursor& c, std::vector<ConstSegment>& out) {
  advance(segments, begin, c, [](const ConstSegment& s) { return s.size; });
  std::uint64_t at = c.at;
  for (std::size_t i = c.item; i < segments.size() && at < end; ++i) {
    const ConstSegment& s = segments[i];
    const std::uint64_t lo = std::max(begin, at);
    const std::uint64_t hi = std::min(end, at + s.size);
    if (lo < hi) {
      out.push_back({s.data + (lo - at), hi - lo});
    }
    at += s.size;
  }
}

// Part k's tables and counts (see run_device): slice k of each peer's send stream packed into
// the send buffer, and slice k of each peer's pieces unpacked from the receive buffer.
void build_part(const ExchangeJob& job, std::size_t me, std::uint64_t k, StrategyScratch& s) {
  const std::size_t world = job.send_first.size() - 1;
  const std::uint64_t parts = job.device_parts;
  CopyTable& in = s.part_tables[2 * k];
  CopyTable& out = s.part_tables[2 * k + 1];
  std::uint64_t* send_counts = s.part_counts.data() + 2 * k * world;
  std::uint64_t* recv_counts = send_counts + world;
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
  for (std::size_t p = 0; p < world; ++p) {
    send_counts[p] = 0;
    recv_counts[p] = 0;
    if (p == me) {
      continue;
    }
    const auto [b, e] = device_part_slice(s.pair_bytes[p], parts, k);
    if (b < e) {
      s.part_segments.clear();
      slice_of(rank_part(job.send, job.send_first, p), b, e, s.send_cursors[p], s.part_segments);
      const RecvPiece into{s.device_send.data() + sent, e - b, 1, 0};
      in.add_stream(s.part_segments, std::span(&into, 1));
      send_counts[p] = e - b;
      sent += e - b;
    }
    const std::span<const RecvPiece> from = rank_part(job.pieces, job.first, p);
    const auto [rb, re] = device_part_slice(s.pair_bytes[world + p], parts, k);
    if (rb < re) {
      const ConstSegment held{s.device_gathered.data() + received, re - rb};
      if (parts == 1) {
        out.add_stream(std::span(&held, 1), from);
      } else {
        Cursor& c = s.recv_cursors[p];
        advance(from, rb, c, [](const RecvPiece& r) { return r.block * r.count; });
        out.add_stream(std::span(&held, 1),
                       slice_pieces(from.subspan(c.item), rb - c.at, re - c.at));
      }
      recv_counts[p] = re - rb;
      received += re - rb;
    }
  }
}

// The personal exchange on a device (see run_device).
void run_device_personal(const ExchangeJob& job, Communicator& comm, Deadline deadline,
                         StrategyScratch& s) {
  const auto me = static_cast<std::size_t>(comm.rank());
  const auto world = static_cast<std::size_t>(comm.size());
  const std::uint64_t parts = std::max<std::uint64_t>(job.device_parts, 1);
  ExchangeJob sliced = job;
  sliced.device_parts = parts;
  const CurrentDevice on(job.device.index);
  s.pair_bytes.assign(2 * world, 0);
  for (std::size_t p = 0; p < world; ++p) {
    if (p != me) {
      s.pair_bytes[p] = stream_bytes(rank_part(job.send, job.send_first, p));
      s.pair_bytes[world + p] = stream_bytes(rank_part(job.pieces, job.first, p));
    }
  }
  // The buffers hold the largest part, sized before any table names their addresses (the
  // operation reserved them before the agreement, so these find them large enough).
  const std::span<const std::uint64_t> pairs(s.pair_bytes);
  s.device_send.reserve(device_part_room(pairs.first(world), parts), job.device.index, job.stream);
  s.device_gathered.reserve(device_part_room(pairs.last(world), parts), job.device.index,
                            job.stream);
  s.part_tables.resize(std::max<std::size_t>(s.part_tables.size(), 2 * parts));
  s.part_counts.resize(2 * parts * world);
  s.send_cursors.assign(world, {});
  s.recv_cursors.assign(world, {});
  for (std::size_t t = 0; t < 2 * parts; ++t) {
    s.part_tables[t].clear();
  }
  // This rank's own bytes, straight from its segments to its pieces.
  s.part_tables[0].add_stream(rank_part(job.send, job.send_first, me),
                              rank_part(job.pieces, job.first, me));
  for (std::uint64_t k = 0; k < parts; ++k) {
    build_part(sliced, me, k, s);
  }
  s.copy_stage.finish();
  s.table_list.assign(1, &s.copy_stage);
  for (std::size_t t = 0; t < 2 * parts; ++t) {
    s.part_tables[t].finish();
    s.table_list.push_back(&s.part_tables[t]);
  }
  upload_tables(s, job.upload_slot, s.table_list, job.device, job.stream);
  launch(s.copy_stage, s.on_device[0], job.stream);
  for (std::uint64_t k = 0; k < parts; ++k) {
    launch(s.part_tables[2 * k], s.on_device[1 + 2 * k], job.stream);
    if (world > 1) {
      const std::span<const std::uint64_t> counts(s.part_counts.data() + 2 * k * world, 2 * world);
      comm.all_to_all_v_device(s.device_send.data(), counts.first(world), s.device_gathered.data(),
                               counts.last(world), job.device, job.stream, deadline);
    }
    launch(s.part_tables[2 * k + 1], s.on_device[2 + 2 * k], job.stream);
  }
  finish_device_job(job, comm, deadline);
}

}  // namespace

// DeviceWait::kHost and the quantize stage's maxima: the enqueued work runs when the peers'
// does, into memory released in stream order (safe to reuse only after it).
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

void run_device(const ExchangeJob& job, DeviceGather request, Communicator& comm, Deadline deadline,
                StrategyScratch& s) {
  if (job.combine.op != Combine::Op::kNone) {
    throw InvalidArgument("the device path runs gathers and personal exchanges only (no combine)");
  }
  if (job.shape == ExchangeShape::kPersonal) {
    run_device_personal(job, comm, deadline, s);
    return;
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
  s.table_list.assign({&s.copy_stage, &s.copy_in, &s.copy_out});
  upload_tables(s, job.upload_slot, s.table_list, job.device, job.stream);
  launch(s.copy_stage, s.on_device[0], job.stream);
  launch(s.copy_in, s.on_device[1], job.stream);
  if (comm.size() > 1) {
    const ConstSegment segment{send, mine};
    comm.all_gather_v_device(std::span(&segment, mine == 0 ? 0 : 1), base, job.counts, s.displs,
                             device_gather_form(job.counts, request), job.device, job.stream,
                             deadline);
  }
  launch(s.copy_out, s.on_device[2], job.stream);
  finish_device_job(job, comm, deadline);
}

std::pair<std::uint64_t, std::uint64_t> device_part_slice(std::uint64_t bytes, std::uint64_t parts,
                                                          std::uint64_t k) {
  // A step of whole 16-byte units keeps every slice but a pair's last at the copy kernel's
  // widest unit wherever the pair's stream is cut.
  const std::uint64_t even = bytes / parts + (bytes % parts != 0 ? 1 : 0);
  const std::uint64_t step = even + (16 - even % 16) % 16;
  if (step == 0 || k >= bytes / step + (bytes % step != 0 ? 1 : 0)) {
    return {bytes, bytes};  // past the pair's last slice (k * step could overflow)
  }
  const std::uint64_t begin = k * step;
  return {begin, begin + std::min(step, bytes - begin)};
}

std::uint64_t device_part_room(std::span<const std::uint64_t> pair_bytes, std::uint64_t parts) {
  std::uint64_t room = 0;
  for (std::uint64_t k = 0; k < parts; ++k) {
    std::uint64_t part = 0;
    for (const std::uint64_t bytes : pair_bytes) {
      const auto [b, e] = device_part_slice(bytes, parts, k);
      part += e - b;
    }
    room = std::max(room, part);
  }
  return room;
}

}  // namespace shardgather::detail
