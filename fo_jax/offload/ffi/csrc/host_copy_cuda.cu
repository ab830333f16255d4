// The CUDA target of fo_jax's host copies (semantics in host_copy.h), the CPU target's twin.
//
// The pool lives in pinned host memory (XLA's `pinned_host`, allocated with cuMemHostAlloc or
// registered with cuMemHostRegister); XLA hands this custom call the host pointer, with no copy
// and no host compute around it. The kernels read and write it directly over PCIe through its
// device pointer (cudaHostGetDevicePointer; the same address under unified addressing): one
// warp per row, 16-byte accesses where the row allows them, the row list read from device
// memory, so nothing waits on the host and the call can be captured in a CUDA graph. Writes to
// host memory end with a system-wide fence. Many rows are in flight at once: the grid covers
// every row (up to a cap, then a grid-stride loop).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "host_copy.h"

namespace fo_jax {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int64_t kMaxBlocks = 8192;

// Copies `bytes` from src to dst with the lanes of one warp, in units of T.
template <typename T>
__device__ __forceinline__ void WarpCopy(char* dst, const char* src, int64_t bytes, int lane) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  for (int64_t i = lane; i < bytes / static_cast<int64_t>(sizeof(T)); i += kWarp) d[i] = s[i];
}

template <typename T>
__device__ __forceinline__ void WarpZero(char* dst, int64_t bytes, int lane) {
  T* d = reinterpret_cast<T*>(dst);
  for (int64_t i = lane; i < bytes / static_cast<int64_t>(sizeof(T)); i += kWarp) d[i] = T{};
}

// unit: 16, 4 or 1 bytes, the widest that divides row_bytes and both base addresses.
template <typename T, bool kScatter>
__global__ void CopyRows(char* pool, char* dense, const int32_t* index, CopyShape s) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t total = s.items * s.item_rows;
  for (int64_t r = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; r < total; r += warps) {
    const int64_t item = r / s.item_rows, row_in_item = r % s.item_rows;
    const int64_t at = ItemOffset(s, index[2 * item], index[2 * item + 1]);
    char* near = dense + r * s.row_bytes;
    if (at < 0) {
      if (!kScatter) WarpZero<T>(near, s.row_bytes, lane);
      continue;
    }
    char* far = pool + at + row_in_item * s.row_bytes;
    if (kScatter) {
      WarpCopy<T>(far, near, s.row_bytes, lane);
    } else {
      WarpCopy<T>(near, far, s.row_bytes, lane);
    }
  }
  if (kScatter) __threadfence_system();
}

// The device address of the pinned host pool.
ffi::ErrorOr<char*> DevicePointer(void* host, const char* target) {
  void* device = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&device, host, 0);
  if (err == cudaSuccess) return static_cast<char*>(device);
  cudaGetLastError();  // clear it: a pool in device memory (host_memory_kind="device") is fine
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, host) == cudaSuccess &&
      attributes.type == cudaMemoryTypeDevice) {
    return static_cast<char*>(host);
  }
  return ffi::Error::Internal(std::string(target) +
                              ": the pool is neither pinned host memory mapped for the device "
                              "nor device memory (" + cudaGetErrorString(err) + ")");
}

template <bool kScatter>
ffi::Error Launch(cudaStream_t stream, char* pool, char* dense, const int32_t* index,
                  const CopyShape& s, const char* target) {
  const int64_t total = s.items * s.item_rows;
  if (total == 0) return ffi::Error::Success();
  int64_t blocks = (total + kWarpsPerBlock - 1) / kWarpsPerBlock;
  blocks = blocks < kMaxBlocks ? blocks : kMaxBlocks;
  const uintptr_t aligned = reinterpret_cast<uintptr_t>(pool) |
                            reinterpret_cast<uintptr_t>(dense) |
                            static_cast<uintptr_t>(s.row_bytes);
  dim3 grid(static_cast<unsigned>(blocks)), block(kWarpsPerBlock * kWarp);
  if (aligned % 16 == 0) {
    CopyRows<uint4, kScatter><<<grid, block, 0, stream>>>(pool, dense, index, s);
  } else if (aligned % 4 == 0) {
    CopyRows<uint32_t, kScatter><<<grid, block, 0, stream>>>(pool, dense, index, s);
  } else {
    CopyRows<uint8_t, kScatter><<<grid, block, 0, stream>>>(pool, dense, index, s);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string(target) + ": launch failed: " +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error Gather(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> index,
                  ffi::Result<ffi::AnyBuffer> out, int64_t item_rows) {
  const char* target = "fo_jax_host_gather";
  auto shape = CheckShapes(target, pool, index, *out, item_rows);
  if (shape.has_error()) return shape.error();
  auto device = DevicePointer(pool.untyped_data(), target);
  if (device.has_error()) return device.error();
  return Launch<false>(stream, device.value(), static_cast<char*>(out->untyped_data()),
                       index.typed_data(), shape.value(), target);
}

ffi::Error Scatter(cudaStream_t stream, ffi::AnyBuffer pool, ffi::AnyBuffer rows,
                   ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> out,
                   int64_t item_rows) {
  const char* target = "fo_jax_host_scatter";
  auto shape = CheckShapes(target, pool, index, rows, item_rows);
  if (shape.has_error()) return shape.error();
  if (out->untyped_data() != pool.untyped_data())
    return ffi::Error::InvalidArgument(std::string(target) +
                                       ": the pool result is not aliased to the pool operand "
                                       "(call it with input_output_aliases={0: 0})");
  auto device = DevicePointer(pool.untyped_data(), target);
  if (device.has_error()) return device.error();
  return Launch<true>(stream, device.value(), static_cast<char*>(rows.untyped_data()),
                      index.typed_data(), shape.value(), target);
}

// The baseline: one contiguous copy by the copy engine (unified addressing: the pinned host
// pointer is valid for cudaMemcpyDefault).
ffi::Error ReadBulk(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Result<ffi::AnyBuffer> out,
                    int64_t layer, int64_t row) {
  auto at = CheckBulk(pool, *out, layer, row);
  if (at.has_error()) return at.error();
  cudaError_t err = cudaMemcpyAsync(out->untyped_data(),
                                    static_cast<const char*>(pool.untyped_data()) + at.value(),
                                    out->size_bytes(), cudaMemcpyDefault, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("fo_jax_host_read_bulk: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fo_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoJaxHostGatherCuda, fo_jax::Gather,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // index
                                  .Ret<xla::ffi::AnyBuffer>()              // out
                                  .Attr<int64_t>("item_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoJaxHostScatterCuda, fo_jax::Scatter,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // rows
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // index
                                  .Ret<xla::ffi::AnyBuffer>()              // pool, aliased
                                  .Attr<int64_t>("item_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoJaxHostReadBulkCuda, fo_jax::ReadBulk,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Ret<xla::ffi::AnyBuffer>()              // out
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("row"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
