// Cross-entropy of a chunk of logit rows, and its gradient written over the logits: dsfunc_cuda::cross_entropy_rows_.
//
// One block per row. Pass 1 reads the row once, keeping a running max and sum of exponentials per thread
// (in fp32, exp2 of pre-scaled values), merged across the block; the row's loss is logsumexp - x[target]
// (0 for ignore_index). Pass 2, when asked, reads the row again (from L2: a row of 50k bf16 is 100 KB) and
// writes (softmax - one_hot) * scale over it in the logits' dtype, scale read from a device tensor (the
// 1 / valid count), so nothing waits for the host. Ignored rows get a zero gradient. A target outside
// [0, V) that is not ignore_index makes the row's loss NaN. The logits never exist in fp32 in memory.
#include "common.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace dsfunc {
namespace {

constexpr int kThreads = 512;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }

// Merge a (max, sum of exp2(x*log2e - max)) pair into another; max is in log2 units.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;  // both empty
  s = s * exp2f(m - mm) + s2 * exp2f(m2 - mm);
  m = mm;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ce_rows_kernel(T* __restrict__ logits, const int64_t* __restrict__ target,
                                                           const float* __restrict__ scale, float* __restrict__ loss,
                                                           int64_t vocab, int64_t ignore_index, bool vec, bool write_grad) {
  __shared__ float sh_m[kThreads / 32], sh_s[kThreads / 32];
  __shared__ float sh_lse2;
  const int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  constexpr int kVec = 16 / sizeof(T);  // vec: rows start on 16 bytes and hold whole words

  float m = -INFINITY, s = 0.f;  // in log2 units: values are x * log2e
  auto add = [&](float v) {
    const float y = v * kLog2e;
    if (y > m) {
      s = s * exp2f(m - y) + 1.f;
      m = y;
    } else {
      s += exp2f(y - m);
    }
  };
  if (vec) {
    const uint4* w = reinterpret_cast<const uint4*>(x);
    for (int64_t i = threadIdx.x; i < vocab / kVec; i += kThreads) {
      uint4 u = __ldg(w + i);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < kVec; ++k) add(load_f(e + k));
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) add(load_f(x + i));
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sh_m[0], bs = sh_s[0];
    for (int w2 = 1; w2 < kThreads / 32; ++w2) merge(bm, bs, sh_m[w2], sh_s[w2]);
    const float lse2 = bm + log2f(bs);  // log2 of sum(exp(x))
    sh_lse2 = lse2;
    const int64_t t = target[row];
    float l;
    if (t == ignore_index) {
      l = 0.f;
    } else if (t < 0 || t >= vocab) {
      l = NAN;
    } else {
      l = lse2 / kLog2e - load_f(x + t);
    }
    loss[row] = l;
  }
  __syncthreads();  // the target's logit is read before pass 2 overwrites it
  if (!write_grad) return;
  const int64_t t = target[row];
  const float g_scale = (t == ignore_index) ? 0.f : *scale;
  const float lse2 = sh_lse2;
  auto grad = [&](float v, int64_t j) {
    const float p = exp2f(v * kLog2e - lse2);
    return (p - (j == t ? 1.f : 0.f)) * g_scale;
  };
  if (vec) {
    uint4* w = reinterpret_cast<uint4*>(x);
    for (int64_t i = threadIdx.x; i < vocab / kVec; i += kThreads) {
      uint4 u = w[i];
      T* e = reinterpret_cast<T*>(&u);
#pragma unroll
      for (int k = 0; k < kVec; ++k) store_f(e + k, grad(load_f(e + k), i * kVec + k));
      w[i] = u;
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) store_f(x + i, grad(load_f(x + i), i));
  }
}

}  // namespace

at::Tensor cross_entropy_rows_cuda(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& scale,
                                   int64_t ignore_index, bool write_grad) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "cross_entropy_rows_: logits must be a contiguous 2-d CUDA tensor");
  TORCH_CHECK(target.device() == logits.device() && target.scalar_type() == at::kLong && target.dim() == 1 &&
                  target.size(0) == logits.size(0) && target.is_contiguous(),
              "cross_entropy_rows_: target must be a contiguous int64 vector of one entry per row");
  TORCH_CHECK(scale.device() == logits.device() && scale.scalar_type() == at::kFloat && scale.numel() == 1,
              "cross_entropy_rows_: scale must be a one-element float32 tensor on the logits' device");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (rows == 0) return loss;
  TORCH_CHECK(rows <= 2147483647LL, "cross_entropy_rows_: too many rows for one launch");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(rows));
  auto vec = [&](int64_t size) { return (vocab * size) % 16 == 0 && aligned_to(logits.data_ptr(), 16); };
  switch (logits.scalar_type()) {
    case at::kFloat:
      ce_rows_kernel<float><<<grid, kThreads, 0, stream>>>(logits.data_ptr<float>(), target.data_ptr<int64_t>(),
                                                           scale.data_ptr<float>(), loss.data_ptr<float>(), vocab,
                                                           ignore_index, vec(logits.element_size()), write_grad);
      break;
    case at::kBFloat16:
      ce_rows_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          reinterpret_cast<__nv_bfloat16*>(logits.data_ptr()), target.data_ptr<int64_t>(), scale.data_ptr<float>(),
          loss.data_ptr<float>(), vocab, ignore_index, vec(logits.element_size()), write_grad);
      break;
    case at::kHalf:
      ce_rows_kernel<__half><<<grid, kThreads, 0, stream>>>(reinterpret_cast<__half*>(logits.data_ptr()),
                                                            target.data_ptr<int64_t>(), scale.data_ptr<float>(),
                                                            loss.data_ptr<float>(), vocab, ignore_index, vec(logits.element_size()), write_grad);
      break;
    default:
      TORCH_CHECK(false, "cross_entropy_rows_: logits must be float32, bfloat16 or float16, got ",
                  logits.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return loss;
}

}  // namespace dsfunc
