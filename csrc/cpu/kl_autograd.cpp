// Autograd kernel of hybridrl::kl_forward (device independent: registered to the Autograd key).
// Forward calls kl_forward below autograd and saves (logprob, ref_logprob); backward calls
// kl_backward with the backward estimator (k2 for the straight-through "+" kinds), except k1,
// whose gradient is the upstream gradient itself. d/d(ref_logprob) = -d/d(logprob) for every
// estimator (all are functions of logprob - ref_logprob). Written in C++ rather than with
// torch.library.register_autograd to keep the per-call overhead off small batches.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "../common.h"

namespace hybridrl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_kl_forward(const at::Tensor& lp, const at::Tensor& ref, int64_t fwd_kind,
                           int64_t bwd_kind) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hybridrl::kl_forward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                               int64_t)>();
  return op.call(lp, ref, fwd_kind, bwd_kind);
}

at::Tensor call_kl_backward(const at::Tensor& grad, const at::Tensor& lp, const at::Tensor& ref,
                            int64_t bwd_kind) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hybridrl::kl_backward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t)>();
  return op.call(grad, lp, ref, bwd_kind);
}

class KlPenalty : public torch::autograd::Function<KlPenalty> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& lp, const at::Tensor& ref,
                            int64_t fwd_kind, int64_t bwd_kind) {
    ctx->save_for_backward({lp, ref});
    ctx->saved_data["bwd_kind"] = bwd_kind;
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_kl_forward(lp, ref, fwd_kind, bwd_kind);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t bwd_kind = ctx->saved_data["bwd_kind"].toInt();
    const at::Tensor g = bwd_kind == kK1 ? grads[0]
                                         : call_kl_backward(grads[0], saved[0], saved[1], bwd_kind);
    return {ctx->needs_input_grad(0) ? g : at::Tensor(),
            ctx->needs_input_grad(1) ? g.neg() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor kl_forward_autograd(const at::Tensor& lp, const at::Tensor& ref, int64_t fwd_kind,
                               int64_t bwd_kind) {
  return KlPenalty::apply(lp, ref, fwd_kind, bwd_kind);
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, Autograd, m) {
  m.impl("kl_forward", &hybridrl::kl_forward_autograd);
}
