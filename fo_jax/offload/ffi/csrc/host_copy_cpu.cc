// The CPU target of fo_jax's host copies (semantics in host_copy.h): plain memcpy per item.
// On a CPU "pinned_host" and device memory are the same RAM, so this is the reference that
// the CUDA target must equal bit for bit, and what the tests run on every "ffi" path.
#include <cstring>

#include "host_copy.h"

namespace fo_jax {
namespace {

ffi::Error Gather(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> index,
                  ffi::Result<ffi::AnyBuffer> out, int64_t item_rows) {
  auto shape = CheckShapes("fo_jax_host_gather", pool, index, *out, item_rows);
  if (shape.has_error()) return shape.error();
  const CopyShape s = shape.value();
  const char* src = static_cast<const char*>(pool.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* idx = index.typed_data();
  const int64_t item_bytes = s.item_rows * s.row_bytes;
  for (int64_t i = 0; i < s.items; ++i) {
    int64_t at = ItemOffset(s, idx[2 * i], idx[2 * i + 1]);
    if (at < 0) {
      std::memset(dst + i * item_bytes, 0, item_bytes);
    } else {
      std::memcpy(dst + i * item_bytes, src + at, item_bytes);
    }
  }
  return ffi::Error::Success();
}

ffi::Error Scatter(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> index,
                   ffi::Result<ffi::AnyBuffer> out, int64_t item_rows) {
  auto shape = CheckShapes("fo_jax_host_scatter", pool, index, rows, item_rows);
  if (shape.has_error()) return shape.error();
  const CopyShape s = shape.value();
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data()) {  // not aliased (XLA aliases it: input_output_aliases)
    std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  }
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* idx = index.typed_data();
  const int64_t item_bytes = s.item_rows * s.row_bytes;
  for (int64_t i = 0; i < s.items; ++i) {
    int64_t at = ItemOffset(s, idx[2 * i], idx[2 * i + 1]);
    if (at >= 0) std::memcpy(dst + at, src + i * item_bytes, item_bytes);
  }
  return ffi::Error::Success();
}

ffi::Error ReadBulk(ffi::AnyBuffer pool, ffi::Result<ffi::AnyBuffer> out, int64_t layer,
                    int64_t row) {
  auto at = CheckBulk(pool, *out, layer, row);
  if (at.has_error()) return at.error();
  std::memcpy(out->untyped_data(), static_cast<const char*>(pool.untyped_data()) + at.value(),
              out->size_bytes());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fo_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoJaxHostGatherCpu, fo_jax::Gather,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     // index
                                  .Ret<xla::ffi::AnyBuffer>()                 // out
                                  .Attr<int64_t>("item_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoJaxHostScatterCpu, fo_jax::Scatter,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // pool
                                  .Arg<xla::ffi::AnyBuffer>()                 // rows
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     // index
                                  .Ret<xla::ffi::AnyBuffer>()                 // pool, aliased
                                  .Attr<int64_t>("item_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoJaxHostReadBulkCpu, fo_jax::ReadBulk,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                 // pool
                                  .Ret<xla::ffi::AnyBuffer>()                 // out
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("row"));
