"""Rollout engine throughput: the builtin engine vs transformers' ``generate``, same model and batch.

    .venv/bin/python benchmarks/rollout_engine.py [--batch 16] [--prompt 32] [--new 64]
        [--rounds 5] [--threads 1] [--device cpu|cuda] [--dtype fp32|bf16] [--size small|1b]
        [--eos auto]

One llama (random weights from a fixed seed, ``--size``: ``tiny`` the CPU demo's model, ``small``
~30M parameters, ``1b`` a ~1B TinyLlama-like shape) is built as transformers' ``LlamaForCausalLM``; the builtin engine gets
the very same weights in its engine format (``hf_to_canonical`` + ``engine_format``, gen tp 1).
Both decode greedily (no eos: every row generates exactly ``--new`` tokens; transformers with
``min_new_tokens = max_new_tokens``, KV cache on) from the same ``--batch`` prompts of ``--prompt``
random ids. Rounds alternate A/B/A/B after one warm-up call each; the table gives, per side, the
median seconds per ``generate`` call (prefill + decode), the range, generated tokens/s
(batch x new / seconds) and the ratio builtin / transformers of tokens/s, from the same run. The
first token ids of both sides are compared (fp32 on CPU: equal) so the two compute the same thing.
``--eos auto``: both sample at temperature 1 (no top-k/p) and stop a row at one token, picked
from a builtin run without eos so that its first occurrences end the rows after about 0.42 x
``--new`` tokens on mean (the issue's ~27 of 64): the length mix has the same law on both sides
(not the same draws: each side's own RNG), each side's tokens/s counts its own real tokens, and
the token agreement line is not meaningful there. A third side runs
the builtin engine decoding finished rows to the end (``compact_at=0``), the ratio showing what
dropping finished rows saves.

Realistic cells (issue 45's shape; the model is benchmarks/trl_model.py's ``12m`` llama, 12.6M
parameters, with eos probability 1/30 at every sampled token, char-vocabulary prompts of 18-26
tokens, temperature 1, at most ``--new`` 64 tokens, CPU seconds by ``time.process_time``):

    .venv/bin/python benchmarks/rollout_engine.py --cell grpo        # ~1 min
    .venv/bin/python benchmarks/rollout_engine.py --cell multi_turn  # ~1 min

``--cell grpo``: ``--groups`` 12 distinct prompts x ``--samples`` 8, each prompt's rows next to
each other as GRPO hands them, in one ``generate`` call: the builtin engine with shared prefill
(each distinct prompt prefilled once), with it off (``share_prefill=False``: every row
prefilled) and transformers' ``generate`` (left-padded, sampling, eos 2); per side the median
CPU seconds per call, the range, the responses' mean length (each side its own draws of the
same law) and CPU ms per response token, then the ratios. ``--cell multi_turn``: the same
96 sequences through the agent loop (plain format, the calculator, <= 4 turns, ``--new``
tokens per turn, ``--turn-budget`` 192 per tail; '>' made as likely as eos, so turns end in
tool calls, mostly error outputs of random text), continuation on vs off (whole contexts
resent each turn): CPU seconds per ``AgentLoop.run``, prompt tokens the engine prefilled, and
that the tails are equal and the log-probs' largest gap.
"""

from __future__ import annotations

import argparse
import dataclasses
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

    hidden, ffn, heads, kv, layers, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return model, engine_of(model, device, dtype)


def engine_of(model, device: str, dtype, **kwargs):
    """A builtin engine (gen tp 1) holding ``model``'s weights in its engine format."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.formats import engine_format, hf_to_canonical
    from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, gen_placement
    from hybridrl.reshard.specs import LlamaShape, build_specs
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

    c = model.config
    hidden, ffn, heads, kv = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                              c.num_key_value_heads)
    layers, vocab = c.num_hidden_layers, c.vocab_size
    shape = LlamaShape(hidden=hidden, ffn=ffn, heads=heads, num_query_groups=kv, layers=layers,
                       vocab=vocab)
    gen = gen_placement(TrainLayout(1), shape, 1, 1, vocab_pad=ENGINE_VOCAB_PAD)
    canonical = hf_to_canonical(shape, dict(model.state_dict()))
    fmt = engine_format(shape, gen, 0)
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    spec = EngineSpec(hidden, ffn, heads, kv, hidden // heads, layers, vocab, gen.vocab_chunk,
                      theta, c.rms_norm_eps, False, 4096)
    engine = BuiltinEngine(spec, device=device, dtype=dtype, **kwargs)
    for s in build_specs(shape):
        engine.update_weights(fmt(s, canonical[s.key]))
    engine.finish_update()
    return engine


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


def _eos_for_mean(free, target: float) -> int:
    """The token whose first greedy occurrence ends the rows nearest ``target`` tokens on mean."""
    import torch

    best, best_gap = 0, float("inf")
    width = free.shape[1]
    for tok in torch.unique(free).tolist():
        hit = free == tok
        first = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.tensor(width))
        gap = abs(float(first.float().mean()) - target)
        if gap < best_gap:
            best, best_gap = tok, gap
    return best


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
    stop = {"min_new_tokens": args.new, "do_sample": False}
    if args.eos == "auto":  # rows end at different steps, on both sides (see the docstring)
        params = dataclasses.replace(params, temperature=1.0, seed=7,
                                     row_seeds=tuple(range(args.batch)))
        free = engine.generate(prompts.tolist(), params).response_ids
        eos = _eos_for_mean(free, 0.42 * args.new)
        params = dataclasses.replace(params, eos_token_id=eos)
        stop = {"eos_token_id": eos, "do_sample": True, "temperature": 1.0, "top_k": 0}
    out = {}

    @torch.no_grad()
    def hf():
        torch.manual_seed(7)
        out["hf"] = model.generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                   pad_token_id=0, use_cache=True, **stop)[:, args.prompt:]
        ended = out["hf"] == stop.get("eos_token_id", -1)  # tokens up to the first eos count
        first = torch.where(ended.any(1), ended.float().argmax(1) + 1,
                            torch.tensor(out["hf"].shape[1]))
        out["hf_lengths"] = first.tolist()

    def builtin():
        res = engine.generate(prompts.tolist(), params)
        out["builtin"], out["lengths"] = res.response_ids, res.response_mask.sum(1)

    def builtin_all_rows():  # finished rows decoded to the end, as before compaction
        engine.compact_at, at = 0.0, engine.compact_at
        try:
            engine.generate(prompts.tolist(), params)
        finally:
            engine.compact_at = at

    sides = {"builtin engine": builtin, "transformers generate": hf}
    if args.eos == "auto":
        sides["builtin, no compaction"] = builtin_all_rows
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = _rounds(sides, args.rounds, sync)
    first_equal = bool(torch.equal(out["hf"][:, 0].cpu(), out["builtin"][:, 0].cpu()))
    width = min(out["hf"].shape[1], out["builtin"].shape[1])
    all_equal = float((out["hf"][:, :width].cpu() == out["builtin"][:, :width].cpu())
                      .float().mean())
    return {"times": times, "first_equal": first_equal, "agree": all_equal,
            "lengths": out["lengths"].tolist(), "hf_lengths": out["hf_lengths"]}


def report(args, res) -> str:
    lens, hf_lens = res["lengths"], res["hf_lengths"]
    n = sum(lens)  # each side's generated tokens (every row: --new without an eos)
    spread = (f"sampled at temperature 1 to an eos: builtin lengths {min(lens)}-{max(lens)} "
              f"(mean {n / len(lens):.1f}), transformers {min(hf_lens)}-{max(hf_lens)} (mean "
              f"{sum(hf_lens) / len(hf_lens):.1f}), of at most {args.new}"
              if args.eos == "auto" else f"{args.new} new tokens, greedy")
    lines = [f"rollout engine: llama {args.size} {SIZES[args.size]}, {args.device} {args.dtype}, "
             f"{args.threads} thread(s), batch {args.batch}, prompt {args.prompt}, "
             f"{spread}; median of {args.rounds} interleaved rounds",
             f"{'engine':<24}{'s/call':>9}{'range':>18}{'tokens/s':>10}"]
    tps = {}
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        tps[name] = (sum(hf_lens) if name == "transformers generate" else n) / med
        lines.append(f"{name:<24}{med:>9.3f}{f'{min(ts):.3f}-{max(ts):.3f}':>18}{tps[name]:>10.0f}")
    ratio = tps["builtin engine"] / tps["transformers generate"]
    lines.append(f"ratio builtin / transformers tokens/s = {ratio:.2f}; first tokens equal: "
                 f"{res['first_equal']}; tokens agreeing: {res['agree']:.0%}")
    if "builtin, no compaction" in tps:
        lines.append(f"finished rows dropped (compact_at 0.25) / decoded to the end: "
                     f"{tps['builtin engine'] / tps['builtin, no compaction']:.2f}x tokens/s")
    return "\n".join(lines)


def _cpu_rounds(fns: dict, rounds: int) -> dict:
    """Process CPU seconds of each side, interleaved rounds after one warm-up call each."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[k].append(time.process_time() - t0)
    return times


def _realistic(args):
    """(HF model, prompts): trl_model's ``12m`` llama with eos probability 1/30 per sampled
    token, ``--groups`` distinct char-vocabulary prompts of 18-26 tokens (mean ~22)."""
    import tempfile

    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.trl_model import make_folder

    with tempfile.TemporaryDirectory() as tmp:
        eos_p = make_folder(Path(tmp), "12m", eos_p=1 / 30)
        model = LlamaForCausalLM.from_pretrained(tmp).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist()
               for n in torch.randint(18, 27, (args.groups,), generator=g)]
    return model, prompts, eos_p


def run_grpo(args) -> str:
    """The GRPO cell: each prompt ``--samples`` times in one call (module docstring)."""
    import torch

    from hybridrl.rollout.base import SamplingParams

    torch.set_num_threads(args.threads)
    model, prompts, eos_p = _realistic(args)
    batch = [p for p in prompts for _ in range(args.samples)]  # as GRPO hands them
    shared = engine_of(model, "cpu", torch.float32)
    separate = engine_of(model, "cpu", torch.float32, share_prefill=False)
    params = SamplingParams(args.new, temperature=1.0, eos_token_id=2, pad_token_id=0,
                            row_seeds=tuple(range(len(batch))))
    P = max(map(len, batch))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in batch])
    mask = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in batch])[:, None]).long()
    lengths = {}

    def builtin(engine, name):
        def call():
            lengths[name] = engine.generate(batch, params).response_mask.sum(1).tolist()
        return call

    @torch.no_grad()
    def hf():
        torch.manual_seed(7)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new, pad_token_id=0,
                             eos_token_id=2, do_sample=True, temperature=1.0, top_k=0,
                             use_cache=True)[:, P:]
        ended = out == 2
        lengths["hf"] = torch.where(ended.any(1), ended.float().argmax(1) + 1,
                                    torch.tensor(out.shape[1])).tolist()

    sides = {"builtin, shared prefill": builtin(shared, "shared"),
             "builtin, each row": builtin(separate, "separate"), "transformers generate": hf}
    times = _cpu_rounds(sides, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"GRPO cell: llama 12m, cpu fp32, {args.threads} thread(s), {args.groups} prompts x "
             f"{args.samples} samples, prompts {min(map(len, prompts))}-{P} tokens, at most "
             f"{args.new} new, temperature 1, eos p={eos_p:.4f}; CPU seconds per generate call, "
             f"median of {args.rounds} interleaved rounds"]
    for name, key in zip(sides, ("shared", "separate", "hf")):
        ls = lengths[key]
        lines.append(f"{name:<26}{med[name]:>8.3f} s  range {min(times[name]):.3f}-"
                     f"{max(times[name]):.3f}  response mean {sum(ls) / len(ls):.1f} tokens, "
                     f"{1e3 * med[name] / sum(ls):.2f} ms per token")
    a, b, c = (med[k] for k in sides)
    lines.append(f"shared / each row: {b / a:.2f}x faster; shared / transformers: {c / a:.2f}x "
                 f"faster; each row / transformers: {c / b:.2f}x")
    return "\n".join(lines)


def run_multi_turn(args) -> str:
    """The multi-turn cell: the agent loop, continuation on vs off (module docstring)."""
    import torch

    from hybridrl.data.tokenizer import CharTokenizer
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.multi_turn import AgentLoop, Budgets, build_format
    from hybridrl.tools import build_tools

    torch.set_num_threads(args.threads)
    model, prompts, eos_p = _realistic(args)
    close = CharTokenizer().encode(">")[0]
    with torch.no_grad():  # the plain format's call marker as likely as eos: turns end in calls
        model.lm_head.weight[close] = model.lm_head.weight[2]
    batch = [p for p in prompts for _ in range(args.samples)]
    engine = engine_of(model, "cpu", torch.float32)
    tools = build_tools(["calculator"])
    fmt = build_format("plain", CharTokenizer(), tools.schemas())
    budgets = Budgets(args.turn_budget, max_tokens_per_turn=args.new, max_assistant_turns=4)
    params = SamplingParams(args.new, temperature=1.0, eos_token_id=2, pad_token_id=0,
                            row_seeds=tuple(range(len(batch))))
    seen = {}

    def side(continuation):
        def call():
            before = engine.prefilled
            out = AgentLoop(engine, fmt, tools, budgets, continuation=continuation).run(
                batch, params)
            seen[continuation] = (engine.prefilled - before, out)
        return call

    times = _cpu_rounds({"continuation": side(True), "whole contexts": side(False)}, args.rounds)
    (pre_on, on), (pre_off, off) = seen[True], seen[False]
    same = bool(torch.equal(on.response_ids, off.response_ids))
    gap = float((on.logprobs - off.logprobs).abs().max())
    st = on.stats
    a, b = (statistics.median(v) for v in times.values())
    return "\n".join([
        f"multi-turn cell: llama 12m, cpu fp32, {args.threads} thread(s), {len(batch)} sequences "
        f"({args.groups} prompts x {args.samples}), plain format + calculator, <= 4 turns, "
        f"{args.new} tokens per turn, {args.turn_budget} per tail, eos and '>' p~{eos_p:.4f}: "
        f"{st['turns'] / st['sequences']:.2f} turns and {st['tool_calls'] / st['sequences']:.2f} "
        f"tool calls per sequence, {st['model_tokens']} model + {st['tool_tokens']} tool tokens; "
        f"CPU seconds per AgentLoop.run, median of {args.rounds} interleaved rounds",
        f"{'continuation':<26}{a:>8.3f} s  range {min(times['continuation']):.3f}-"
        f"{max(times['continuation']):.3f}  prefilled {pre_on} tokens",
        f"{'whole contexts':<26}{b:>8.3f} s  range {min(times['whole contexts']):.3f}-"
        f"{max(times['whole contexts']):.3f}  prefilled {pre_off} tokens",
        f"continuation / whole contexts: {b / a:.2f}x faster, {pre_off / max(pre_on, 1):.2f}x "
        f"fewer prefilled tokens; tails equal: {same}, log-prob gap {gap:.1e}"])


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
    ap.add_argument("--eos", choices=("none", "auto"), default="none",
                    help="auto: stop rows at the most frequent greedy token (lengths vary)")
    ap.add_argument("--cell", choices=("engine", "grpo", "multi_turn"), default="engine",
                    help="grpo / multi_turn: the realistic cells (module docstring)")
    ap.add_argument("--groups", type=int, default=12, help="grpo / multi_turn: prompts")
    ap.add_argument("--samples", type=int, default=8, help="grpo / multi_turn: rows per prompt")
    ap.add_argument("--turn-budget", type=int, default=192, help="multi_turn: tokens per tail")
    args = ap.parse_args(argv)
    if args.cell == "grpo":
        print(run_grpo(args))
    elif args.cell == "multi_turn":
        print(run_multi_turn(args))
    else:
        print(report(args, run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
