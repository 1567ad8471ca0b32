#include "support/alloc_counter.h"

#include <cstdlib>
#include <new>

// TSan's runtime defines the allocation functions itself and cannot be overridden: under TSan
// nothing is counted (the zero-allocation assertions are made by the other builds).
#if defined(__SANITIZE_THREAD__)
#define SHARDGATHER_COUNT_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SHARDGATHER_COUNT_ALLOCATIONS 0
#endif
#endif
#ifndef SHARDGATHER_COUNT_ALLOCATIONS
#define SHARDGATHER_COUNT_ALLOCATIONS 1
#endif

namespace {
thread_local std::uint64_t allocations = 0;
}  // namespace

namespace shardgather::testing {
std::uint64_t thread_allocations() noexcept { return allocations; }
}  // namespace shardgather::testing

#if SHARDGATHER_COUNT_ALLOCATIONS

// Replacements for the global allocation functions: count, then allocate as usual.
void* operator new(std::size_t size) {
  ++allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) {
    return p;
  }
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new(std::size_t size, std::align_val_t align) {
  ++allocations;
  const auto a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (size + a - 1) / a * a)) {
    return p;
  }
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) { return operator new(size, align); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif  // SHARDGATHER_COUNT_ALLOCATIONS
