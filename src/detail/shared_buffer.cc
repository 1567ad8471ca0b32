#include "detail/shared_buffer.h"

#include <sys/mman.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "detail/graveyard.h"
#include <fcntl.h>
#include <unistd.h>

#include "shardgather/errors.h"

namespace shardgather::detail {

namespace {

constexpr std::size_t kNameBytes = 64;

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::unique_ptr<SharedBuffer> SharedBuffer::create(Communicator& comm, std::uint64_t bytes,
                                                   Deadline deadline) {
  if (comm.ranks_on_host() != comm.size()) {
    throw InvalidArgument("a shared buffer needs every rank on one host (" +
                          std::to_string(comm.ranks_on_host()) + " of " +
                          std::to_string(comm.size()) + " are here)");
  }
  const std::uint64_t size = bytes == 0 ? 1 : bytes;
  // Rank 0 names and sizes the object; the name travels to the others in a fixed-size record
  // together with rank 0's status, so a failure there raises on every rank.
  std::array<char, kNameBytes> name{};
  std::string error;
  if (comm.rank() == 0) {
    static std::atomic<std::uint64_t> counter{0};
    const std::string n =
        "/shardgather-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
    const int fd = ::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      error = "shm_open " + n + ": " + errno_text();
    } else {
      const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
      ::close(fd);
      if (rc != 0) {
        ::shm_unlink(n.c_str());
        error =
            "cannot reserve " + std::to_string(size) + " bytes in /dev/shm: " + std::strerror(rc);
      } else {
        std::memcpy(name.data(), n.c_str(), n.size());
      }
    }
  }
  std::array<char, kNameBytes> all_names{};
  std::array<char, kNameBytes> mine = comm.rank() == 0 ? name : std::array<char, kNameBytes>{};
  std::vector<std::byte> gathered;
  try {
    gathered = gather_or_park(comm, std::as_bytes(std::span(mine)), deadline);
  } catch (const CommunicationError&) {
    if (name[0] != '\0') {
      ::shm_unlink(name.data());  // no peer will map it: leave nothing in /dev/shm
    }
    throw;
  }
  std::memcpy(all_names.data(), gathered.data(), kNameBytes);
  const std::string shared_name(all_names.data(), strnlen(all_names.data(), kNameBytes));
  if (shared_name.empty()) {
    throw OutOfMemory("rank " + std::to_string(comm.rank()) +
                      ": shared buffer: rank 0 could not create it" +
                      (error.empty() ? "" : ": " + error));
  }
  const int fd = ::shm_open(shared_name.c_str(), O_RDWR, 0600);
  void* p = fd < 0 ? MAP_FAILED : ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const std::string map_error = p == MAP_FAILED ? errno_text() : "";
  if (fd >= 0) {
    ::close(fd);
  }
  // Everyone has mapped it (or failed) before rank 0 removes the name; a failure anywhere
  // raises everywhere.
  const std::byte ok{p == MAP_FAILED ? std::uint8_t{0} : std::uint8_t{1}};
  const std::vector<std::byte> oks = gather_or_park(comm, std::span(&ok, 1), deadline);
  if (comm.rank() == 0) {
    ::shm_unlink(shared_name.c_str());
  }
  for (std::size_t r = 0; r < oks.size(); ++r) {
    if (oks[r] == std::byte{0}) {
      if (p != MAP_FAILED) {
        ::munmap(p, size);
      }
      throw OutOfMemory("rank " + std::to_string(comm.rank()) + ": shared buffer: rank " +
                        std::to_string(r) + " could not map " + shared_name +
                        (map_error.empty() ? "" : ": " + map_error));
    }
  }
  return std::unique_ptr<SharedBuffer>(new SharedBuffer(static_cast<std::byte*>(p), size));
}

SharedBuffer::~SharedBuffer() { ::munmap(data_, size_); }

}  // namespace shardgather::detail
