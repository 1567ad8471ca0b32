// Gathers one uneven tensor across 3 in-process ranks through the installed package.
#include <cstdio>
#include <thread>
#include <vector>

#include "shardgather/shardgather.h"
#ifdef CONSUMER_WITH_MPI
#include "shardgather/mpi.h"  // must be installed and compile when the MPI backend is built
#endif

int main() {
  constexpr int kWorld = 3;
  auto comms = shardgather::make_thread_group(kWorld);
  std::vector<int> ok(kWorld, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> shard(static_cast<std::size_t>(r + 1), static_cast<float>(r));
      const shardgather::TensorView view{shard.data(), shardgather::DType::kFloat32, {r + 1}, {}};
      const auto out = shardgather::foreach_all_gather({&view, 1}, *comms[r]);
      bool good = true;
      for (int q = 0; q < kWorld; ++q) {
        const auto& v = out[0][q];
        good = good && v.shape == shardgather::Shape{q + 1} &&
               static_cast<const float*>(v.data)[q] == static_cast<float>(q);
      }
      ok[r] = good ? 1 : 0;
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int r = 0; r < kWorld; ++r) {
    if (ok[r] == 0) {
      std::printf("consumer: rank %d got a wrong result\n", r);
      return 1;
    }
  }
  std::printf("consumer: shardgather %s found and working\n", SHARDGATHER_VERSION_STRING);
  return 0;
}
