"""``hybridrl.models.wgrad.linear``: F.linear whose weight gradient is accumulated into main_grad.

Pure parts (one process): outputs, input gradients and ``main_grad`` after two micro-batches
equal ``F.linear`` + autograd + ``main_grad.add_(grad)`` on 3-D, 2-D, 1-D and non-contiguous
inputs, fp32 and fp64; megatron's flag and dummy-gradient contract (``grad_added_to_main_grad``,
``zero_out_wgrad`` zeros that another use of the weight adds to); every fallback (no main_grad,
no flag, dtype mismatch as with bf16 weights and fp32 main_grad, wrong shape, no grad, frozen
weight) is plain F.linear and leaves main_grad alone. Model part, one gloo rank: hybridrl's own
actor (untied, and tied embeddings: megatron's ``zero_out_wgrad`` path) wrapped in megatron's
DDP, its lean linears routed through ``linear``: two optimizer steps of two micro-batches each
give the unfused run's ``main_grad`` (within 1e-6 relative) and parameters, and the fused path
did run (megatron's flag set on every lean linear weight, left False by the unfused run).
"""

import types

import pytest
import torch
import torch.nn.functional as F

from hybridrl.models import wgrad
from hybridrl.testing.dist import run_on_ranks

RTOL = 1e-6


def _weight(out_f, in_f, dtype=torch.float32, main_grad=True, flag=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(out_f, in_f, generator=g, dtype=torch.float64).to(dtype))
    if main_grad:
        w.main_grad = torch.randn(out_f, in_f, generator=g, dtype=torch.float64).to(
            dtype if main_grad is True else main_grad)  # accumulation onto what is there
    if flag:
        w.grad_added_to_main_grad = False
    return w


def _inputs(shape, dtype, seed, transpose=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    if transpose:  # a non-contiguous [s, b, h] view of a [b, s, h] tensor
        x = x.transpose(0, 1)
    return x.requires_grad_()


def _close(got, want):
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= RTOL * scale, float((got - want).abs().max())


@pytest.mark.parametrize("shape,out_f,dtype,transpose", [
    ((5, 3, 16), 24, torch.float32, False),   # [s, b, h]
    ((3, 5, 16), 24, torch.float32, True),    # non-contiguous input
    ((1, 7, 16), 24, torch.float32, True),    # [s, 1, h] from megatron's [1, s, h] embedding
    ((7, 16), 40, torch.float32, False),      # [t, h]
    ((16,), 8, torch.float32, False),         # no leading dim
    ((4, 2, 12), 10, torch.float64, False),   # any one floating dtype
])
def test_fused_equals_autograd_over_two_microbatches(shape, out_f, dtype, transpose):
    fused, ref = _weight(out_f, shape[-1], dtype), _weight(out_f, shape[-1], dtype)
    want_main = ref.main_grad.clone()
    assert wgrad.fusable(_inputs(shape, dtype, 1), fused)
    for mb in range(2):
        x_f, x_r = _inputs(shape, dtype, 10 + mb, transpose), _inputs(shape, dtype, 10 + mb,
                                                                         transpose)
        y_f, y_r = wgrad.linear(x_f, fused), F.linear(x_r, ref)
        assert y_f.shape == y_r.shape and torch.equal(y_f, y_r)
        grad_out = torch.randn(y_r.shape, generator=torch.Generator().manual_seed(20 + mb),
                               dtype=torch.float64).to(dtype)
        if transpose:  # a non-contiguous upstream gradient as well
            grad_out = grad_out.transpose(0, 1).contiguous().transpose(0, 1)
        y_f.backward(grad_out)
        y_r.backward(grad_out)
        want_main += ref.grad  # what megatron DDP's hook does per micro-batch
        ref.grad = None
        _close(x_f.grad, x_r.grad)
        _close(fused.main_grad, want_main)
        assert fused.grad_added_to_main_grad is True  # megatron's hook skips its add
        assert fused.grad is not None and fused.grad.shape == fused.shape  # the dummy
        fused.grad = None  # the hook drops it


def test_input_without_grad_still_accumulates():
    w, ref = _weight(6, 4), _weight(6, 4)
    x = torch.randn(3, 2, 4)
    y = wgrad.linear(x, w)
    y.backward(torch.ones_like(y))
    F.linear(x, ref).backward(torch.ones(3, 2, 6))
    assert x.grad is None
    _close(w.main_grad, ref.main_grad + ref.grad)


def test_zero_out_wgrad_returns_zeros_another_use_adds_to():
    """A stage-local tied weight (megatron sets ``zero_out_wgrad``): the linear's part goes to
    main_grad, the weight's other use (the embedding lookup) to ``weight.grad`` over zeros."""
    for _ in range(3):
        w, ref = _weight(5, 4), _weight(5, 4)
        w.zero_out_wgrad = True
        ids = torch.tensor([1, 3, 3])
        x = torch.randn(3, 4)
        junk = torch.full((5, 4), float("nan"))  # freed memory a torch.empty may reuse
        del junk
        (wgrad.linear(x, w).sum() + F.embedding(ids, w).sum() * 2).backward()
        (F.linear(x, ref).sum() + F.embedding(ids, ref).sum() * 2).backward()
        embedding_part = torch.zeros(5, 4).index_add_(0, ids, torch.full((3, 4), 2.0))
        assert torch.equal(w.grad, embedding_part)
        _close(w.main_grad + w.grad, ref.main_grad + ref.grad)


def _fallback_weights():
    return {
        "no main_grad": _weight(6, 4, main_grad=False),
        "no grad_added_to_main_grad attribute": _weight(6, 4, flag=False),
        "bf16 weight, fp32 main_grad": _weight(6, 4, torch.bfloat16, main_grad=torch.float32),
        "main_grad of another shape": _shaped(_weight(6, 4), (4, 6)),
        "frozen weight": _weight(6, 4).requires_grad_(False),
    }


def _shaped(w, shape):
    w.main_grad = torch.zeros(shape)
    return w


@pytest.mark.parametrize("case", list(_fallback_weights()))
def test_fallback_is_plain_f_linear(case):
    w = _fallback_weights()[case]
    main_before = getattr(w, "main_grad", torch.zeros(0)).clone()
    x = torch.randn(3, 2, 4, dtype=w.dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_(w.requires_grad)
    assert not wgrad.fusable(x, w)
    y = wgrad.linear(x, w)
    assert torch.equal(y, F.linear(x_ref, w_ref))
    assert y.grad_fn.name() == F.linear(x_ref, w_ref).grad_fn.name()  # no custom Function
    y.sum().backward()
    F.linear(x_ref, w_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    if w.requires_grad:
        assert torch.equal(w.grad, w_ref.grad)  # the real gradient, for the hook to add
    assert torch.equal(getattr(w, "main_grad", torch.zeros(0)), main_before)
    assert getattr(w, "grad_added_to_main_grad", False) is False


def test_fallback_input_dtype_and_no_grad():
    w = _weight(6, 4)
    main_before = w.main_grad.clone()
    x64 = torch.randn(2, 4, dtype=torch.float64)
    assert not wgrad.fusable(x64, w)
    with pytest.raises(RuntimeError):  # F.linear's own dtype error, not a silent cast
        wgrad.linear(x64, w)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert not wgrad.fusable(x, w)
        y = wgrad.linear(x, w)
    assert y.grad_fn is None and torch.equal(y, F.linear(x, w.detach()))
    assert torch.equal(w.main_grad, main_before) and w.grad_added_to_main_grad is False


# ---- a real model: hybridrl's actor in megatron's DDP, one gloo rank ----------------------


def _spec(tied):
    from hybridrl.models.spec import LlamaSpec

    return LlamaSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=48, vocab_size=96, max_position_embeddings=64,
                     tie_word_embeddings=tied)


def _loss(outputs, batch):
    logp = outputs["logprobs"][:, :-1]
    loss = -(batch["advantages"][:, :-1] * logp).mean() - 0.01 * outputs["entropy"].mean()
    return loss, {}


def _train(groups, tied, fused, ddp_options=None):
    """Two optimizer steps of two micro-batches (this DP rank's own data): ``main_grad`` after
    each step, the flags of the lean linears' weights, the final parameters."""
    from hybridrl.models import local_spec
    from hybridrl.models.build import build_model
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step

    g = torch.Generator().manual_seed(3 + groups.dp_rank)
    mbs = [{"input_ids": torch.randint(0, 96, (2, 12), generator=g),
            "advantages": torch.randn(2, 12, generator=g)} for _ in range(2)]
    model = build_model(_spec(tied), groups, "actor", seed=5, ddp_options=ddp_options)
    shared = model.module.shared_embedding_or_output_weight()
    lean = [shared if m.weight is None else m.weight for m in model.module.modules()
            if isinstance(m, (local_spec.LeanColumnParallelLinear,
                              local_spec.LeanRowParallelLinear)) and m.lean]
    opt = ModelOptimizer(model, OptimConfig(lr=1e-2, grad_clip=0.0))
    # route the lean linears' call (F.linear today; wgrad.linear once local_spec calls it as
    # ``wgrad.linear``) to the function under test or to plain F.linear, for this test only
    use = wgrad.linear if fused else F.linear
    saved = local_spec.F, getattr(local_spec, "wgrad", None)
    local_spec.F = types.SimpleNamespace(**{**vars(F), "linear": use})
    if saved[1] is not None:
        local_spec.wgrad = types.SimpleNamespace(linear=use)
    out = {"grads": [], "flags": []}
    try:
        for _ in range(2):
            train_step(model, opt, mbs, _loss)
            opt.gather_params()  # overlap_param_gather defers it to the next forward
            out["grads"].append({n: p.main_grad.clone()
                                 for n, p in model.module.named_parameters()})
            out["flags"].append([bool(w.grad_added_to_main_grad) for w in lean])
    finally:
        local_spec.F = saved[0]
        if saved[1] is not None:
            local_spec.wgrad = saved[1]
    out["params"] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    out["n_lean"] = len(lean)
    out["zero_out"] = bool(getattr(shared, "zero_out_wgrad", False))
    return out


def _model_cases(rank, world):
    import warnings

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    warnings.filterwarnings("ignore")
    groups = build_groups(TrainLayout(world=1, tp=1, pp=1))
    return {tied: compare(groups, tied) for tied in (False, True)}


def compare(groups, tied, ddp_options=None) -> dict:
    """The fused run against the unfused one, as plain numbers."""
    base = _train(groups, tied, False, ddp_options)
    got = _train(groups, tied, True, ddp_options)
    return {
        "grad_err": [max(float((a[n] - b[n]).abs().max()) / max(float(b[n].abs().max()), 1e-30)
                         for n in b) for a, b in zip(got["grads"], base["grads"])],
        "param_err": max(float((got["params"][n] - p).abs().max())
                         for n, p in base["params"].items()),
        "flags": (got["flags"], base["flags"]), "n_lean": got["n_lean"],
        "zero_out": got["zero_out"]}


@pytest.fixture(scope="module")
def model_results():
    return run_on_ranks(_model_cases, 1, timeout=300, preload=("megatron.core",))[0]


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_ddp_main_grad_equals_unfused(model_results, tied):
    res = model_results[tied]
    # 2 layers x (qkv, proj, fc1, fc2) + the output layer (tied: the embedding's weight)
    assert res["n_lean"] == 9
    assert res["zero_out"] is tied  # megatron's own marking of a stage-local tied weight
    fused_flags, base_flags = res["flags"]
    assert all(all(step) for step in fused_flags), fused_flags  # the fused path ran
    assert not any(any(step) for step in base_flags), base_flags
    assert len(res["grad_err"]) == 2 and max(res["grad_err"]) <= RTOL, res["grad_err"]
    assert res["param_err"] <= 1e-6, res["param_err"]
