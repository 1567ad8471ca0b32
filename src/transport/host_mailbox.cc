#include "transport/host_mailbox.h"

#include <sys/stat.h>
#include <sys/syscall.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "transport/graveyard.h"
#include <fcntl.h>
#include <linux/futex.h>
#include <unistd.h>

#include "shardgather/errors.h"

namespace shardgather::detail {

namespace {

constexpr std::chrono::milliseconds kSleepSlice{20};
constexpr std::chrono::milliseconds kLivenessPeriod{100};
// Checks of the peers' slots before the first sleep: a peer running on another core usually
// arrives within a few microseconds, and a futex sleep and wake cost more than that.
constexpr int kSpins = 256;

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Process-shared (not FUTEX_PRIVATE): the word lives in a mapping other processes share.
void futex_wait(std::uint32_t* word, std::uint32_t expected,
                std::chrono::nanoseconds timeout) noexcept {
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  const timespec ts{.tv_sec = static_cast<time_t>(secs.count()),
                    .tv_nsec = static_cast<long>((timeout - secs).count())};
  // Returns at once when *word != expected (a peer arrived in between), on a wake, a signal or
  // the timeout: the caller re-checks in every case.
  (void)::syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::uint32_t* word) noexcept {
  (void)::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Identifies this process's pid namespace, so that a pid is only interpreted by a peer that
// sees the same numbering. {0, 0}, and liveness is never judged, when /proc is unavailable or
// belongs to another pid namespace than this process's (a /proc not remounted after unshare):
// its /proc/<pid> would then name other processes.
struct PidSpace {
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
};

PidSpace my_pid_space() noexcept {
  std::array<char, 32> self{};
  const ssize_t n = ::readlink("/proc/self", self.data(), self.size() - 1);
  if (n <= 0 ||
      std::string_view(self.data(), static_cast<std::size_t>(n)) != std::to_string(::getpid())) {
    return {};
  }
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) {
    return {};
  }
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

// True only when the process certainly no longer runs: it does not exist, or it is a zombie
// that its parent has not reaped yet (a dead rank of torch.multiprocessing.spawn stays one).
// Anything unclear (no /proc entry for a pid kill() still finds) counts as alive: a false
// "exited" would poison a healthy group, a missed one only waits for the deadline.
bool process_gone(std::int64_t pid) noexcept {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) {
    return errno == ESRCH;
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // Reaped between the two looks: gone if kill() no longer finds it either.
    return errno == ENOENT && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  }
  char text[512];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) {
    return false;
  }
  text[n] = '\0';
  // "pid (comm) S ...": comm may hold spaces and parentheses, so read after the last ')'.
  const char* close_paren = std::strrchr(text, ')');
  if (close_paren == nullptr || close_paren[1] == '\0' || close_paren[2] == '\0') {
    return false;
  }
  return close_paren[2] == 'Z' || close_paren[2] == 'X';
}

}  // namespace

// The shared object: one control line, one record per rank, then two sets of `size` slots.
// Every field is accessed through std::atomic_ref where more than one process may touch it.
struct HostMailbox::Layout {
  static constexpr std::size_t kLine = 64;
  // A slot: its call number and byte count in the first line, then the data.
  static constexpr std::size_t kSlotStride = kLine + kSlotBytes;
  static constexpr std::size_t kSlotBytesField = 8;

  // Control line: the futex word (bumped by every arrival), the sleeper count, the token.
  static constexpr std::size_t kEpoch = 0;
  static constexpr std::size_t kWaiters = 4;
  static constexpr std::size_t kToken = 8;
  // Rank record: pid, pid-namespace dev and inode, and the first call this rank gave up on
  // (0: none), so that a peer arriving late never reads that call's slots as a success.
  static constexpr std::size_t kPid = 0;
  static constexpr std::size_t kPidDev = 8;
  static constexpr std::size_t kPidIno = 16;
  static constexpr std::size_t kAbandoned = 24;
  static constexpr std::size_t kAbandonCode = 32;  // the ErrorCode it gave up with

  static std::size_t record(int rank) { return kLine + static_cast<std::size_t>(rank) * kLine; }
  static std::size_t slot(int size, std::uint64_t call, int rank) {
    return kLine + static_cast<std::size_t>(size) * kLine +
           ((call & 1U) * static_cast<std::size_t>(size) + static_cast<std::size_t>(rank)) *
               kSlotStride;
  }
  static std::size_t bytes(int size) {
    return kLine + static_cast<std::size_t>(size) * (kLine + 2 * kSlotStride);
  }
};

namespace {

// Other processes share these words: only lock-free atomics are address-free.
static_assert(std::atomic_ref<std::uint32_t>::is_always_lock_free);
static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free);

template <typename T>
T* word(std::byte* base, std::size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

template <typename T>
std::atomic_ref<T> at(std::byte* base, std::size_t offset) {
  return std::atomic_ref<T>(*word<T>(base, offset));
}

}  // namespace

HostMailbox::HostMailbox(std::unique_ptr<SharedBuffer> buffer, int rank, int size)
    : buffer_(std::move(buffer)), rank_(rank), size_(size) {}

HostMailbox::~HostMailbox() = default;

std::unique_ptr<HostMailbox> HostMailbox::create(Communicator& comm, Deadline deadline) {
  const int size = comm.size();
  const int rank = comm.rank();
  if (size < 2 || comm.ranks_on_host() != size) {
    return nullptr;
  }
  std::unique_ptr<SharedBuffer> buffer;
  try {
    buffer = SharedBuffer::create(comm, Layout::bytes(size), deadline);
  } catch (const OutOfMemory&) {
    return nullptr;  // raised on every rank alike
  }
  std::byte* base = buffer->data();
  // Rank 0 stamps a random token into the object and sends it over `comm`: a rank that reads
  // another value mapped a different object under the same name (another machine).
  std::uint64_t token = 0;
  if (rank == 0) {
    std::random_device device;
    token = (std::uint64_t{device()} << 32U) ^ device() ^ static_cast<std::uint64_t>(::getpid());
    token |= 1U;  // never 0, the value of a fresh object
    at<std::uint64_t>(base, Layout::kToken).store(token);
  }
  const std::vector<std::byte> tokens =
      gather_or_park(comm, std::as_bytes(std::span(&token, 1)), deadline);
  std::uint64_t expected = 0;
  std::memcpy(&expected, tokens.data(), sizeof(expected));
  const bool same_object = at<std::uint64_t>(base, Layout::kToken).load() == expected;

  const std::byte ok{same_object ? std::uint8_t{1} : std::uint8_t{0}};
  const std::vector<std::byte> oks = gather_or_park(comm, std::span(&ok, 1), deadline);
  if (std::find(oks.begin(), oks.end(), std::byte{0}) != oks.end()) {
    return nullptr;
  }
  // Written only into the agreed object. A peer reads it only to judge liveness while it waits,
  // and skips a record not written yet (pid 0).
  const PidSpace space = my_pid_space();
  const std::size_t record = Layout::record(rank);
  at<std::uint64_t>(base, record + Layout::kPidDev).store(space.dev);
  at<std::uint64_t>(base, record + Layout::kPidIno).store(space.ino);
  at<std::uint64_t>(base, record + Layout::kPid).store(static_cast<std::uint64_t>(::getpid()));
  return std::unique_ptr<HostMailbox>(new HostMailbox(std::move(buffer), rank, size));
}

int HostMailbox::first_missing(std::uint64_t call, int from) const noexcept {
  std::byte* base = buffer_->data();
  for (int r = from; r < size_; ++r) {
    if (r != rank_ &&
        at<std::uint64_t>(base, Layout::slot(size_, call, r)).load(std::memory_order_acquire) !=
            call) {
      return r;
    }
  }
  return size_;
}

void HostMailbox::check_alive(std::uint64_t call, int from, const char* what, bool now_or_never) {
  const Clock::time_point now = Clock::now();
  if (!now_or_never && now - last_liveness_check_ < kLivenessPeriod) {
    return;
  }
  last_liveness_check_ = now;
  std::byte* base = buffer_->data();
  const auto field = [base](int rank, std::size_t offset) {
    return at<std::uint64_t>(base, Layout::record(rank) + offset).load();
  };
  const std::uint64_t dev = field(rank_, Layout::kPidDev);
  const std::uint64_t ino = field(rank_, Layout::kPidIno);
  for (int peer = first_missing(call, from); peer < size_; peer = first_missing(call, peer + 1)) {
    if (ino == 0 || field(peer, Layout::kPidDev) != dev || field(peer, Layout::kPidIno) != ino) {
      continue;  // another pid namespace: its pid means nothing here
    }
    const auto pid = static_cast<std::int64_t>(field(peer, Layout::kPid));
    if (pid > 0 && process_gone(pid)) {
      throw RemoteError("rank " + std::to_string(rank_) + ": rank " + std::to_string(peer) +
                        " (pid " + std::to_string(pid) +
                        ") exited while this rank waited for it in " + what);
    }
  }
}

void HostMailbox::give_up(std::uint64_t call, ErrorCode code) noexcept {
  // This rank leaves `call` for good (its communicator is poisoned): a peer that comes later, or
  // waits still, must fail with the same class, not read the slots written so far as a
  // completed exchange.
  std::byte* base = buffer_->data();
  const std::size_t record = Layout::record(rank_);
  at<std::uint64_t>(base, record + Layout::kAbandonCode).store(static_cast<std::uint64_t>(code));
  std::uint64_t none = 0;
  (void)at<std::uint64_t>(base, record + Layout::kAbandoned).compare_exchange_strong(none, call);
  auto* epoch_word = word<std::uint32_t>(base, Layout::kEpoch);
  std::atomic_ref<std::uint32_t>(*epoch_word).fetch_add(1);
  futex_wake_all(epoch_word);
}

void HostMailbox::check_abandoned(std::uint64_t call, int missing) {
  std::byte* base = buffer_->data();
  for (int r = 0; r < size_; ++r) {
    const std::size_t record = Layout::record(r);
    const std::uint64_t gave_up = at<std::uint64_t>(base, record + Layout::kAbandoned).load();
    if (r == rank_ || gave_up == 0 || gave_up > call) {
      continue;
    }
    const auto code =
        static_cast<ErrorCode>(at<std::uint64_t>(base, record + Layout::kAbandonCode).load());
    if (code != ErrorCode::kTimeout && missing < size_) {
      // The peer may have given up because a missing rank exited: name that cause if so.
      check_alive(call, missing, "an all_gather through the host mailbox", true);
    }
    std::string ranks;
    for (int m = missing; m < size_; m = first_missing(call, m + 1)) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(m);
    }
    throw_error(code == ErrorCode::kTimeout ? code : ErrorCode::kRemoteError,
                "rank " + std::to_string(rank_) +
                    ": an all_gather through the host mailbox: rank " + std::to_string(r) +
                    " gave up on exchange " + std::to_string(gave_up) + " (" +
                    std::string(error_code_name(code)) + ")" +
                    (ranks.empty() ? "" : " waiting for rank(s) " + ranks) +
                    " (the communicator is poisoned; rebuild the group or end the process)");
  }
}

void HostMailbox::wait_for_peers(std::uint64_t call, Deadline deadline,
                                 const std::function<void()>& poll) {
  static constexpr const char* kWhat = "an all_gather through the host mailbox";
  std::byte* base = buffer_->data();
  auto* epoch_word = word<std::uint32_t>(base, Layout::kEpoch);
  std::atomic_ref<std::uint32_t> epoch(*epoch_word);
  auto waiters = at<std::uint32_t>(base, Layout::kWaiters);
  int missing = first_missing(call, 0);
  for (int spin = 0; missing < size_ && spin < kSpins; ++spin) {
    cpu_relax();
    missing = first_missing(call, missing);
  }
  while (missing < size_) {
    // Read the word before the last check: an arrival after it changes the word, and the
    // futex then returns at once instead of sleeping through it.
    const std::uint32_t seen = epoch.load();
    missing = first_missing(call, missing);
    if (missing == size_) {
      break;
    }
    check_abandoned(call, missing);
    if (interrupted_.load()) {
      throw Aborted("rank " + std::to_string(rank_) + ": abort() while in " + kWhat);
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      std::string ranks;
      for (int r = missing; r < size_; r = first_missing(call, r + 1)) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      }
      throw Timeout("rank " + std::to_string(rank_) + ": " + kWhat +
                    " passed its deadline waiting for rank(s) " + ranks +
                    " (the communicator is poisoned; rebuild the group or end the process)");
    }
    if (poll) {
      poll();
    }
    check_alive(call, missing, kWhat);
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
    waiters.fetch_add(1);
    futex_wait(epoch_word, seen, std::min<std::chrono::nanoseconds>(left, kSleepSlice));
    waiters.fetch_sub(1);
    missing = first_missing(call, missing);
  }
}

void HostMailbox::all_gather(std::span<const std::byte> send, std::span<std::byte> recv,
                             Deadline deadline, const std::function<void()>& poll) {
  static constexpr const char* kWhat = "an all_gather through the host mailbox";
  if (interrupted_.load()) {
    throw Aborted("rank " + std::to_string(rank_) + ": abort() before " + kWhat);
  }
  const std::size_t n = send.size();
  if (n > kSlotBytes || recv.size() != n * static_cast<std::size_t>(size_)) {
    throw InvalidArgument("rank " + std::to_string(rank_) + ": " + kWhat + ": " +
                          std::to_string(n) + " bytes to send (at most " +
                          std::to_string(kSlotBytes) + "), " + std::to_string(recv.size()) +
                          " to receive");
  }
  std::byte* base = buffer_->data();
  const std::uint64_t call = ++calls_;
  const std::size_t my_slot = Layout::slot(size_, call, rank_);
  if (n != 0) {  // an empty span may have no data pointer at all
    std::memcpy(base + my_slot + Layout::kLine, send.data(), n);
  }
  at<std::uint64_t>(base, my_slot + Layout::kSlotBytesField).store(n, std::memory_order_relaxed);
  at<std::uint64_t>(base, my_slot).store(call, std::memory_order_release);
  auto* epoch_word = word<std::uint32_t>(base, Layout::kEpoch);
  std::atomic_ref<std::uint32_t> epoch(*epoch_word);
  auto waiters = at<std::uint32_t>(base, Layout::kWaiters);
  epoch.fetch_add(1);
  if (waiters.load() != 0) {
    futex_wake_all(epoch_word);
  }

  try {
    wait_for_peers(call, deadline, poll);
  } catch (const Error& e) {
    give_up(call, e.code());
    throw;
  } catch (...) {
    give_up(call, ErrorCode::kAborted);
    throw;
  }
  check_abandoned(call, size_);

  // Every rank sees every count, so a disagreement raises on every rank, and the slots stay in
  // step for the next call.
  for (int r = 0; r < size_; ++r) {
    const std::uint64_t theirs =
        at<std::uint64_t>(base, Layout::slot(size_, call, r) + Layout::kSlotBytesField)
            .load(std::memory_order_relaxed);
    if (theirs != n) {
      throw Mismatch("rank " + std::to_string(rank_) + ": " + kWhat + ": rank " +
                     std::to_string(r) + " sends " + std::to_string(theirs) + " bytes, this rank " +
                     std::to_string(n));
    }
  }
  for (int r = 0; r < size_ && n != 0; ++r) {
    std::byte* dst = recv.data() + static_cast<std::size_t>(r) * n;
    const std::byte* src =
        r == rank_ ? send.data() : base + Layout::slot(size_, call, r) + Layout::kLine;
    std::memmove(dst, src, n);
  }
}

void HostMailbox::interrupt() noexcept {
  interrupted_.store(true);
  auto* epoch_word = word<std::uint32_t>(buffer_->data(), Layout::kEpoch);
  std::atomic_ref<std::uint32_t>(*epoch_word).fetch_add(1);
  futex_wake_all(epoch_word);
}

}  // namespace shardgather::detail
