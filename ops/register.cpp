// Registers the CUDA kernels of ops/ as torch ops in the private namespace dsfunc_cuda.
// dsfunc/kernels.py defines the public ops (dsfunc::*) and forwards to these on CUDA tensors.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

namespace dsfunc {
void adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& lowp,
                    const at::Tensor& grad_scale, const at::Tensor& lr, const at::Tensor& step,
                    const at::Tensor& skip, double beta1, double beta2, double eps, double weight_decay,
                    bool adam_w_mode, bool bias_correction);
at::Tensor sum_of_squares_cuda(at::TensorList tensors);
at::Tensor cross_entropy_rows_cuda(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& scale,
                                   int64_t ignore_index, bool write_grad);
}  // namespace dsfunc

TORCH_LIBRARY(dsfunc_cuda, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? lowp, Tensor grad_scale, Tensor lr, Tensor step, Tensor skip, float beta1, "
      "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction) -> ()");
  m.def("sum_of_squares(Tensor[] tensors) -> Tensor");
  m.def("cross_entropy_rows_(Tensor(a!) logits, Tensor target, Tensor scale, int ignore_index, bool write_grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsfunc_cuda, CUDA, m) {
  m.impl("adam_step_", &dsfunc::adam_step_cuda);
  m.impl("sum_of_squares", &dsfunc::sum_of_squares_cuda);
  m.impl("cross_entropy_rows_", &dsfunc::cross_entropy_rows_cuda);
}
