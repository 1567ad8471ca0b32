#include "shardgather/stage.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "shardgather/errors.h"

namespace shardgather {

Stage::Stage(std::string_view name) {
  if (name.size() > kMaxBytes) {
    throw InvalidArgument("a stage name has at most " + std::to_string(kMaxBytes) + " bytes, got " +
                          std::to_string(name.size()) + ": '" + std::string(name) + "'");
  }
  if (name.find('\0') != std::string_view::npos) {
    throw InvalidArgument("a stage name holds no NUL byte");
  }
  std::copy(name.begin(), name.end(), name_.begin());
}

std::string_view Stage::name() const noexcept { return {name_.data(), std::strlen(name_.data())}; }

}  // namespace shardgather
