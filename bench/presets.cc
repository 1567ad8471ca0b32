#include "presets.h"

#include <algorithm>
#include <string_view>

namespace shardgather::bench {

namespace {

std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27U)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31U);
}

// N for "single-<N>m" (1 <= N <= 65536), else 0.
std::int64_t single_mib(const std::string& name) {
  constexpr std::string_view kPrefix = "single-";
  if (name.size() < kPrefix.size() + 2 || name.compare(0, kPrefix.size(), kPrefix) != 0 ||
      name.back() != 'm') {
    return 0;
  }
  const std::string digits = name.substr(kPrefix.size(), name.size() - kPrefix.size() - 1);
  if (digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return 0;
  }
  const std::int64_t mib = std::stoll(digits);
  return mib >= 1 && mib <= 65536 ? mib : 0;
}

}  // namespace

const std::vector<std::string>& preset_names() {
  // Also single-<N>m: one tensor of N MiB per rank (single-64m is the listed one).
  static const std::vector<std::string> names = {"llama-layer", "tiny-1000", "single-64m",
                                                 "llama-model"};
  return names;
}

DType parse_dtype(const std::string& name) {
  for (int code = 0; code < kNumDTypes; ++code) {
    const auto dtype = static_cast<DType>(code);
    if (dtype_name(dtype) == name) {
      return dtype;
    }
  }
  throw InvalidArgument("unknown dtype \"" + name + "\" (f32, bf16, f16, f64, i32, ...)");
}

std::vector<Param> make_preset(const std::string& name, DType dtype, int world_size) {
  const auto elem = static_cast<std::int64_t>(dtype_size(dtype));
  std::vector<Param> params;
  if (name == "llama-layer") {
    params = {{"self_attn.q_proj", {4096, 4096}},  {"self_attn.k_proj", {4096, 4096}},
              {"self_attn.v_proj", {4096, 4096}},  {"self_attn.o_proj", {4096, 4096}},
              {"mlp.gate_proj", {11008, 4096}},    {"mlp.up_proj", {11008, 4096}},
              {"mlp.down_proj", {4096, 11008}},    {"input_layernorm", {4096}},
              {"post_attention_layernorm", {4096}}};
  } else if (name == "tiny-1000") {
    // Biases, norm scales and scalars: 4 B to 1 KiB per rank each.
    std::uint64_t state = 1000;
    for (int i = 0; i < 1000; ++i) {
      state = mix(state);
      const std::int64_t bytes = 4 + static_cast<std::int64_t>(state % 1021);
      const std::int64_t per_rank = std::max<std::int64_t>(1, bytes / elem);
      params.push_back({"tiny." + std::to_string(i), {per_rank * world_size}});
    }
  } else if (const std::int64_t mib = single_mib(name); mib > 0) {
    params = {{"flat", {(mib << 20) / elem * world_size}}};
  } else if (name == "llama-model") {
    // A whole model with Llama-2-7B's structure at hidden 2880 / ffn 7744: about 6.8 GB in
    // bf16, so that two ranks' shards and the stream's buckets fit a 24 GiB machine.
    constexpr std::int64_t kHidden = 2880;
    constexpr std::int64_t kFfn = 7744;
    constexpr std::int64_t kVocab = 32000;
    params.push_back({"embed_tokens", {kVocab, kHidden}});
    for (int l = 0; l < 32; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
        params.push_back({p + "self_attn." + proj, {kHidden, kHidden}});
      }
      params.push_back({p + "mlp.gate_proj", {kFfn, kHidden}});
      params.push_back({p + "mlp.up_proj", {kFfn, kHidden}});
      params.push_back({p + "mlp.down_proj", {kHidden, kFfn}});
      params.push_back({p + "input_layernorm", {kHidden}});
      params.push_back({p + "post_attention_layernorm", {kHidden}});
    }
    params.push_back({"norm", {kHidden}});
    params.push_back({"lm_head", {kVocab, kHidden}});
  } else {
    throw InvalidArgument("unknown preset \"" + name +
                          "\" (llama-layer, tiny-1000, single-64m or single-<N>m, llama-model)");
  }
  return params;
}

void fill_full_range(std::span<std::byte> out, std::uint64_t seed, std::size_t param,
                     std::uint64_t offset) {
  const std::uint64_t key = mix(seed ^ mix(param + 1));
  std::size_t k = 0;
  while (k < out.size()) {
    const std::uint64_t pos = offset + k;
    const std::uint64_t word = mix(key + pos / 8);
    for (std::uint64_t b = pos % 8; b < 8 && k < out.size(); ++b, ++k) {
      out[k] = static_cast<std::byte>((word >> (8U * b)) & 0xffU);
    }
  }
}

}  // namespace shardgather::bench
