// Benchmark presets: lists of full parameters, sharded along dim 0 torch.chunk-style.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardgather/shardgather.h"

namespace shardgather::bench {

struct Param {
  std::string name;
  Shape full;
};

// "llama-layer" (one Llama-2-7B decoder layer), "tiny-1000" (1000 tensors of 4 B to 1 KiB per
// rank, sizes from a fixed seed), "single-64m" (one tensor, 64 MiB per rank), "llama-model" (a
// whole 32-layer Llama-shaped model, about 6.8 GB in bf16: the stream op's preset).
// InvalidArgument for an unknown name.
std::vector<Param> make_preset(const std::string& name, DType dtype, int world_size);

const std::vector<std::string>& preset_names();

DType parse_dtype(const std::string& name);

// Bytes [offset, offset + out.size()) of parameter `param`'s full tensor: position-based, so a
// rank can make its shard, and check any rank's, without the whole tensor.
void fill_full_range(std::span<std::byte> out, std::uint64_t seed, std::size_t param,
                     std::uint64_t offset);

}  // namespace shardgather::bench
