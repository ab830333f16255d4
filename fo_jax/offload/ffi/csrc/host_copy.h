// Shared by the CPU and CUDA targets: what the two host copies mean and how their operands are
// checked. Both targets move whole "items" of `item_rows` consecutive rows between a pool and
// a dense array, item i at (layer, first row) = index[i]:
//
//   fo_jax_host_gather(pool, index) -> out    out[i] = pool[layer, row : row + item_rows]
//   fo_jax_host_scatter(pool, rows, index) -> pool (aliased)
//                                              pool[layer, row : row + item_rows] = rows[i]
//
// and, for benchmarks only, one contiguous read in the fastest way the platform has (the copy
// engine's cudaMemcpyAsync on a GPU): the baseline the two copies are measured against,
//
//   fo_jax_host_read_bulk(pool) -> out [n, W]  out = pool[layer, row : row + n]  (attributes)
//
// pool is [L, F, Z, W] (any dtype) seen as L layers of N = F Z rows of W values; index is
// [R, 2] int32 in device memory. An entry whose item does not lie inside one layer (layer
// outside [0, L), row < 0, row + item_rows > N: padding is written as -1) is skipped: the
// gather writes zeros for it, the scatter writes nothing. The valid entries of one scatter must
// name distinct rows. Bytes move as they are (no conversion): one row is W * itemsize bytes.
#ifndef FO_JAX_HOST_COPY_H_
#define FO_JAX_HOST_COPY_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fo_jax {

namespace ffi = xla::ffi;

struct CopyShape {
  int64_t layers;     // L
  int64_t rows;       // N = F Z rows per layer
  int64_t row_bytes;  // W * itemsize
  int64_t item_rows;  // rows per item
  int64_t items;      // R
};

inline std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks the pool, the index and the dense side (the gather's result, the scatter's rows):
// same dtype as the pool, R * item_rows rows of W values.
inline ffi::ErrorOr<CopyShape> CheckShapes(const char* target, ffi::AnyBuffer pool,
                                           ffi::Buffer<ffi::S32> index, ffi::AnyBuffer dense,
                                           int64_t item_rows) {
  auto pd = pool.dimensions();
  auto id = index.dimensions();
  std::string name(target);
  if (pd.size() != 4)
    return ffi::Error::InvalidArgument(name + ": pool must be [L, F, Z, W], got " + Dims(pd));
  if (id.size() != 2 || id[1] != 2)
    return ffi::Error::InvalidArgument(name + ": index must be [R, 2] (layer, row), got " +
                                       Dims(id));
  CopyShape s{pd[0], pd[1] * pd[2],
              static_cast<int64_t>(ffi::ByteWidth(pool.element_type())) * pd[3], item_rows, id[0]};
  if (item_rows < 1 || item_rows > s.rows)
    return ffi::Error::InvalidArgument(name + ": item_rows=" + std::to_string(item_rows) +
                                       " must be in [1, F Z=" + std::to_string(s.rows) + "]");
  if (dense.element_type() != pool.element_type())
    return ffi::Error::InvalidArgument(name + ": rows and pool dtypes differ");
  int64_t want = s.items * s.item_rows * s.row_bytes;
  if (static_cast<int64_t>(dense.size_bytes()) != want)
    return ffi::Error::InvalidArgument(
        name + ": rows " + Dims(dense.dimensions()) + " hold " +
        std::to_string(dense.size_bytes()) + " bytes; R * item_rows rows of the pool's W " +
        "values are " + std::to_string(want));
  return s;
}

// Checks a bulk read of out's rows at (layer, row); returns the byte offset in the pool.
inline ffi::ErrorOr<int64_t> CheckBulk(ffi::AnyBuffer pool, ffi::AnyBuffer out, int64_t layer,
                                       int64_t row) {
  auto pd = pool.dimensions();
  std::string name("fo_jax_host_read_bulk");
  if (pd.size() != 4)
    return ffi::Error::InvalidArgument(name + ": pool must be [L, F, Z, W], got " + Dims(pd));
  if (out.element_type() != pool.element_type())
    return ffi::Error::InvalidArgument(name + ": out and pool dtypes differ");
  const int64_t row_bytes = static_cast<int64_t>(ffi::ByteWidth(pool.element_type())) * pd[3];
  const int64_t rows = static_cast<int64_t>(out.size_bytes()) / row_bytes;
  if (rows * row_bytes != static_cast<int64_t>(out.size_bytes()) || layer < 0 ||
      layer >= pd[0] || row < 0 || row + rows > pd[1] * pd[2])
    return ffi::Error::InvalidArgument(name + ": out " + Dims(out.dimensions()) +
                                       " is not whole rows inside one layer of the pool " +
                                       Dims(pd) + " at layer " + std::to_string(layer) +
                                       ", row " + std::to_string(row));
  return (layer * pd[1] * pd[2] + row) * row_bytes;
}

// Byte offset of item (layer, row) in the pool, or -1 if the entry is skipped.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t ItemOffset(const CopyShape& s, int32_t layer, int32_t row) {
  if (layer < 0 || layer >= s.layers || row < 0 || row + s.item_rows > s.rows) return -1;
  return (static_cast<int64_t>(layer) * s.rows + row) * s.row_bytes;
}

}  // namespace fo_jax

#endif  // FO_JAX_HOST_COPY_H_
