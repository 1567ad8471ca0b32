#include "delta.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "shardgather/delta.h"
#include "shardgather/errors.h"

namespace py = pybind11;

namespace shardgather::python {
namespace {

std::string describe(const at::Tensor& t) {
  return std::string(at::toString(t.scalar_type())) + " on " + t.device().str() +
         (t.is_contiguous() ? "" : ", not contiguous");
}

// A strided CPU tensor (`what` names it in errors); contiguous too where asked.
void check_cpu(const at::Tensor& t, const char* what, bool contiguous) {
  if (!t.device().is_cpu() || t.layout() != at::kStrided || (contiguous && !t.is_contiguous())) {
    throw InvalidArgument(std::string("delta: ") + what + " must be a " +
                          (contiguous ? "contiguous " : "") + "strided CPU tensor, got " +
                          describe(t));
  }
}

// A contiguous 1-d uint8 CPU tensor: a record's bytes.
std::span<std::byte> record_bytes(const at::Tensor& t, const char* what) {
  check_cpu(t, what, true);
  if (t.scalar_type() != at::kByte || t.dim() != 1) {
    throw InvalidArgument(std::string("delta: ") + what + " must be a 1-d uint8 tensor, got " +
                          std::to_string(t.dim()) + "-d " + describe(t));
  }
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
}

delta::StridedView view_of(const at::Tensor& t) {
  check_cpu(t, "the tensor", false);
  return {.data = t.data_ptr(),
          .es = static_cast<std::size_t>(t.element_size()),
          .sizes = t.sizes().vec(),
          .strides = t.strides().vec()};
}

// `after` and `before` (when given) as encode() takes them: contiguous CPU tensors alike.
void check_pair(const std::optional<at::Tensor>& before, const at::Tensor& after,
                std::uint32_t bucket) {
  check_cpu(after, "after", true);
  if (before) {
    check_cpu(*before, "before", true);
    if (before->scalar_type() != after.scalar_type() || before->numel() != after.numel()) {
      throw InvalidArgument("delta: bucket " + std::to_string(bucket) + ": before is " +
                            describe(*before) + " of " + std::to_string(before->numel()) +
                            " elements, after " + describe(after) + " of " +
                            std::to_string(after.numel()));
    }
  }
}

// (record bytes, encoding code, changed elements): the record of after against before (None:
// dense) at out[0:nbytes].
std::tuple<std::size_t, int, std::uint64_t> encode_py(const std::optional<at::Tensor>& before,
                                                      const at::Tensor& after,
                                                      const at::Tensor& out, std::uint32_t bucket,
                                                      double dense_ratio) {
  check_pair(before, after, bucket);
  const std::span<std::byte> bytes = record_bytes(out, "out");
  const void* old = before ? before->data_ptr() : nullptr;
  const void* now = after.data_ptr();
  const auto n = static_cast<std::size_t>(after.numel());
  const auto es = static_cast<std::size_t>(after.element_size());
  delta::EncodeResult r;
  {
    const py::gil_scoped_release unlocked;
    r = delta::encode(old, now, n, es, bucket, dense_ratio, bytes);
  }
  return {r.bytes, static_cast<int>(r.encoding), r.changed};
}

// (bucket, checksum_ok, record_bytes, changed): the record at record's start applied to flat
// elements [start, start + n) of dst.
std::tuple<std::uint32_t, bool, std::size_t, std::uint64_t> apply_py(const at::Tensor& record,
                                                                     const at::Tensor& dst,
                                                                     std::uint64_t start,
                                                                     std::uint64_t n, bool verify) {
  const std::span<std::byte> bytes = record_bytes(record, "record");
  const delta::StridedView view = view_of(dst);
  delta::ApplyResult r;
  {
    const py::gil_scoped_release unlocked;
    r = delta::apply(bytes, view, start, n, verify);
  }
  return {r.bucket, r.checksum_ok, r.record_bytes, r.changed};
}

std::uint64_t checksum_py(const at::Tensor& t, std::uint64_t start, std::uint64_t n) {
  const delta::StridedView view = view_of(t);
  const py::gil_scoped_release unlocked;
  return delta::view_checksum(view, start, n);
}

// (after, before, elements, element size): one transfer of a pair, as Python gives it.
using PyTransfer =
    std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::uint64_t, std::size_t>;

// One side of a pair's transfer k: a contiguous CPU tensor of n elements of es bytes (a copy kept
// in `held` where the view was not contiguous), or null.
const void* transfer_side(const std::optional<at::Tensor>& t, const char* what, std::size_t k,
                          std::uint64_t n, std::size_t es, std::vector<at::Tensor>& held) {
  if (!t) {
    return nullptr;
  }
  held.push_back(t->contiguous());
  check_cpu(held.back(), what, true);
  if (static_cast<std::uint64_t>(held.back().numel()) != n ||
      static_cast<std::size_t>(held.back().element_size()) != es) {
    throw InvalidArgument("delta: transfer " + std::to_string(k) + ": " + what + " is " +
                          describe(held.back()) + " of " + std::to_string(held.back().numel()) +
                          " elements, for " + std::to_string(n) + " of " + std::to_string(es) +
                          " bytes");
  }
  return held.back().data_ptr();
}

delta::PairTransfer pair_transfer(const PyTransfer& t, std::size_t k,
                                  std::vector<at::Tensor>& held) {
  const auto& [after, before, n, es] = t;
  return {.after = transfer_side(after, "after", k, n, es, held),
          .before = transfer_side(before, "before", k, n, es, held),
          .n = n,
          .es = es};
}

// (touched transfers, buckets whose checksum failed, elements written) of one segment's records
// applied to a pair's transfers (delta::apply_pair).
std::tuple<std::vector<std::size_t>, std::vector<std::uint32_t>, std::uint64_t> apply_pair_py(
    const at::Tensor& records, const std::vector<at::Tensor>& views, std::size_t chunk_bytes,
    bool verify) {
  const std::span<std::byte> bytes = record_bytes(records, "records");
  std::vector<delta::StridedView> dst;
  dst.reserve(views.size());
  for (const at::Tensor& v : views) {
    dst.push_back(view_of(v));
  }
  delta::PairApplied r;
  {
    const py::gil_scoped_release unlocked;
    r = delta::apply_pair(bytes, dst, chunk_bytes, verify);
  }
  return {std::move(r.touched), std::move(r.failed), r.changed};
}

// How many buckets a pair of transfers of (elements, element size) has.
std::size_t bucket_count_py(const std::vector<std::pair<std::uint64_t, std::size_t>>& transfers,
                            std::size_t chunk_bytes) {
  std::vector<std::uint64_t> elements;
  std::vector<std::size_t> es;
  for (const auto& [n, size] : transfers) {
    elements.push_back(n);
    es.push_back(size);
  }
  return delta::pair_buckets(elements, es, chunk_bytes).size();
}

// A weight sync's message to one peer (delta::Message), kept across syncs for its buffer.
class PyMessage {
 public:
  void segment(std::uint32_t origin) {
    message_.segment(origin);
    note_held();
  }

  // (record bytes, encoding code, changed elements) of the record encoded into the open segment;
  // views that are not contiguous are copied first.
  std::tuple<std::size_t, int, std::uint64_t> record(const std::optional<at::Tensor>& before,
                                                     const at::Tensor& after, std::uint32_t bucket,
                                                     double dense_ratio) {
    const at::Tensor now = after.contiguous();
    const std::optional<at::Tensor> old =
        before ? std::optional<at::Tensor>(before->contiguous()) : std::nullopt;
    check_pair(old, now, bucket);
    delta::EncodeResult r;
    {
      const py::gil_scoped_release unlocked;
      r = message_.record(old ? old->data_ptr() : nullptr, now.data_ptr(),
                          static_cast<std::size_t>(now.numel()),
                          static_cast<std::size_t>(now.element_size()), bucket, dense_ratio);
    }
    note_held();
    return {r.bytes, static_cast<int>(r.encoding), r.changed};
  }

  // (records, dense records, changed elements) of a pair's buckets (delta::Message::pair):
  // `transfers` as (after, before, elements, element size), after and before flat tensors or
  // None; `only`: None, or the bucket ids to encode.
  std::tuple<std::uint64_t, std::uint64_t, std::uint64_t> pair(
      const std::vector<PyTransfer>& transfers, std::size_t chunk_bytes, double dense_ratio,
      const std::optional<std::vector<std::int64_t>>& only) {
    std::optional<std::vector<std::uint32_t>> ids;
    if (only) {
      ids.emplace();
      for (const std::int64_t b : *only) {
        if (b < 0 || b > std::numeric_limits<std::uint32_t>::max()) {
          throw InvalidArgument("delta: asked again for bucket " + std::to_string(b) +
                                ", which no pair has");
        }
        ids->push_back(static_cast<std::uint32_t>(b));
      }
    }
    std::vector<at::Tensor> held;  // contiguous copies, where a view was not
    std::vector<delta::PairTransfer> pairs;
    for (std::size_t k = 0; k < transfers.size(); ++k) {
      pairs.push_back(pair_transfer(transfers[k], k, held));
    }
    delta::PairEncoded r;
    {
      const py::gil_scoped_release unlocked;
      r = ids ? message_.pair(pairs, chunk_bytes, dense_ratio, std::span(*ids))
              : message_.pair(pairs, chunk_bytes, dense_ratio);
    }
    note_held();
    return {r.records, r.dense_records, r.changed};
  }

  void copy(PyMessage& other) {
    message_.copy_from(other.message_);
    note_held();
  }

  // The message's bytes as a uint8 tensor over its buffer, no copy: the tensor keeps the buffer
  // alive (a growth or a let-go does not free it under it), and its bytes hold until the next
  // clear() (which reuses the buffer).
  at::Tensor finish() {
    const std::span<const std::byte> bytes = message_.finish();
    if (bytes.empty()) {
      return at::empty({0}, at::kByte);
    }
    return at::from_blob(
        const_cast<std::byte*>(bytes.data()),  // NOLINT(cppcoreguidelines-pro-type-const-cast)
        {static_cast<std::int64_t>(bytes.size())},
        [storage = message_.storage()](void*) {},  // the buffer lives as long as the tensor
        at::TensorOptions().dtype(at::kByte));
  }

  void clear() noexcept {
    message_.clear();
    note_held();
  }
  // Readable from any thread (ws.memory() while a started sync encodes).
  [[nodiscard]] std::size_t held_bytes() const noexcept { return held_.load(); }

 private:
  void note_held() noexcept { held_.store(message_.held_bytes()); }

  delta::Message message_;
  std::atomic<std::size_t> held_{0};
};

// [(origin, offset, bytes, intact)] of each segment of `message`.
std::vector<std::tuple<std::uint32_t, std::size_t, std::size_t, bool>> segments_py(
    const at::Tensor& message) {
  const std::span<std::byte> bytes = record_bytes(message, "message");
  std::vector<delta::Segment> found;
  {
    const py::gil_scoped_release unlocked;
    found = delta::segments(bytes);
  }
  std::vector<std::tuple<std::uint32_t, std::size_t, std::size_t, bool>> out;
  out.reserve(found.size());
  for (const delta::Segment& g : found) {
    out.emplace_back(g.origin, g.offset, g.bytes, g.intact);
  }
  return out;
}

}  // namespace

void register_delta(py::module_& m) {
  py::class_<PyMessage>(m, "_DeltaMessage",
                        "One peer's message of a weight sync: segments of delta records "
                        "(shardgather/delta.h), its buffer kept for the next one.")
      .def(py::init<>())
      .def("segment", &PyMessage::segment, py::arg("origin"))
      .def("record", &PyMessage::record, py::arg("before"), py::arg("after"), py::arg("bucket"),
           py::arg("dense_ratio"))
      .def("pair", &PyMessage::pair, py::arg("transfers"), py::arg("chunk_bytes"),
           py::arg("dense_ratio"), py::arg("only") = std::nullopt)
      .def("copy", &PyMessage::copy, py::arg("other"))
      .def("finish", &PyMessage::finish)
      .def("clear", &PyMessage::clear)
      .def_property_readonly("held_bytes", &PyMessage::held_bytes);
  m.def("_delta_segments", &segments_py, py::arg("message"));
  m.def("_delta_apply_pair", &apply_pair_py, py::arg("records"), py::arg("views"),
        py::arg("chunk_bytes"), py::arg("verify") = true);
  m.def("_delta_bucket_count", &bucket_count_py, py::arg("transfers"), py::arg("chunk_bytes"));
  m.def("_delta_encode", &encode_py, py::arg("before"), py::arg("after"), py::arg("out"),
        py::arg("bucket"), py::arg("dense_ratio"));
  m.def("_delta_apply", &apply_py, py::arg("record"), py::arg("dst"), py::arg("start"),
        py::arg("n"), py::arg("verify") = true);
  m.def("_delta_checksum", &checksum_py, py::arg("t"), py::arg("start"), py::arg("n"));
  m.def("_delta_max_record_bytes", &delta::max_record_bytes, py::arg("n"), py::arg("elem_size"));
}

}  // namespace shardgather::python
