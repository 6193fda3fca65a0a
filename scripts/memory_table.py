"""Print docs/scaling.md's memory table: for llama 7B/13B/70B on 64/128/256 GPUs of 80 and 141 GB,
the first layout (smallest tp x pp, then gen tp) and knob set (none; full recompute + sequence
parallel; + offload) that ``hybridrl.planning.memory`` says fits, with the rollout engine holding
at least 64 sequences of its replica at once (or all of them). 16k padded tokens per micro-batch,
4k-token sequences, 8192 sequences per step, bf16, actor + critic + reference, TE spec. SGLang's
KV pool follows its rule (mem_fraction_static x the memory free when the engine starts, less its
weights): 0.5 while training state stays resident, 0.85 with everything offloaded (the engine then
starts on an empty GPU).

    python scripts/memory_table.py            # print the table
    python scripts/memory_table.py --check    # exit 1 if docs/scaling.md holds another table
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridrl.planning.memory import GB, MemoryJob, plan_memory
from hybridrl.reshard.specs import PRESETS

LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (8, 1), (4, 2), (8, 2), (8, 4), (8, 8)]
FULL = frozenset({"params", "grads", "optim"})
KNOBS = [("none", {}), ("full recompute + SP", {"recompute": "full", "sp": True}),
         ("full recompute + SP + offload, mfs 0.85",
          {"recompute": "full", "sp": True, "offload": FULL, "mfs": 0.85})]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"


def first_fit(model: str, world: int, gpu_gb: float):
    shape = PRESETS[model]
    for tp, pp in LAYOUTS:
        if world % (tp * pp) or shape.num_query_groups % tp or shape.layers % pp:
            continue
        for gen_tp in (1, 2, 4, 8):
            if (tp * pp) % gen_tp:
                continue
            for label, k in KNOBS:
                job = MemoryJob(shape, world, tp=tp, pp=pp, gen_tp=gen_tp, gpu_gb=gpu_gb,
                                recompute=k.get("recompute", "none"),
                                sequence_parallel=k.get("sp", False) and tp > 1,
                                offload=k.get("offload", frozenset()),
                                mem_fraction_static=k.get("mfs", 0.5))
                rep = plan_memory(job)
                if rep["fits"] and rep["gen_concurrent_seqs"] >= min(
                        64, rep["gen_seqs_per_replica"]):
                    return tp, pp, gen_tp, label, rep
    return None


def table() -> str:
    lines = ["| model | GPUs | GB | train t x p x d | gen tp | knobs | largest phase | "
             "concurrent seqs / replica |", "|---|---|---|---|---|---|---|---|"]
    for model in ("llama2-7b", "llama2-13b", "llama2-70b"):
        for world in (64, 128, 256):
            for gpu in (80, 141):
                fit = first_fit(model, world, gpu)
                if fit is None:
                    lines.append(f"| {model} | {world} | {gpu} | none fits | | | | |")
                    continue
                tp, pp, gen_tp, label, rep = fit
                knobs = label.replace("+ SP", "") if tp == 1 else label
                worst = rep["largest_phase"]
                lines.append(
                    f"| {model} | {world} | {gpu} | {tp} x {pp} x {world // (tp * pp)} | "
                    f"{gen_tp} | {knobs.replace('  ', ' ')} | {worst} "
                    f"{rep['totals'][worst] / GB:.1f} GB | {rep['gen_concurrent_seqs']} / "
                    f"{rep['gen_seqs_per_replica']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = table()
    if "--check" in argv:
        doc = DOCS.read_text()
        inside = doc.split(BEGIN, 1)[-1].split(END, 1)[0].strip()
        if inside != text:
            print("docs/scaling.md's memory table is stale: run scripts/memory_table.py and "
                  "paste its output between the memory-table markers", file=sys.stderr)
            return 1
        return 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
