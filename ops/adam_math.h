// The arithmetic of one Adam/AdamW element, shared by the CUDA kernel (adam.cu) and the CPU kernel
// (adam_cpu.cpp). It follows dsfunc.optim's transform chain operation by operation, each rounded as torch
// rounds it (an fma where torch's vectorised kernels fuse, a separate rounding elsewhere), so both kernels
// equal the plain-torch reference to within an ulp or two and each other bit for bit. On the device the
// _rn intrinsics keep nvcc from fusing what torch rounds apart; the CPU kernel is compiled with
// -ffp-contract=off for the same reason, and IEEE division and sqrt round alike on both.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DSFUNC_ELEMENT __device__ __forceinline__
#define DSFUNC_MUL(a, b) __fmul_rn(a, b)
#define DSFUNC_ADD(a, b) __fadd_rn(a, b)
#define DSFUNC_DIV(a, b) __fdiv_rn(a, b)
#define DSFUNC_FMA(a, b, c) __fmaf_rn(a, b, c)
#define DSFUNC_SQRT(a) __fsqrt_rn(a)
#else
#define DSFUNC_ELEMENT inline
#define DSFUNC_MUL(a, b) ((a) * (b))
#define DSFUNC_ADD(a, b) ((a) + (b))
#define DSFUNC_DIV(a, b) ((a) / (b))
#define DSFUNC_FMA(a, b, c) std::fma(a, b, c)
#define DSFUNC_SQRT(a) std::sqrt(a)
#endif

namespace dsfunc {

struct AdamHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  double beta1_exact, beta2_exact;  // the betas as given (float64): the bias corrections use these
  bool l2, decoupled, bias_correction;
};

// The hyper-parameters as the op receives them (Python floats are float64).
inline AdamHyper make_hyper(double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                            bool bias_correction) {
  const bool decay = weight_decay != 0.0;
  return AdamHyper{static_cast<float>(beta1),        static_cast<float>(beta2),
                   static_cast<float>(1.0 - beta1),  static_cast<float>(1.0 - beta2),
                   static_cast<float>(eps),          static_cast<float>(weight_decay),
                   beta1,                            beta2,
                   decay && !adam_w_mode,            decay && adam_w_mode,
                   bias_correction};
}

// Per-step values: 1 / (loss scale * clip coefficient), -lr, and the two bias corrections, each computed as
// the reference computes them: 1 - beta1**t and sqrt(1 - beta2**t) in float64, rounded once to float32.
struct AdamScalars {
  float grad_scale, neg_lr, bc1, sqrt_bc2;
};

// The gradient as the moments read it, and the moments' new values (in m and v).
DSFUNC_ELEMENT void adam_moments(float p, float g, float& m, float& v, const AdamHyper& h, const AdamScalars& s) {
  g = DSFUNC_MUL(g, s.grad_scale);
  if (h.l2) g = DSFUNC_FMA(h.weight_decay, p, g);
  m = DSFUNC_FMA(h.one_minus_beta1, g, DSFUNC_MUL(m, h.beta1));
  v = DSFUNC_FMA(DSFUNC_MUL(h.one_minus_beta2, g), g, DSFUNC_MUL(v, h.beta2));
}

// What the step adds to p (the chain's update after the lr), from the new m and sqrt(v): the host's bf16 kernel
// takes sqrt(v) from torch's own sqrt (MKL's, not always correctly rounded) to round where the torch chain does.
DSFUNC_ELEMENT float adam_delta(float p, float m, float sqrt_v, const AdamHyper& h, const AdamScalars& s) {
  const float denom = DSFUNC_ADD(DSFUNC_DIV(sqrt_v, s.sqrt_bc2), h.eps);
  float u = DSFUNC_DIV(DSFUNC_DIV(m, s.bc1), denom);
  if (h.decoupled) u = DSFUNC_FMA(h.weight_decay, p, u);
  return DSFUNC_MUL(u, s.neg_lr);
}

DSFUNC_ELEMENT void adam_update(float& p, float g, float& m, float& v, const AdamHyper& h, const AdamScalars& s) {
  adam_moments(p, g, m, v, h, s);
  p = DSFUNC_ADD(p, adam_delta(p, m, DSFUNC_SQRT(v), h, s));
}

}  // namespace dsfunc
