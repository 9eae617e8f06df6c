// Fused Adam/AdamW step over one flat fp32 shard: dsfunc_cuda::adam_step_.
//
// One pass over memory: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
// and (optionally) the bf16/fp16 copy of the new params. A bf16/fp16 gradient is read at its own size and
// widened in registers (exactly), so it costs 2 bytes per element and no widened copy. Every per-step
// value (grad scale, lr, step, the found-inf flag) is read from device memory, so the host never
// synchronises.
// The element arithmetic is adam_math.h's, shared with the CPU kernel (adam_cpu.cpp).
#include "adam_math.h"
#include "common.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <optional>
#include <type_traits>

namespace dsfunc {
namespace {

constexpr int kThreads = 256;
constexpr int kVecUnroll = 2;     // float4 groups per thread per iteration (vector path)
constexpr int kScalarUnroll = 4;  // floats per thread per iteration (unaligned path)

struct NoLowp {};  // marks "no low-precision output"

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Gradient elements 4i..4i+3 as one aligned load (16 bytes of fp32, 8 of a 16-bit dtype).
template <typename Grad>
__device__ __forceinline__ float4 load4(const Grad* grad, int64_t i) {
  if constexpr (std::is_same_v<Grad, float>) {
    return reinterpret_cast<const float4*>(grad)[i];
  } else {
    const uint2 bits = reinterpret_cast<const uint2*>(grad)[i];
    Grad g[4];
    memcpy(g, &bits, sizeof(bits));
    return make_float4(to_float(g[0]), to_float(g[1]), to_float(g[2]), to_float(g[3]));
  }
}

__device__ __forceinline__ AdamScalars load_scalars(const float* grad_scale, const float* lr,
                                                    const float* step, const AdamHyper& h) {
  AdamScalars s;
  s.grad_scale = *grad_scale;
  s.neg_lr = -*lr;
  s.bc1 = 1.f;
  s.sqrt_bc2 = 1.f;
  if (h.bias_correction) {
    // As the reference computes them: 1 - beta1**t and sqrt(1 - beta2**t) in float64 from the betas as
    // given, each rounded once to float32, so they are accurate to float32 rounding (in float32,
    // 1 - 0.999 alone is 1.3e-5 off). Casting double to float rounds to nearest (cvt.rn.f32.f64).
    const double t = static_cast<double>(*step);
    s.bc1 = static_cast<float>(1.0 - pow(h.beta1_exact, t));
    s.sqrt_bc2 = static_cast<float>(__dsqrt_rn(1.0 - pow(h.beta2_exact, t)));
  }
  return s;
}

__device__ __forceinline__ __nv_bfloat16 to_low(float x, __nv_bfloat16*) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ __half to_low(float x, __half*) { return __float2half_rn(x); }

__device__ __forceinline__ uint32_t pack2(float a, float b, __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t bits;
  memcpy(&bits, &h, sizeof(bits));
  return bits;
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __half*) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t bits;
  memcpy(&bits, &h, sizeof(bits));
  return bits;
}

template <typename Grad, typename Low>
__device__ __forceinline__ void step_one(float* param, const Grad* grad, float* exp_avg, float* exp_avg_sq,
                                         Low* lowp, int64_t i, const AdamHyper& h, const AdamScalars& s) {
  float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
  adam_update(p, to_float(grad[i]), m, v, h, s);
  param[i] = p;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if constexpr (!std::is_same_v<Low, NoLowp>) lowp[i] = to_low(p, lowp);
}

// Vector path: param, exp_avg and exp_avg_sq are 16-byte aligned, grad to four of its elements, each
// holds n elements; the `head` (< 32) elements just before them are done first. Grid-stride over groups
// of four, kVecUnroll groups loaded before any is used; the n % 4 tail is done last. lowp gets one 8-byte
// store per group: when lowp is 8-byte aligned (kLowShuffle false) the group's own four values; otherwise
// the aligned word starting `low_shift` (1-3) elements into the group, completed with the next lane's
// values (a warp shuffle), the warp's two ends and the last group written element by element.
template <typename Grad, typename Low, bool kLowShuffle>
__global__ void __launch_bounds__(kThreads)
    adam_vec_kernel(float* __restrict__ param, const Grad* __restrict__ grad, float* __restrict__ exp_avg,
                    float* __restrict__ exp_avg_sq, Low* __restrict__ lowp, int64_t n, int head, int low_shift,
                    const float* __restrict__ grad_scale, const float* __restrict__ lr,
                    const float* __restrict__ step, const bool* __restrict__ skip, AdamHyper h) {
  if (*skip) return;
  const AdamScalars s = load_scalars(grad_scale, lr, step, h);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int lane = threadIdx.x % 32;
  if (tid < head) step_one(param, grad, exp_avg, exp_avg_sq, lowp, tid - head, h, s);
  const int64_t n4 = n / 4;
  float4* p4 = reinterpret_cast<float4*>(param);
  float4* m4 = reinterpret_cast<float4*>(exp_avg);
  float4* v4 = reinterpret_cast<float4*>(exp_avg_sq);

  // `base - lane` is the same for the whole warp, so every lane runs every iteration (for the shuffle).
  for (int64_t base = tid; base - lane < n4; base += stride * kVecUnroll) {
    float4 p[kVecUnroll], g[kVecUnroll], m[kVecUnroll], v[kVecUnroll];
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < n4) {
        p[u] = p4[i];
        g[u] = load4(grad, i);
        m[u] = m4[i];
        v[u] = v4[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t i = base + u * stride;
      uint64_t word = 0;
      if (i < n4) {
        adam_update(p[u].x, g[u].x, m[u].x, v[u].x, h, s);
        adam_update(p[u].y, g[u].y, m[u].y, v[u].y, h, s);
        adam_update(p[u].z, g[u].z, m[u].z, v[u].z, h, s);
        adam_update(p[u].w, g[u].w, m[u].w, v[u].w, h, s);
        p4[i] = p[u];
        m4[i] = m[u];
        v4[i] = v[u];
        if constexpr (!std::is_same_v<Low, NoLowp>) {
          word = (uint64_t{pack2(p[u].z, p[u].w, lowp)} << 32) | pack2(p[u].x, p[u].y, lowp);
          if constexpr (!kLowShuffle) reinterpret_cast<uint64_t*>(lowp)[i] = word;
        }
      }
      if constexpr (kLowShuffle && !std::is_same_v<Low, NoLowp>) {
        const uint64_t next = __shfl_down_sync(0xffffffffu, word, 1);
        if (i < n4) {
          const int bits = 16 * low_shift;
          Low* group = lowp + 4 * i;
          if (lane < 31 && i + 1 < n4) {
            *reinterpret_cast<uint64_t*>(group + low_shift) = (word >> bits) | (next << (64 - bits));
          }
          const float vals[4] = {p[u].x, p[u].y, p[u].z, p[u].w};
          const bool own_tail = !(lane < 31 && i + 1 < n4);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (k < low_shift ? lane == 0 : own_tail) group[k] = to_low(vals[k], lowp);
          }
        }
      }
    }
  }
  const int64_t j = 4 * n4 + tid;
  if (j < n) step_one(param, grad, exp_avg, exp_avg_sq, lowp, j, h, s);
}

// Any alignment: grid-stride over single floats, kScalarUnroll loaded before any is used.
template <typename Grad, typename Low>
__global__ void __launch_bounds__(kThreads)
    adam_scalar_kernel(float* __restrict__ param, const Grad* __restrict__ grad, float* __restrict__ exp_avg,
                       float* __restrict__ exp_avg_sq, Low* __restrict__ lowp, int64_t n, int /*head*/,
                       int /*low_shift*/, const float* __restrict__ grad_scale, const float* __restrict__ lr,
                       const float* __restrict__ step, const bool* __restrict__ skip, AdamHyper h) {
  if (*skip) return;
  const AdamScalars s = load_scalars(grad_scale, lr, step, h);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = tid; base < n; base += stride * kScalarUnroll) {
    float p[kScalarUnroll], g[kScalarUnroll], m[kScalarUnroll], v[kScalarUnroll];
#pragma unroll
    for (int u = 0; u < kScalarUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < n) {
        p[u] = param[i];
        g[u] = to_float(grad[i]);
        m[u] = exp_avg[i];
        v[u] = exp_avg_sq[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kScalarUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < n) {
        adam_update(p[u], g[u], m[u], v[u], h, s);
        param[i] = p[u];
        exp_avg[i] = m[u];
        exp_avg_sq[i] = v[u];
        if constexpr (!std::is_same_v<Low, NoLowp>) lowp[i] = to_low(p[u], lowp);
      }
    }
  }
}

template <auto Kernel>
int cached_blocks_per_sm() {
  static const int per_sm = blocks_per_sm(Kernel, kThreads);
  return per_sm;
}

template <auto Kernel, typename Grad, typename Low>
void launch_kernel(int64_t elems_per_thread, float* p, const Grad* g, float* m, float* v, Low* lowp, int64_t n,
                   int head, int low_shift, const at::Tensor& grad_scale, const at::Tensor& lr,
                   const at::Tensor& step, const at::Tensor& skip, const AdamHyper& h) {
  const int64_t per_block = kThreads * elems_per_thread;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int64_t resident = int64_t{cached_blocks_per_sm<Kernel>()} * sm_count();
  const int64_t blocks = std::max<int64_t>(1, std::min(wanted, resident));
  Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p, g, m, v, lowp, n, head, low_shift, grad_scale.data_ptr<float>(), lr.data_ptr<float>(),
      step.data_ptr<float>(), skip.data_ptr<bool>(), h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Chooses the path. A head of < 32 elements brings param to a 128-byte boundary (whole cache lines:
// writes that straddle 32-byte sectors cost far more than their bytes); if grad and the moments are
// then aligned to four of their elements (equally misaligned views, as shards of flat buffers are), the
// vector kernel runs, with lowp realigned by shuffles when it is not 8-byte aligned; otherwise the scalar
// kernel.
template <typename Grad, typename Low>
void launch(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
            const at::Tensor& exp_avg_sq, Low* lowp, const at::Tensor& grad_scale, const at::Tensor& lr,
            const at::Tensor& step, const at::Tensor& skip, const AdamHyper& h) {
  const int64_t n = param.numel();
  float* p = param.data_ptr<float>();
  const auto* g = reinterpret_cast<const Grad*>(grad.data_ptr());
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int head = static_cast<int>(
      std::min<int64_t>(n, ((128 - reinterpret_cast<std::uintptr_t>(p) % 128) % 128) / sizeof(float)));
  const bool vec =
      aligned_to(g + head, 4 * sizeof(Grad)) && aligned_to(m + head, 16) && aligned_to(v + head, 16);
  if (!vec) {
    launch_kernel<adam_scalar_kernel<Grad, Low>>(kScalarUnroll, p, g, m, v, lowp, n, 0, 0, grad_scale, lr, step,
                                                 skip, h);
    return;
  }
  if constexpr (std::is_same_v<Low, NoLowp>) {
    launch_kernel<adam_vec_kernel<Grad, Low, false>>(4 * kVecUnroll, p + head, g + head, m + head, v + head,
                                                     lowp, n - head, head, 0, grad_scale, lr, step, skip, h);
  } else {
    Low* low = lowp + head;
    const int misaligned = static_cast<int>(reinterpret_cast<std::uintptr_t>(low) % 8 / sizeof(Low));
    if (misaligned == 0) {
      launch_kernel<adam_vec_kernel<Grad, Low, false>>(4 * kVecUnroll, p + head, g + head, m + head, v + head,
                                                       low, n - head, head, 0, grad_scale, lr, step, skip, h);
    } else {
      launch_kernel<adam_vec_kernel<Grad, Low, true>>(4 * kVecUnroll, p + head, g + head, m + head, v + head,
                                                      low, n - head, head, 4 - misaligned, grad_scale, lr, step,
                                                      skip, h);
    }
  }
}

bool is_low(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

void check_flat(const at::Tensor& t, const char* name, const at::Tensor& param, bool low_ok = false) {
  TORCH_CHECK(t.is_cuda() && (t.scalar_type() == at::kFloat || (low_ok && is_low(t.scalar_type()))) &&
                  t.dim() == 1 && t.is_contiguous(),
              "dsfunc_cuda::adam_step_: ", name, " must be a 1-D contiguous float32",
              low_ok ? " (or bfloat16/float16)" : "", " CUDA tensor, got ",
              t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.device() == param.device() && t.numel() == param.numel(), "dsfunc_cuda::adam_step_: ", name,
              " must match param (", param.numel(), " elements on ", param.device(), "), got ", t.numel(),
              " on ", t.device());
}

void check_scalar(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& param) {
  TORCH_CHECK(t.device() == param.device() && t.scalar_type() == dtype && t.dim() == 0,
              "dsfunc_cuda::adam_step_: ", name, " must be a 0-d ", dtype, " tensor on ",
              param.device(), ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
}

template <typename Grad>
void launch_for_lowp(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& lowp,
                     const at::Tensor& grad_scale, const at::Tensor& lr, const at::Tensor& step,
                     const at::Tensor& skip, const AdamHyper& h) {
  if (!lowp.has_value()) {
    launch<Grad, NoLowp>(param, grad, exp_avg, exp_avg_sq, nullptr, grad_scale, lr, step, skip, h);
  } else if (lowp->scalar_type() == at::kBFloat16) {
    auto* low = reinterpret_cast<__nv_bfloat16*>(lowp->data_ptr());
    launch<Grad, __nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, low, grad_scale, lr, step, skip, h);
  } else {
    auto* low = reinterpret_cast<__half*>(lowp->data_ptr());
    launch<Grad, __half>(param, grad, exp_avg, exp_avg_sq, low, grad_scale, lr, step, skip, h);
  }
}

}  // namespace

static void check_shard(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& lowp,
                        const at::Tensor& grad_scale, const at::Tensor& lr, const at::Tensor& step,
                        const at::Tensor& skip) {
  check_flat(param, "param", param);
  check_flat(grad, "grad", param, /*low_ok=*/true);
  check_flat(exp_avg, "exp_avg", param);
  check_flat(exp_avg_sq, "exp_avg_sq", param);
  check_scalar(grad_scale, "grad_scale", at::kFloat, param);
  check_scalar(lr, "lr", at::kFloat, param);
  check_scalar(step, "step", at::kFloat, param);
  check_scalar(skip, "skip", at::kBool, param);
  if (lowp.has_value()) {
    const at::Tensor& low = *lowp;
    TORCH_CHECK(low.device() == param.device() && low.dim() == 1 && low.is_contiguous() &&
                    low.numel() == param.numel() &&
                    is_low(low.scalar_type()),
                "dsfunc_cuda::adam_step_: lowp must be a 1-D contiguous bfloat16 or float16 tensor of ",
                param.numel(), " elements on ", param.device(), ", got ", low.scalar_type(), " of shape ",
                low.sizes(), " on ", low.device());
  }
}

static void launch_shard(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& lowp,
                         const at::Tensor& grad_scale, const at::Tensor& lr, const at::Tensor& step,
                         const at::Tensor& skip, const AdamHyper& h) {
  if (param.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  if (grad.scalar_type() == at::kBFloat16) {
    launch_for_lowp<__nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, lowp, grad_scale, lr, step, skip, h);
  } else if (grad.scalar_type() == at::kHalf) {
    launch_for_lowp<__half>(param, grad, exp_avg, exp_avg_sq, lowp, grad_scale, lr, step, skip, h);
  } else {
    launch_for_lowp<float>(param, grad, exp_avg, exp_avg_sq, lowp, grad_scale, lr, step, skip, h);
  }
}

// One call per parameter group: the shards' kernels are launched from here, so the step's Python runs once.
// Every shard is checked before any is launched: a bad argument leaves every shard as it was.
void adam_steps_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList lowps, const at::Tensor& grad_scale,
                     const at::Tensor& lr, const at::Tensor& step, const at::Tensor& skip, double beta1,
                     double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  (lowps.empty() || lowps.size() == n),
              "dsfunc_cuda::adam_steps_: one grad, exp_avg and exp_avg_sq per param (and no lowp or one per "
              "param), got ", n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), " and ",
              lowps.size());
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0 && eps >= 0.0 && weight_decay >= 0.0,
              "dsfunc_cuda::adam_steps_: betas must lie in [0, 1) and eps, weight_decay be >= 0, got ", beta1, ", ",
              beta2, ", ", eps, " and ", weight_decay);
  const auto lowp_of = [&](size_t i) {
    return lowps.empty() ? std::nullopt : std::optional<at::Tensor>(lowps[i]);
  };
  for (size_t i = 0; i < n; ++i) {
    check_shard(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], lowp_of(i), grad_scale, lr, step, skip);
  }
  const AdamHyper h = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction);
  for (size_t i = 0; i < n; ++i) {
    launch_shard(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], lowp_of(i), grad_scale, lr, step, skip, h);
  }
}

}  // namespace dsfunc
