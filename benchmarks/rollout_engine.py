"""Rollout engine throughput: the builtin engine vs transformers' ``generate``, same model and batch.

    .venv/bin/python benchmarks/rollout_engine.py [--batch 16] [--prompt 32] [--new 64]
        [--rounds 5] [--threads 1] [--device cpu|cuda] [--dtype fp32|bf16] [--size small|1b]

One llama (random weights from a fixed seed, ``--size``: ``tiny`` the CPU demo's model, ``small``
~30M parameters, ``1b`` a ~1B TinyLlama-like shape) is built as transformers' ``LlamaForCausalLM``; the builtin engine gets
the very same weights in its engine format (``hf_to_canonical`` + ``engine_format``, gen tp 1).
Both decode greedily (no eos: every row generates exactly ``--new`` tokens; transformers with
``min_new_tokens = max_new_tokens``, KV cache on) from the same ``--batch`` prompts of ``--prompt``
random ids. Rounds alternate A/B/A/B after one warm-up call each; the table gives, per side, the
median seconds per ``generate`` call (prefill + decode), the range, generated tokens/s
(batch x new / seconds) and the ratio builtin / transformers of tokens/s, from the same run. The
first token ids of both sides are compared (fp32 on CPU: equal) so the two compute the same thing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {  # hidden, ffn, heads, kv heads, layers, vocab
    "tiny": (64, 128, 4, 2, 4, 100),  # the CPU demo's builtin model (configs/demo_cpu.yaml)
    "small": (512, 1408, 8, 4, 8, 8000),
    "1b": (2048, 5632, 16, 8, 22, 32000),
}


def build_pair(size: str, device: str, dtype):
    """(transformers model, builtin engine) holding the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.formats import engine_format, hf_to_canonical
    from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, gen_placement
    from hybridrl.reshard.specs import LlamaShape, build_specs
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

    hidden, ffn, heads, kv, layers, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    shape = LlamaShape(hidden=hidden, ffn=ffn, heads=heads, num_query_groups=kv, layers=layers,
                       vocab=vocab)
    gen = gen_placement(TrainLayout(1), shape, 1, 1, vocab_pad=ENGINE_VOCAB_PAD)
    canonical = hf_to_canonical(shape, dict(model.state_dict()))
    fmt = engine_format(shape, gen, 0)
    spec = EngineSpec(hidden, ffn, heads, kv, hidden // heads, layers, vocab, gen.vocab_chunk,
                      cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0, cfg.rms_norm_eps,
                      False, 4096)
    engine = BuiltinEngine(spec, device=device, dtype=dtype)
    for s in build_specs(shape):
        engine.update_weights(fmt(s, canonical[s.key]))
    engine.finish_update()
    return model, engine


def _rounds(fns: dict, rounds: int, sync) -> dict:
    for fn in fns.values():  # warm-up
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


def run(args) -> dict:
    import torch

    from hybridrl.rollout.base import SamplingParams

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, engine = build_pair(args.size, args.device, dtype)
    vocab = SIZES[args.size][5]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (args.batch, args.prompt), generator=g)
    ids = prompts.to(args.device)
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=args.new, temperature=0.0, pad_token_id=0)
    out = {}

    @torch.no_grad()
    def hf():
        out["hf"] = model.generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                   min_new_tokens=args.new, do_sample=False, pad_token_id=0,
                                   use_cache=True)[:, args.prompt:]

    def builtin():
        out["builtin"] = engine.generate(prompts.tolist(), params).response_ids

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = _rounds({"builtin engine": builtin, "transformers generate": hf}, args.rounds, sync)
    first_equal = bool(torch.equal(out["hf"][:, 0].cpu(), out["builtin"][:, 0].cpu()))
    all_equal = float((out["hf"].cpu() == out["builtin"].cpu()).float().mean())
    return {"times": times, "first_equal": first_equal, "agree": all_equal}


def report(args, res) -> str:
    n = args.batch * args.new
    lines = [f"rollout engine: llama {args.size} {SIZES[args.size]}, {args.device} {args.dtype}, "
             f"{args.threads} thread(s), batch {args.batch}, prompt {args.prompt}, "
             f"{args.new} new tokens, greedy; median of {args.rounds} interleaved rounds",
             f"{'engine':<24}{'s/call':>9}{'range':>18}{'tokens/s':>10}"]
    tps = {}
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        tps[name] = n / med
        lines.append(f"{name:<24}{med:>9.3f}{f'{min(ts):.3f}-{max(ts):.3f}':>18}{tps[name]:>10.0f}")
    ratio = tps["builtin engine"] / tps["transformers generate"]
    lines.append(f"ratio builtin / transformers tokens/s = {ratio:.2f}; first tokens equal: "
                 f"{res['first_equal']}; tokens agreeing: {res['agree']:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = ap.parse_args(argv)
    print(report(args, run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
