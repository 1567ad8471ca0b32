// The running gtest's "Suite.Name", which the unit suites use to name their thread groups and
// watchdog messages.
#pragma once

#include <string>

#include <gtest/gtest.h>

namespace shardgather::testing {

inline std::string test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

}  // namespace shardgather::testing
