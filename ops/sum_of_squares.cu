// Sum of squares of every element of a list of tensors in one launch: dsfunc_cuda::sum_of_squares.
//
// The tensors (fp32/bf16/fp16, any sizes, contiguous) are treated as one virtual array split into
// equal contiguous ranges, one per block of a persistent grid. A block walks the tensors its range
// covers, reading 16 bytes per thread per load where the data is aligned. Squares are summed in fp32
// in groups of one load, groups in fp64 per thread, threads and blocks in fp64; the last block to
// finish adds the per-block partials in a fixed order (deterministic) and writes the fp32 result.
// A non-finite element (or a square that overflows fp32, as in the fp32 reference) makes it non-finite.
#include "common.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <vector>

namespace dsfunc {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread
enum DtypeCode : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Sum of squares of the elements packed in one 16-byte word, in fp32.
__device__ __forceinline__ float sq_word(uint4 w, float*) {
  float s = __fmul_rn(__uint_as_float(w.x), __uint_as_float(w.x));
  s = __fmaf_rn(__uint_as_float(w.y), __uint_as_float(w.y), s);
  s = __fmaf_rn(__uint_as_float(w.z), __uint_as_float(w.z), s);
  return __fmaf_rn(__uint_as_float(w.w), __uint_as_float(w.w), s);
}
__device__ __forceinline__ float sq_bf16x2(uint32_t u, float s) {
  const float lo = __uint_as_float(u << 16), hi = __uint_as_float(u & 0xffff0000u);
  return __fmaf_rn(hi, hi, __fmaf_rn(lo, lo, s));
}
__device__ __forceinline__ float sq_word(uint4 w, __nv_bfloat16*) {
  return sq_bf16x2(w.w, sq_bf16x2(w.z, sq_bf16x2(w.y, sq_bf16x2(w.x, 0.f))));
}
__device__ __forceinline__ float sq_f16x2(uint32_t u, float s) {
  __half2 h;
  memcpy(&h, &u, sizeof(u));
  const float2 f = __half22float2(h);
  return __fmaf_rn(f.y, f.y, __fmaf_rn(f.x, f.x, s));
}
__device__ __forceinline__ float sq_word(uint4 w, __half*) {
  return sq_f16x2(w.w, sq_f16x2(w.z, sq_f16x2(w.y, sq_f16x2(w.x, 0.f))));
}

// This thread's share of sum(x[a:b]**2), the block striding over the range.
template <typename T>
__device__ double segment_sum(const T* __restrict__ x, int64_t a, int64_t b) {
  constexpr int kPerWord = 16 / sizeof(T);
  double acc = 0.0;
  const int64_t misaligned = (reinterpret_cast<std::uintptr_t>(x + a) % 16) / sizeof(T);
  const int64_t body = misaligned ? min(b, a + (kPerWord - misaligned)) : a;
  for (int64_t i = a + threadIdx.x; i < body; i += blockDim.x) {
    const float f = to_float(x[i]);
    acc += static_cast<double>(__fmul_rn(f, f));
  }
  const int64_t words = (b - body) / kPerWord;
  const uint4* w = reinterpret_cast<const uint4*>(x + body);
  for (int64_t base = threadIdx.x; base < words; base += static_cast<int64_t>(blockDim.x) * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < words) v[u] = __ldcs(w + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < words) acc += static_cast<double>(sq_word(v[u], static_cast<T*>(nullptr)));
    }
  }
  for (int64_t i = body + words * kPerWord + threadIdx.x; i < b; i += blockDim.x) {
    const float f = to_float(x[i]);
    acc += static_cast<double>(__fmul_rn(f, f));
  }
  return acc;
}

// Sum over the block, valid in thread 0. Safe to call repeatedly.
__device__ double block_sum(double v) {
  __shared__ double warp_sums[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  __syncthreads();  // warp_sums may still be read by an earlier call
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (threadIdx.x < 32) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

// meta (int64): [ticket (0), data pointers (k), dtype codes (k), element offsets (k + 1)].
__global__ void __launch_bounds__(kThreads)
    sum_of_squares_kernel(int64_t* __restrict__ meta, int k, int64_t per_block, double* __restrict__ partials,
                          float* __restrict__ out) {
  const int64_t* ptrs = meta + 1;
  const int64_t* dtypes = meta + 1 + k;
  const int64_t* offsets = meta + 1 + 2 * k;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = min(offsets[k], start + per_block);
  double acc = 0.0;
  if (start < end) {
    int lo = 0, hi = k - 1;  // last tensor whose first element is at or before `start`
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= start) lo = mid; else hi = mid - 1;
    }
    for (int t = lo; t < k && offsets[t] < end; ++t) {
      const int64_t a = max(start, offsets[t]) - offsets[t];
      const int64_t b = min(end, offsets[t + 1]) - offsets[t];
      if (a >= b) continue;
      switch (dtypes[t]) {
        case kF32: acc += segment_sum(reinterpret_cast<const float*>(ptrs[t]), a, b); break;
        case kBF16: acc += segment_sum(reinterpret_cast<const __nv_bfloat16*>(ptrs[t]), a, b); break;
        default: acc += segment_sum(reinterpret_cast<const __half*>(ptrs[t]), a, b); break;
      }
    }
  }
  acc = block_sum(acc);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = acc;
    __threadfence();
    const auto ticket = atomicAdd(reinterpret_cast<unsigned long long*>(meta), 1ull);
    last = ticket == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  double total = 0.0;
  for (int i = threadIdx.x; i < static_cast<int>(gridDim.x); i += blockDim.x) total += __ldcg(partials + i);
  total = block_sum(total);
  if (threadIdx.x == 0) *out = static_cast<float>(total);
}

int64_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default:
      TORCH_CHECK(false, "dsfunc_cuda::sum_of_squares: tensors must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

}  // namespace

at::Tensor sum_of_squares_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "dsfunc_cuda::sum_of_squares: needs at least one tensor");
  const at::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "dsfunc_cuda::sum_of_squares: tensors must be on a CUDA device, got ", device);
  const int k = static_cast<int>(tensors.size());
  at::Tensor meta_host =
      at::empty({3 * static_cast<int64_t>(k) + 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* meta = meta_host.data_ptr<int64_t>();
  meta[0] = 0;
  int64_t total = 0;
  for (int i = 0; i < k; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == device && t.is_contiguous(), "dsfunc_cuda::sum_of_squares: tensor ", i,
                " must be contiguous and on ", device, ", got ", t.device(),
                t.is_contiguous() ? "" : " (non-contiguous)");
    meta[1 + i] = reinterpret_cast<int64_t>(t.data_ptr());
    meta[1 + k + i] = dtype_code(t);
    meta[1 + 2 * k + i] = total;
    total += t.numel();
  }
  meta[1 + 3 * k] = total;

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (total == 0) return out.zero_();
  static const int per_sm = blocks_per_sm(sum_of_squares_kernel, kThreads);
  const int64_t wanted = (total + kThreads * 16 - 1) / (kThreads * 16);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{per_sm} * sm_count()));
  const int64_t per_block = (total + blocks - 1) / blocks;
  at::Tensor meta_dev = meta_host.to(at::TensorOptions().dtype(at::kLong).device(device), /*non_blocking=*/true);
  at::Tensor partials = at::empty({blocks}, at::TensorOptions().dtype(at::kDouble).device(device));
  sum_of_squares_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      meta_dev.data_ptr<int64_t>(), k, per_block, partials.data_ptr<double>(), out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace dsfunc
