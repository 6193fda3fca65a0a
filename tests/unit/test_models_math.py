"""Pure parts of hybridrl.models: vocab-parallel math (tp=1), LR schedule, HF slicing, CPU compat."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybridrl.models.hf_io import hf_tensors_from_full, local_slice_from_hf
from hybridrl.models.spec import LlamaSpec, padded_vocab_size
from hybridrl.models.train_step import OptimConfig, lr_at
from hybridrl.models.vocab_parallel import (
    reference_logprobs_entropy,
    vocab_parallel_logprobs_entropy,
)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_values_and_grads_match_full_vocab(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 4
    labels = torch.randint(0, 11, (3, 5))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(a, labels, None, temperature=temperature)
    ref_logp, ref_ent = reference_logprobs_entropy(b, labels, temperature=temperature)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    w1, w2 = torch.randn(3, 5), torch.randn(3, 5)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=0)


def test_padding_columns_leave_the_softmax():
    torch.manual_seed(1)
    real = torch.randn(2, 4, 7)
    padded = torch.cat([real, torch.full((2, 4, 9), 5.0)], dim=-1).detach()  # big pad logits
    labels = torch.randint(0, 7, (2, 4))
    padded.requires_grad_(True)
    real.requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(padded, labels, None, vocab_size=7)
    ref_logp, ref_ent = reference_logprobs_entropy(real, labels)
    torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    (logp.sum() + ent.sum()).backward()
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert torch.all(padded.grad[..., 7:] == 0)
    torch.testing.assert_close(padded.grad[..., :7], real.grad, atol=1e-5, rtol=0)
    logp_only, none = vocab_parallel_logprobs_entropy(padded, labels, None, vocab_size=7,
                                                      with_entropy=False)
    assert none is None and torch.allclose(logp_only, logp)


def test_bad_shapes_and_temperature():
    with pytest.raises(ValueError, match="does not match labels"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4).long())
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3).long(),
                                        temperature=0.0)


def test_lr_schedules():
    const = OptimConfig(lr=1.0)
    assert [lr_at(const, s) for s in range(3)] == [1.0, 1.0, 1.0]
    warm = OptimConfig(lr=1.0, lr_schedule="warmup", warmup_steps=4)
    assert [lr_at(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=6,
                      min_lr_ratio=0.1)
    got = [lr_at(cos, s) for s in range(8)]
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]
    assert got[:6] == pytest.approx(want) and got[6:] == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="total_steps"):
        OptimConfig(lr_schedule="cosine", warmup_steps=3, total_steps=3)
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimConfig(lr_schedule="linear")


class _DictReader:
    def __init__(self, tensors):
        self.t = tensors

    def has(self, name):
        return name in self.t

    def full(self, name):
        return self.t[name].clone()

    def rows(self, name, lo, hi):
        return self.t[name][lo:hi].clone()

    def cols(self, name, lo, hi):
        return self.t[name][:, lo:hi].clone()


def _hf_tensors(spec):
    h, hd, f, v = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.vocab_size
    p = "model.layers.0"
    shapes = {
        "model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,),
        f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (spec.num_attention_heads * hd, h),
        f"{p}.self_attn.k_proj.weight": (spec.num_query_groups * hd, h),
        f"{p}.self_attn.v_proj.weight": (spec.num_query_groups * hd, h),
        f"{p}.self_attn.q_proj.bias": (spec.num_attention_heads * hd,),
        f"{p}.self_attn.k_proj.bias": (spec.num_query_groups * hd,),
        f"{p}.self_attn.v_proj.bias": (spec.num_query_groups * hd,),
        f"{p}.self_attn.o_proj.weight": (h, spec.num_attention_heads * hd),
        f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h),
        f"{p}.mlp.down_proj.weight": (h, f),
    }
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


CANONICAL = ["embedding.word_embeddings.weight", "output_layer.weight",
             "decoder.final_layernorm.weight", "decoder.layers.0.input_layernorm.weight",
             "decoder.layers.0.pre_mlp_layernorm.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.self_attention.linear_qkv.bias",
             "decoder.layers.0.self_attention.linear_proj.weight",
             "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_slicing_and_reassembly_are_inverse(tp):
    spec = LlamaSpec(hidden_size=32, num_layers=1, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=24, vocab_size=300, qkv_bias=True,
                     architecture="Qwen2ForCausalLM")
    hf = _hf_tensors(spec)
    reader, vocab = _DictReader(hf), padded_vocab_size(spec.vocab_size, tp)
    rebuilt = {}
    for name in CANONICAL:
        pieces = []
        for rank in range(tp):
            model = SimpleNamespace(spec=spec, role="actor", padded_vocab_size=vocab,
                                    vocab_start=rank * vocab // tp,
                                    groups=SimpleNamespace(tp_size=tp, tp_rank=rank))
            pieces.append(local_slice_from_hf(reader, name, model))
        if "norm" in name:  # replicated
            assert all(torch.equal(p, pieces[0]) for p in pieces)
        rebuilt.update(hf_tensors_from_full(name, pieces, spec))
    assert set(rebuilt) == set(hf)
    for k, t in hf.items():
        assert torch.equal(rebuilt[k], t), k


def test_value_heads_load_score_weight_and_a_reward_model_needs_one():
    spec = LlamaSpec(hidden_size=32, num_layers=1, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=24, vocab_size=300)
    hf = _hf_tensors(spec)
    head = {**hf, "score.weight": torch.randn(1, 32)}

    def model(role):
        return SimpleNamespace(spec=spec, role=role, padded_vocab_size=512, vocab_start=0,
                               groups=SimpleNamespace(tp_size=1, tp_rank=0))

    for role in ("critic", "reward"):
        got = local_slice_from_hf(_DictReader(head), "output_layer.weight", model(role))
        assert torch.equal(got, head["score.weight"]), role
    assert local_slice_from_hf(_DictReader(hf), "output_layer.weight", model("critic")) is None
    with pytest.raises(ValueError, match="reward model folder needs score.weight"):
        local_slice_from_hf(_DictReader(hf), "output_layer.weight", model("reward"))


def test_qkv_rows_are_grouped_q_k_v():
    """TP rank 1 of 2 holds query groups 2, 3: rows [q(g2) k(g2) v(g2) q(g3) k(g3) v(g3)]."""
    spec = LlamaSpec(hidden_size=32, num_layers=1, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=24, vocab_size=300)
    hf = _hf_tensors(spec)
    model = SimpleNamespace(spec=spec, role="actor", padded_vocab_size=512, vocab_start=256,
                            groups=SimpleNamespace(tp_size=2, tp_rank=1))
    qkv = local_slice_from_hf(_DictReader(hf), "decoder.layers.0.self_attention.linear_qkv.weight",
                              model)
    a = "model.layers.0.self_attn"
    hd = 4
    expected = torch.cat([hf[f"{a}.q_proj.weight"][16:24], hf[f"{a}.k_proj.weight"][8:12],
                          hf[f"{a}.v_proj.weight"][8:12], hf[f"{a}.q_proj.weight"][24:32],
                          hf[f"{a}.k_proj.weight"][12:16], hf[f"{a}.v_proj.weight"][12:16]])
    assert hd == spec.head_dim and torch.equal(qkv, expected)


def test_cpu_compat_proxy_and_rng_tracker():
    from hybridrl.models import cpu_compat

    proxy = cpu_compat._CpuTorch()
    assert proxy.zeros(2, device="cuda").device.type == "cpu"
    assert proxy.cuda.current_device() == torch.device("cpu")
    assert proxy.nn is torch.nn and proxy.float32 is torch.float32
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the tracked stream advanced
    again = cpu_compat.CpuRNGStatesTracker()
    again.add("model-parallel-rng", 123)
    with again.fork():
        assert torch.equal(torch.rand(3), first)
    with pytest.raises(KeyError):
        with tracker.fork("nope"):
            pass


def test_left_align_roundtrip():
    from hybridrl.models.forward import left_align, undo_left_align

    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [1, 2, 3, 4, 0, 0], [0, 9, 8, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]])
    aligned, shift = left_align(ids, mask)
    assert shift.tolist() == [2, 0, 1]
    assert aligned.tolist() == [[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 0, 0], [9, 8, 0, 0, 0, 0]]
    aligned_mask, _ = left_align(mask, mask)
    assert aligned_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert torch.equal(undo_left_align(aligned, shift), ids)
    with pytest.raises(ValueError, match="attention_mask"):
        left_align(ids, mask[:, :3])
