// S3 (docs/reliability.md, fuzzing): the planner compiled on its own with clang's
// -fsanitize=unsigned-integer-overflow,implicit-conversion, which catch size_t -> int narrowing
// and unsigned wrap in offset arithmetic. Only the planner gets these flags (the standard
// library trips them), so this file compiles the planner's source as its own translation unit.
#include "../../src/planner/layout.cc"  // NOLINT(bugprone-suspicious-include)
