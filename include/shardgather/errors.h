// The error hierarchy. Every exception that crosses the API derives from shardgather::Error.
// See docs/errors.md for which classes are raised on every rank and what state the
// communicator is in afterwards.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "shardgather/export.h"

namespace shardgather {

// Error classes as codes, so that a rank can tell its peers which class it is about to raise
// (the pre-flight header carries one). Wire format: never renumber.
enum class ErrorCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument = 1,
  kCountOverflow = 2,
  kMismatch = 3,
  kOutOfMemory = 4,
  kTimeout = 5,
  kAborted = 6,
  kRemoteError = 7,
  kCommAborted = 8,
  kCommunicationError = 9,
  kInvalidType = 10,
};

// The highest code in use: a header carrying a larger one is corrupt.
inline constexpr ErrorCode kLastErrorCode = ErrorCode::kInvalidType;

SHARDGATHER_API std::string_view error_code_name(ErrorCode code) noexcept;

class SHARDGATHER_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// A local argument check failed. Raised on every rank when the pre-flight check is on.
// The communicator stays usable.
class SHARDGATHER_API InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& what) : Error(ErrorCode::kInvalidArgument, what) {}

 protected:
  InvalidArgument(ErrorCode code, const std::string& what) : Error(code, what) {}
};

// An argument of the wrong kind (an embedder's: a Python object that is not a tensor, a hint
// that is not a list of shapes). Python raises it as a TypeError (and an InvalidArgumentError).
class SHARDGATHER_API InvalidType : public InvalidArgument {
 public:
  explicit InvalidType(const std::string& what) : InvalidArgument(ErrorCode::kInvalidType, what) {}
};

// Size arithmetic overflowed 64 bits, or a size exceeds what a backend can express.
class SHARDGATHER_API CountOverflow : public InvalidArgument {
 public:
  explicit CountOverflow(const std::string& what)
      : InvalidArgument(ErrorCode::kCountOverflow, what) {}
};

// Ranks disagree about the call (tensor count, sequence number, dtypes, hint, bytes).
// Nothing was sent; the communicator stays usable.
class SHARDGATHER_API Mismatch : public Error {
 public:
  explicit Mismatch(const std::string& what) : Error(ErrorCode::kMismatch, what) {}
};

class SHARDGATHER_API OutOfMemory : public Error {
 public:
  explicit OutOfMemory(const std::string& what) : Error(ErrorCode::kOutOfMemory, what) {}
};

// The backend failed; its state is unknown and the communicator is poisoned (every later
// call raises CommAborted). Build a new communicator.
class SHARDGATHER_API CommunicationError : public Error {
 public:
  explicit CommunicationError(const std::string& what)
      : Error(ErrorCode::kCommunicationError, what) {}

 protected:
  CommunicationError(ErrorCode code, const std::string& what) : Error(code, what) {}
};

class SHARDGATHER_API Timeout : public CommunicationError {
 public:
  explicit Timeout(const std::string& what) : CommunicationError(ErrorCode::kTimeout, what) {}
};

class SHARDGATHER_API Aborted : public CommunicationError {
 public:
  explicit Aborted(const std::string& what) : CommunicationError(ErrorCode::kAborted, what) {}
};

class SHARDGATHER_API RemoteError : public CommunicationError {
 public:
  explicit RemoteError(const std::string& what)
      : CommunicationError(ErrorCode::kRemoteError, what) {}
};

// Any call on a communicator that an earlier Timeout, abort or backend failure poisoned.
class SHARDGATHER_API CommAborted : public CommunicationError {
 public:
  explicit CommAborted(const std::string& what)
      : CommunicationError(ErrorCode::kCommAborted, what) {}
};

// Throws the class that `code` names (kOk is a programming error and throws Error).
[[noreturn]] SHARDGATHER_API void throw_error(ErrorCode code, const std::string& what);

}  // namespace shardgather
