// Autograd kernel of hybridrl::kl_backward (registered to the Autograd key: every device), so a
// KL penalty is twice differentiable (create_graph=True, Hessian-vector products, gradgradcheck)
// instead of silently losing the second-order term. kl_backward(g, logp, ref, kind) is
// g * f'(d) with d = logp - ref; its derivatives are
//   d/dg    = kl_backward(gg, logp, ref, kind)            (linear in g)
//   d/dlogp = gg * g * f''(d),   d/dref = -(d/dlogp)
// with f'' as torch's autograd of the reference sees it: 0 for k1 and abs (sign has zero
// gradient), 1 for k2, and for k3 e^c on the tokens where both clamps pass the gradient
// (c = clamp(ref - logp, -20, 20), kld = e^c - c - 1 in [-10, 10]), else 0. The second-order
// terms are ATen ops, hence differentiable again. Without grad mode (the usual first-order
// backward) the kernel calls kl_backward directly: no autograd node, no saved tensors.
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/where.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "../common.h"

namespace hybridrl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_kl_backward_op(const at::Tensor& grad, const at::Tensor& lp,
                               const at::Tensor& ref, int64_t bwd_kind) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hybridrl::kl_backward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t)>();
  return op.call(grad, lp, ref, bwd_kind);
}

// d(kl_backward)/d(logprob) * gg (differentiable ATen ops); undefined where it is zero.
at::Tensor second_order_term(const at::Tensor& gg, const at::Tensor& grad, const at::Tensor& lp,
                             const at::Tensor& ref, int64_t bwd_kind) {
  if (bwd_kind == kK2) return gg * grad;
  if (bwd_kind != kK3) return at::Tensor();  // k1, abs: f'' = 0
  const at::Tensor diff = ref - lp;
  const at::Tensor kl = diff.clamp(-kKlClamp, kKlClamp);
  const at::Tensor e = kl.exp();
  const at::Tensor kld = (e - kl) - 1;
  const at::Tensor pass = diff.ge(-kKlClamp)
                              .logical_and_(diff.le(kKlClamp))
                              .logical_and_(kld.ge(-kKldClamp))
                              .logical_and_(kld.le(kKldClamp));
  return at::where(pass, (gg * grad) * e, 0.0);
}

class KlGrad : public torch::autograd::Function<KlGrad> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& lp,
                            const at::Tensor& ref, int64_t bwd_kind) {
    ctx->save_for_backward({grad, lp, ref});
    ctx->saved_data["bwd_kind"] = bwd_kind;
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_kl_backward_op(grad, lp, ref, bwd_kind);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t bwd_kind = ctx->saved_data["bwd_kind"].toInt();
    const at::Tensor& gg = grads[0];
    at::Tensor d_grad, d_lp;
    if (ctx->needs_input_grad(0)) d_grad = call_kl_backward_op(gg, saved[1], saved[2], bwd_kind);
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      d_lp = second_order_term(gg, saved[0], saved[1], saved[2], bwd_kind);
    }
    const bool has_lp = d_lp.defined();
    return {d_grad, ctx->needs_input_grad(1) && has_lp ? d_lp : at::Tensor(),
            ctx->needs_input_grad(2) && has_lp ? d_lp.neg() : at::Tensor(), at::Tensor()};
  }
};

at::Tensor kl_backward_autograd(const at::Tensor& grad, const at::Tensor& lp,
                                const at::Tensor& ref, int64_t bwd_kind) {
  const bool tracked = at::GradMode::is_enabled() &&
                       (grad.requires_grad() || lp.requires_grad() || ref.requires_grad());
  if (!tracked) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_kl_backward_op(grad, lp, ref, bwd_kind);
  }
  return KlGrad::apply(grad, lp, ref, bwd_kind);
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, Autograd, m) {
  m.impl("kl_backward", &hybridrl::kl_backward_autograd);
}
