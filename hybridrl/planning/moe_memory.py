"""The mixture-of-experts terms of the memory plan (pure; ``hybridrl.planning.memory`` uses them).

Contract (a Qwen3-MoE ``LlamaShape``: ``num_experts`` E, ``moe_topk`` k, ``moe_ffn_hidden_size``
Fm; dense shapes give 0 everywhere, so dense plans are unchanged):
- ``check_expert_layout(shape, world, tp, pp, ep, etp)``: one ValueError unless megatron can lay
  the experts out: etp * ep * pp divides the world, ep divides E, etp divides Fm; ep > 1 or
  etp != tp on a dense shape is refused.
- ``expert_numel(shape, pp, stage, ep, etp)``: expert parameters one rank of ``stage`` holds:
  E/ep experts of every layer of the stage, each cut over expert TP (etp). They count in the
  rank's params and fp32 grads like the dense ones; their optimizer state is sharded over the
  expert-data-parallel group (edp = world / (etp * ep * pp)) instead of dp.
- ``moe_activation_parts(shape, tokens, layers, tp, etp, sp, itemsize, spec)`` for one
  micro-batch of ``tokens`` tokens through ``layers`` MoE layers (what the backward keeps):
  ``router_logits``: the router's logits and the fp32 softmax scores it saves for the
  backward (and the aux loss), per token of this rank (tokens / tp under sequence parallelism)
  x E; ``moe_dispatch``: the alltoall dispatcher's buffers, i.e. the k routed copies of each
  token (balanced routing: a rank's experts receive tokens * k rows of H), kept as the experts'
  input and as the combine's saved input, 2 x tokens x k x H at the activation dtype;
  ``experts``: the experts' SwiGLU tensors for those rows (local spec: fc1 output, gate, silu,
  product: 5 x Fm/etp per row; TE grouped GEMM: 3 x Fm/etp). These replace the dense MLP's
  terms of ``memory._layer_elements_per_token``.
- ``MOE_NOTE``: the one line a report prints about these assumptions.
"""

from __future__ import annotations

MOE_NOTE = ("MoE: expert weights over ep x etp, their optimizer state over edp; balanced "
            "routing (each rank's experts get tokens x k rows)")


def _is_expert(spec) -> bool:
    return getattr(spec, "expert", None) is not None


def check_expert_layout(shape, world: int, tp: int, pp: int, ep: int, etp: int) -> None:
    """ValueError (one line) unless the experts of ``shape`` split as megatron lays them out."""
    experts = getattr(shape, "num_experts", 0)
    if not experts:
        if ep != 1 or etp != tp:
            raise ValueError(f"--ep {ep} / --etp {etp} need a mixture-of-experts model; this "
                             "one is dense")
        return
    if world % (etp * ep * pp):
        raise ValueError(f"--world {world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = "
                         f"{etp * ep * pp} (megatron's expert layout)")
    if experts % ep:
        raise ValueError(f"--ep {ep} must divide num_experts={experts}")
    if shape.moe_ffn_hidden_size % etp:
        raise ValueError(f"expert tp {etp} must divide moe_ffn_hidden_size="
                         f"{shape.moe_ffn_hidden_size}")


def expert_numel(shape, pp: int, stage: int, ep: int, etp: int) -> int:
    """Expert parameters one rank of pipeline ``stage`` holds (E/ep experts, 1/etp of each)."""
    from hybridrl.reshard.specs import build_specs

    if not getattr(shape, "num_experts", 0):
        return 0
    total = sum(spec.numel for spec in build_specs(shape)
                if _is_expert(spec) and spec.on_stage(pp, shape.layers, stage))
    return total // (ep * etp)


def moe_activation_parts(shape, tokens: int, layers: int, tp: int, etp: int, sp: bool,
                         itemsize: int, spec: str) -> dict[str, int]:
    """Bytes the MoE layers of one micro-batch keep for the backward (see the docstring)."""
    if not getattr(shape, "num_experts", 0):
        return {}
    k, h, fm, e = shape.moe_topk, shape.hidden, shape.moe_ffn_hidden_size, shape.num_experts
    own = tokens / tp if sp else tokens  # the router sees this rank's tokens
    routed = tokens * k  # rows the rank's experts receive (balanced)
    per_row = (5 if spec == "local" else 3) * fm / etp
    return {
        "router_logits": int(layers * own * e * (itemsize + 4)),
        "moe_dispatch": int(layers * routed * 2 * h * itemsize),
        "experts": int(layers * routed * per_row * itemsize),
    }
