#include "shardgather/errors.h"

namespace shardgather {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk:
      return "Ok";
    case ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case ErrorCode::kCountOverflow:
      return "CountOverflow";
    case ErrorCode::kMismatch:
      return "Mismatch";
    case ErrorCode::kOutOfMemory:
      return "OutOfMemory";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kAborted:
      return "Aborted";
    case ErrorCode::kRemoteError:
      return "RemoteError";
    case ErrorCode::kCommAborted:
      return "CommAborted";
    case ErrorCode::kCommunicationError:
      return "CommunicationError";
    case ErrorCode::kInvalidType:
      return "InvalidType";
  }
  return "Unknown";
}

void throw_error(ErrorCode code, const std::string& what) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      throw InvalidArgument(what);
    case ErrorCode::kCountOverflow:
      throw CountOverflow(what);
    case ErrorCode::kMismatch:
      throw Mismatch(what);
    case ErrorCode::kOutOfMemory:
      throw OutOfMemory(what);
    case ErrorCode::kTimeout:
      throw Timeout(what);
    case ErrorCode::kAborted:
      throw Aborted(what);
    case ErrorCode::kRemoteError:
      throw RemoteError(what);
    case ErrorCode::kCommAborted:
      throw CommAborted(what);
    case ErrorCode::kCommunicationError:
      throw CommunicationError(what);
    case ErrorCode::kInvalidType:
      throw InvalidType(what);
    case ErrorCode::kOk:
      break;
  }
  throw Error(code, what);
}

}  // namespace shardgather
