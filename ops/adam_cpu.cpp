// Adam/AdamW step over one flat fp32 shard in host memory (ZeRO-Offload): dsfunc_cpu::adam_step_.
//
// One pass over memory, spread over the intra-op threads (at::parallel_for, each thread a contiguous
// range): read the gradient (fp32, or bf16/fp16 widened exactly), param, exp_avg and exp_avg_sq;
// write param, exp_avg, exp_avg_sq and optionally the bf16/fp16 copy the device gets. 28 bytes per
// parameter with 16-bit gradients and copy, where torch's fused CPU Adam needs a widened copy of the
// gradient and a cast afterwards. The element arithmetic is adam_math.h's, the CUDA kernel's: compiled
// with -ffp-contract=off, the two kernels agree bit for bit. The call holds no Python lock.
//
// Both ops take ``sources``: what to read in place of the written tensors' own values (empty: in place). An update
// run ahead of its step (dsfunc/zero/offload/speculation.py) reads the live state and writes spare buffers, which
// become the state by an exchange when it stands: neither a copy to undo it nor a copy back.
#include "adam_math.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sqrt.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace dsfunc {
namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per thread at least: below that, threads cost more than they save

struct NoLowp {};

inline float load(const float* x, int64_t i) { return x[i]; }
inline float load(const c10::BFloat16* x, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(x[i].x) << 16;  // exact
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store(NoLowp*, int64_t, float) {}
inline void store(c10::BFloat16* x, int64_t i, float f) {
  // Round to nearest even, NaN kept quiet: torch's float -> bfloat16 conversion, written branch-free.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  x[i].x = f != f ? uint16_t{0x7fc0} : rounded;
}

template <typename T>
T* advance(T* x, int64_t i) { return x + i; }
inline NoLowp* advance(NoLowp* x, int64_t) { return x; }

// bf16 converts inside the vectorised loop (a shift, a rounding add); fp16 does not (c10::Half's scalar
// conversion kept the loop scalar: 4x slower than bf16, 2x slower than torch's fused Adam), so it is converted
// a block at a time beside the loop, with F16C's vcvtph2ps / vcvtps2ph where the CPU has them (round to
// nearest even, as c10::Half and torch's own casts).
constexpr int64_t kBlock = 1024;  // elements per block: 4 KiB of floats, in L1

template <typename T>
inline void widen(const T* x, float* out, int64_t n) {  // bf16: a shift, vectorised
  for (int64_t i = 0; i < n; ++i) out[i] = load(x, i);
}

inline void widen(const c10::Half* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

inline void narrow(const float* x, c10::Half* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
#endif
  for (; i < n; ++i) out[i] = c10::Half(x[i]);
}

// The decay mode is a template argument so that the loop has no branch left and vectorises.
// What an update reads: the tensors it writes (in place) or, ahead of a step (the speculative update), copies of
// them it leaves as they are. Not restrict: in place they are the written tensors themselves, read element by
// element before the same element is written.
template <typename T>
struct Sources {
  const T* param;
  const T* exp_avg;
  const T* exp_avg_sq;
  const T* comp = nullptr;
  Sources advanced(int64_t i) const { return {param + i, exp_avg + i, exp_avg_sq + i, comp ? comp + i : nullptr}; }
};

template <bool kL2, bool kDecoupled, typename Grad, typename Low>
void update_elements(float* __restrict param, const Grad* __restrict grad, float* __restrict exp_avg,
                     float* __restrict exp_avg_sq, Low* __restrict lowp, int64_t n, AdamHyper h,
                     const AdamScalars s, const Sources<float> src) {
  h.l2 = kL2;
  h.decoupled = kDecoupled;
  for (int64_t i = 0; i < n; ++i) {
    float p = src.param[i], m = src.exp_avg[i], v = src.exp_avg_sq[i];
    adam_update(p, load(grad, i), m, v, h, s);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    store(lowp, i, p);
  }
}

template <bool kL2, bool kDecoupled, typename Grad, typename Low>
void update_range(float* param, const Grad* grad, float* exp_avg, float* exp_avg_sq, Low* lowp, int64_t begin,
                  int64_t end, const AdamHyper& h, const AdamScalars& s, bool over_grad, const Sources<float>& src) {
  constexpr bool kHalfGrad = std::is_same_v<Grad, c10::Half>, kHalfLow = std::is_same_v<Low, c10::Half>;
  if constexpr (!kHalfGrad && !kHalfLow) {
    if (!over_grad) {
      update_elements<kL2, kDecoupled>(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin,
                                       advance(lowp, begin), end - begin, h, s, src.advanced(begin));
      return;
    }
  }
  // A block at a time: fp16 converts beside the loop; with the new parameters written over the gradient
  // (over_grad), the block's gradient is read into L1 first, so the loop's pointers never alias.
  float widened[kBlock];
  NoLowp* none = nullptr;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    const Grad* g = grad + b;
    auto* low = [&] { if constexpr (kHalfLow) return none; else return advance(lowp, b); }();
    if (kHalfGrad || over_grad) {
      widen(g, widened, n);
      update_elements<kL2, kDecoupled>(param + b, static_cast<const float*>(widened), exp_avg + b, exp_avg_sq + b,
                                       low, n, h, s, src.advanced(b));
    } else if constexpr (!kHalfGrad) {
      update_elements<kL2, kDecoupled>(param + b, g, exp_avg + b, exp_avg_sq + b, low, n, h, s, src.advanced(b));
    }
    if constexpr (kHalfLow) narrow(param + b, lowp + b, n);  // the block's new parameters, still in L1
  }
}

template <typename Grad, typename Low>
void update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
            const at::Tensor& exp_avg_sq, Low* lowp, const AdamHyper& h, const AdamScalars& s,
            const Sources<float>& src) {
  float* p = param.data_ptr<float>();
  const Grad* g = reinterpret_cast<const Grad*>(grad.data_ptr());
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const bool over_grad = static_cast<const void*>(lowp) == static_cast<const void*>(g);  // adam_step_cpu checked
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (h.l2) {
      update_range<true, false>(p, g, m, v, lowp, begin, end, h, s, over_grad, src);
    } else if (h.decoupled) {
      update_range<false, true>(p, g, m, v, lowp, begin, end, h, s, over_grad, src);
    } else {
      update_range<false, false>(p, g, m, v, lowp, begin, end, h, s, over_grad, src);
    }
  });
}

template <typename Grad>
void dispatch_lowp(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& lowp, const AdamHyper& h,
                   const AdamScalars& s, const Sources<float>& src) {
  if (!lowp.has_value()) {
    update<Grad, NoLowp>(param, grad, exp_avg, exp_avg_sq, nullptr, h, s, src);
  } else if (lowp->scalar_type() == at::kBFloat16) {
    update<Grad>(param, grad, exp_avg, exp_avg_sq, lowp->data_ptr<c10::BFloat16>(), h, s, src);
  } else {
    update<Grad>(param, grad, exp_avg, exp_avg_sq, lowp->data_ptr<c10::Half>(), h, s, src);
  }
}

// The sources of an update writing param, exp_avg, exp_avg_sq (and compensation): ``sources`` in that order, or
// (empty) the written tensors themselves. Each must be flat, of its written tensor's dtype and size, and apart from
// everything written.
template <typename T>
Sources<T> sources_of(const at::TensorList sources, std::initializer_list<const at::Tensor*> written,
                      const at::Tensor* comp, const char* op) {
  std::vector<const at::Tensor*> outs(written);
  if (comp != nullptr) outs.push_back(comp);
  if (sources.empty()) {
    return {outs[0]->data_ptr<T>(), outs[1]->data_ptr<T>(), outs[2]->data_ptr<T>(),
            comp != nullptr ? comp->data_ptr<T>() : nullptr};
  }
  TORCH_CHECK(sources.size() == outs.size(), op, ": sources must hold ", outs.size(),
              " tensors (param, exp_avg, exp_avg_sq", comp != nullptr ? ", compensation" : "", "), got ",
              sources.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& src = sources[i];
    TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == outs[i]->scalar_type() && src.dim() == 1 &&
                    src.is_contiguous() && src.numel() == outs[i]->numel(),
                op, ": sources[", i, "] must be a flat CPU tensor like the tensor it stands for");
    for (const at::Tensor* out : outs) {
      TORCH_CHECK(at::get_overlap_status(src, *out) == at::MemOverlapStatus::No, op,
                  ": sources must not overlap the tensors the update writes");
    }
  }
  return {sources[0].data_ptr<T>(), sources[1].data_ptr<T>(), sources[2].data_ptr<T>(),
          comp != nullptr ? sources[3].data_ptr<T>() : nullptr};
}

void check_flat(const at::Tensor& t, const char* name, const at::Tensor& param,
                std::initializer_list<at::ScalarType> dtypes, const char* wanted) {
  const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end();
  TORCH_CHECK(t.device().is_cpu() && dtype_ok && t.dim() == 1 && t.is_contiguous(), "dsfunc_cpu: ",
              name, " must be a 1-D contiguous ", wanted, " CPU tensor, got ", t.scalar_type(), " of shape ",
              t.sizes(), " on ", t.device());
  TORCH_CHECK(t.numel() == param.numel(), "dsfunc_cpu: ", name, " must match param (", param.numel(),
              " elements), got ", t.numel());
}

float scalar(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.numel() == 1, "dsfunc_cpu: ", name,
              " must be a one-element ", dtype, " CPU tensor, got ", t.scalar_type(), " of shape ", t.sizes(),
              " on ", t.device());
  return dtype == at::kBool ? static_cast<float>(*t.data_ptr<bool>()) : *t.data_ptr<float>();
}

// The bf16 chain of dsfunc.optim.low_precision (bf16 master, moments and optionally Kahan compensation; fp32
// arithmetic): each element rounded where the torch chain rounds it. The gradient is multiplied by the unscale
// factor, then by the clip coefficient (two roundings, as the chain's two transforms); the moments and update
// are adam_math.h's, sqrt(v) torch's; the new moments round to bf16 once; the new master is (p + delta) rounded to fp32, then
// to bf16. With Kahan: target = p + (delta + c); master = bf16(target); c = bf16(target - master); and the
// master lands as the chain lands it, bf16(p + (master - p)).
inline float round_bf16(float f) {
  c10::BFloat16 b;
  store(&b, 0, f);
  return load(&b, 0);
}

constexpr int64_t kSqrtBlock = 8192;  // elements per torch sqrt call: 32 KiB of floats, its call cost ~1% of the loop

// One thread's range, a block at a time: the moments into L1/L2 buffers, sqrt(v) by torch's own sqrt (the
// chain's; MKL's on x86 builds, which is not always the correctly rounded one), then the update and stores.
template <bool kL2, bool kDecoupled, bool kKahan, typename Grad>
void bf16_range(c10::BFloat16* __restrict param, const Grad* __restrict grad, c10::BFloat16* __restrict exp_avg,
                c10::BFloat16* __restrict exp_avg_sq, c10::BFloat16* __restrict comp, int64_t begin, int64_t end,
                AdamHyper h, const AdamScalars s, const float unscale, const Sources<c10::BFloat16>& src) {
  h.l2 = kL2;
  h.decoupled = kDecoupled;
  float ms[kSqrtBlock], vs[kSqrtBlock];
  const at::Tensor v_view = at::from_blob(vs, {kSqrtBlock}, at::kFloat);
  for (int64_t b = begin; b < end; b += kSqrtBlock) {
    const int64_t n = std::min(kSqrtBlock, end - b);
    c10::BFloat16* __restrict p = param + b;
    c10::BFloat16* __restrict m = exp_avg + b;
    c10::BFloat16* __restrict v = exp_avg_sq + b;
    const Sources<c10::BFloat16> from = src.advanced(b);
    const Grad* __restrict g = grad + b;
    for (int64_t i = 0; i < n; ++i) {
      float mi = load(from.exp_avg, i), vi = load(from.exp_avg_sq, i);
      adam_moments(load(from.param, i), DSFUNC_MUL(load(g, i), unscale), mi, vi, h, s);
      ms[i] = mi;
      vs[i] = vi;
      store(m, i, mi);
      store(v, i, vi);
    }
    at::Tensor part = v_view.narrow(0, 0, n);
    at::sqrt_out(part, part);  // in place: vs now holds sqrt(v)
    for (int64_t i = 0; i < n; ++i) {
      const float pi = load(from.param, i);
      const float delta = adam_delta(pi, ms[i], vs[i], h, s);
      if constexpr (kKahan) {
        const float target = pi + (delta + load(from.comp, i));
        const float master = round_bf16(target);
        store(comp + b, i, target - master);
        store(p, i, pi + (master - pi));
      } else {
        store(p, i, pi + delta);
      }
    }
  }
}

template <typename Grad>
void bf16_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, c10::BFloat16* comp, const AdamHyper& h, const AdamScalars& s,
                 float unscale, const Sources<c10::BFloat16>& src) {
  auto* p = param.data_ptr<c10::BFloat16>();
  const Grad* g = reinterpret_cast<const Grad*>(grad.data_ptr());
  auto* m = exp_avg.data_ptr<c10::BFloat16>();
  auto* v = exp_avg_sq.data_ptr<c10::BFloat16>();
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t b, int64_t e) {
#define DSFUNC_BF16_CASE(L2, DEC)                                                \
  if (comp != nullptr) {                                                         \
    bf16_range<L2, DEC, true>(p, g, m, v, comp, b, e, h, s, unscale, src);       \
  } else {                                                                       \
    bf16_range<L2, DEC, false>(p, g, m, v, comp, b, e, h, s, unscale, src);       \
  }
    if (h.l2) {
      DSFUNC_BF16_CASE(true, false)
    } else if (h.decoupled) {
      DSFUNC_BF16_CASE(false, true)
    } else {
      DSFUNC_BF16_CASE(false, false)
    }
#undef DSFUNC_BF16_CASE
  });
}

}  // namespace

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& lowp, const at::Tensor& grad_scale,
                   const at::Tensor& lr, const at::Tensor& step, const at::Tensor& skip, double beta1, double beta2,
                   double eps, double weight_decay, bool adam_w_mode, bool bias_correction, at::TensorList sources) {
  check_flat(param, "param", param, {at::kFloat}, "float32");
  check_flat(grad, "grad", param, {at::kFloat, at::kBFloat16, at::kHalf}, "float32, bfloat16 or float16");
  check_flat(exp_avg, "exp_avg", param, {at::kFloat}, "float32");
  check_flat(exp_avg_sq, "exp_avg_sq", param, {at::kFloat}, "float32");
  if (lowp.has_value()) {
    check_flat(*lowp, "lowp", param, {at::kBFloat16, at::kHalf}, "bfloat16 or float16");
    const at::MemOverlapStatus overlap = at::get_overlap_status(grad, *lowp);
    TORCH_CHECK(overlap == at::MemOverlapStatus::No ||
                    (overlap == at::MemOverlapStatus::Full && grad.scalar_type() == lowp->scalar_type()),
                "dsfunc_cpu::adam_step_: lowp must be grad itself (the new parameters written over the gradient) "
                "or apart from it, not overlap it otherwise");
  }
  const float scale = scalar(grad_scale, "grad_scale", at::kFloat), rate = scalar(lr, "lr", at::kFloat);
  const float count = scalar(step, "step", at::kFloat);
  const Sources<float> src = sources_of<float>(sources, {&param, &exp_avg, &exp_avg_sq}, nullptr,
                                               "dsfunc_cpu::adam_step_");
  if (scalar(skip, "skip", at::kBool) != 0.f || param.numel() == 0) return;
  const AdamHyper h = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction);
  AdamScalars s{scale, -rate, 1.f, 1.f};
  if (bias_correction) {  // as load_scalars in adam.cu
    s.bc1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(count)));
    s.sqrt_bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(count))));
  }
  switch (grad.scalar_type()) {
    case at::kFloat: dispatch_lowp<float>(param, grad, exp_avg, exp_avg_sq, lowp, h, s, src); break;
    case at::kBFloat16: dispatch_lowp<c10::BFloat16>(param, grad, exp_avg, exp_avg_sq, lowp, h, s, src); break;
    default: dispatch_lowp<c10::Half>(param, grad, exp_avg, exp_avg_sq, lowp, h, s, src); break;
  }
}

void adam_bf16_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& compensation,
                        const at::Tensor& grad_scale, const at::Tensor& clip, const at::Tensor& lr,
                        const at::Tensor& step, const at::Tensor& skip, double beta1, double beta2, double eps,
                        double weight_decay, bool adam_w_mode, bool bias_correction, at::TensorList sources) {
  check_flat(param, "param", param, {at::kBFloat16}, "bfloat16");
  check_flat(grad, "grad", param, {at::kFloat, at::kBFloat16}, "float32 or bfloat16");
  check_flat(exp_avg, "exp_avg", param, {at::kBFloat16}, "bfloat16");
  check_flat(exp_avg_sq, "exp_avg_sq", param, {at::kBFloat16}, "bfloat16");
  if (compensation.has_value()) check_flat(*compensation, "compensation", param, {at::kBFloat16}, "bfloat16");
  for (const at::Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(at::get_overlap_status(param, *t) == at::MemOverlapStatus::No,
                "dsfunc_cpu::adam_bf16_step_: param, grad and the moments must not overlap");
  }
  const float unscale = scalar(grad_scale, "grad_scale", at::kFloat), coef = scalar(clip, "clip", at::kFloat);
  const float rate = scalar(lr, "lr", at::kFloat), count = scalar(step, "step", at::kFloat);
  const Sources<c10::BFloat16> src = sources_of<c10::BFloat16>(
      sources, {&param, &exp_avg, &exp_avg_sq}, compensation.has_value() ? &*compensation : nullptr,
      "dsfunc_cpu::adam_bf16_step_");
  if (scalar(skip, "skip", at::kBool) != 0.f || param.numel() == 0) return;
  const AdamHyper h = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction);
  AdamScalars s{coef, -rate, 1.f, 1.f};
  if (bias_correction) {  // as adam_step_cpu
    s.bc1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(count)));
    s.sqrt_bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(count))));
  }
  c10::BFloat16* comp = compensation.has_value() ? compensation->data_ptr<c10::BFloat16>() : nullptr;
  if (grad.scalar_type() == at::kFloat) {
    bf16_update<float>(param, grad, exp_avg, exp_avg_sq, comp, h, s, unscale, src);
  } else {
    bf16_update<c10::BFloat16>(param, grad, exp_avg, exp_avg_sq, comp, h, s, unscale, src);
  }
}

}  // namespace dsfunc

TORCH_LIBRARY(dsfunc_cpu, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? lowp, Tensor grad_scale, Tensor lr, Tensor step, Tensor skip, float beta1, "
      "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction, Tensor[] sources) -> ()");
  m.def(
      "adam_bf16_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? compensation, Tensor grad_scale, Tensor clip, Tensor lr, Tensor step, Tensor skip, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction, "
      "Tensor[] sources) -> ()");
}

TORCH_LIBRARY_IMPL(dsfunc_cpu, CPU, m) {
  m.impl("adam_step_", &dsfunc::adam_step_cpu);
  m.impl("adam_bf16_step_", &dsfunc::adam_bf16_step_cpu);
}
