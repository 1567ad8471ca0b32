#include "transport/shared_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "transport/graveyard.h"
#include <fcntl.h>
#include <unistd.h>

#include "shardgather/errors.h"

namespace shardgather::detail {

namespace {

constexpr std::size_t kNameBytes = 64;

std::string errno_text() { return std::strerror(errno); }

}  // namespace

namespace {

// The lowest rank on rank r's host, which creates the host's object.
int leader_of(const Communicator& comm, int r) {
  const std::span<const int> hosts = comm.hosts();
  if (hosts.size() != static_cast<std::size_t>(comm.size())) {
    if (comm.ranks_on_host() == comm.size()) {
      return 0;
    }
    throw InvalidArgument("rank " + std::to_string(comm.rank()) +
                          ": a shared buffer needs to know which ranks share a host (" +
                          std::to_string(comm.ranks_on_host()) + " of " +
                          std::to_string(comm.size()) +
                          " are here, the backend does not say "
                          "which)");
  }
  const int host = hosts[static_cast<std::size_t>(r)];
  return static_cast<int>(std::find(hosts.begin(), hosts.end(), host) - hosts.begin());
}

// Creates and reserves the object; its name, or "" and `error`.
std::string create_object(std::uint64_t size, std::string& error) {
  static std::atomic<std::uint64_t> counter{0};
  std::string n =
      "/shardgather-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
  const int fd = ::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    error = "shm_open " + n + ": " + errno_text();
    return "";
  }
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  ::close(fd);
  if (rc != 0) {
    ::shm_unlink(n.c_str());
    error = "cannot reserve " + std::to_string(size) + " bytes in /dev/shm: " + std::strerror(rc);
    return "";
  }
  return n;
}

}  // namespace

std::unique_ptr<SharedBuffer> SharedBuffer::create(Communicator& comm, std::uint64_t bytes,
                                                   Deadline deadline) {
  const int leader = leader_of(comm, comm.rank());
  const bool leads = leader == comm.rank();
  const std::uint64_t size = bytes == 0 ? 1 : bytes;
  // Each leader names and sizes its host's object; every rank's fixed-size record (a name, or
  // empty) travels to all, so a failure on any host raises on every rank.
  std::string error;
  std::array<char, kNameBytes> mine{};
  if (leads) {
    const std::string n = create_object(size, error);
    std::memcpy(mine.data(), n.c_str(), n.size());
  }
  std::vector<std::byte> gathered;
  try {
    gathered = gather_or_park(comm, std::as_bytes(std::span(mine)), deadline);
  } catch (const CommunicationError&) {
    if (mine[0] != '\0') {
      ::shm_unlink(mine.data());  // no peer will map it: leave nothing in /dev/shm
    }
    throw;
  }
  const auto record = [&](int r) {
    const char* at =
        reinterpret_cast<const char*>(gathered.data()) + static_cast<std::size_t>(r) * kNameBytes;
    return std::string(at, strnlen(at, kNameBytes));
  };
  for (int r = 0; r < comm.size(); ++r) {
    if (leader_of(comm, r) == r && record(r).empty()) {
      if (mine[0] != '\0') {
        ::shm_unlink(mine.data());
      }
      throw OutOfMemory("rank " + std::to_string(comm.rank()) + ": shared buffer: rank " +
                        std::to_string(r) + " could not create its host's shared buffer" +
                        (error.empty() ? "" : ": " + error));
    }
  }
  const std::string shared_name = record(leader);
  const int fd = ::shm_open(shared_name.c_str(), O_RDWR, 0600);
  void* p = fd < 0 ? MAP_FAILED : ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const std::string map_error = p == MAP_FAILED ? errno_text() : "";
  if (fd >= 0) {
    ::close(fd);
  }
  // Everyone has mapped it (or failed) before the leaders remove the names; a failure anywhere
  // raises everywhere.
  const std::byte ok{p == MAP_FAILED ? std::uint8_t{0} : std::uint8_t{1}};
  const std::vector<std::byte> oks = gather_or_park(comm, std::span(&ok, 1), deadline);
  if (leads) {
    ::shm_unlink(shared_name.c_str());
  }
  for (std::size_t r = 0; r < oks.size(); ++r) {
    if (oks[r] == std::byte{0}) {
      if (p != MAP_FAILED) {
        ::munmap(p, size);
      }
      throw OutOfMemory("rank " + std::to_string(comm.rank()) + ": shared buffer: rank " +
                        std::to_string(r) + " could not map its host's shared buffer" +
                        (map_error.empty() ? "" : ": " + map_error));
    }
  }
  return std::unique_ptr<SharedBuffer>(new SharedBuffer(static_cast<std::byte*>(p), size));
}

SharedBuffer::~SharedBuffer() { ::munmap(data_, size_); }

}  // namespace shardgather::detail
