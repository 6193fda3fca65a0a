"""Another trainer's megatron-core GPTModel, resharded by hybridrl into a 20-line custom engine.

Contract: ``run(rank, world, hf_folder)`` runs on every rank of an initialized process group of
``world`` ranks (gloo on CPU, NCCL on GPU). The "other trainer" holds a megatron-core GPTModel
sharded over TP = ``world`` (built here from a local HF folder with ``hybridrl.build_from_hf``
for brevity; any GPTModel with megatron's parameter names works, given its ``TrainLayout`` and
``LlamaShape``). ``reshard_into`` plans the move to generation TP = 1 (every rank receives the
whole model: the zero-redundancy strategy, one exchange inside the micro-DP group) and runs it
bucket by bucket into ``HFEngine``, a rollout engine of 20 lines that loads full HF tensors into
transformers' model (``hf_format``). Returns this rank's engine state dict and the engine's greedy
``GenerationOutput`` for one prompt.

    torchrun --nproc-per-node 2 examples/custom_engine_from_megatron.py path/to/hf_llama_folder
"""

from __future__ import annotations

import sys

import torch

import hybridrl


class HFEngine:
    """The rollout-engine protocol (hybridrl.RolloutEngine) on transformers, full weights."""

    def __init__(self, folder: str) -> None:
        import transformers

        config = transformers.AutoConfig.from_pretrained(folder)
        self.model = transformers.AutoModelForCausalLM.from_config(config).eval()
        self.received: dict[str, torch.Tensor] = {}

    def update_weights(self, named_tensors) -> None:  # once per bucket; never communicates
        self.received.update((name, t.clone()) for name, t in named_tensors)

    def finish_update(self) -> None:  # once per sync: every tensor has arrived
        self.model.load_state_dict(self.received, strict=True)
        self.received = {}

    @torch.no_grad()
    def generate(self, prompt_ids, params: hybridrl.SamplingParams):
        ids_BP = torch.tensor(prompt_ids)  # equal-length prompts, greedy
        out_BL = self.model.generate(ids_BP, max_new_tokens=params.max_new_tokens,
                                     do_sample=False, pad_token_id=params.pad_token_id)
        resp_BR = out_BL[:, ids_BP.shape[1]:]
        logp_BLV = torch.log_softmax(self.model(out_BL).logits[:, ids_BP.shape[1] - 1:-1], -1)
        logp_BR = logp_BLV.gather(-1, resp_BR[..., None]).squeeze(-1)
        return hybridrl.GenerationOutput(resp_BR, torch.ones_like(resp_BR), logp_BR)


@torch.no_grad()
def reshard_into(engine, gpt_model, layout, shape, rank: int, naming: str = "local"):
    """Move ``gpt_model``'s train shards (``layout``) into ``engine`` at gen TP = 1 (collective)."""
    gen = hybridrl.gen_placement(layout, shape, tp=1)  # nests in any training layout
    plan = hybridrl.plan_reshard(hybridrl.train_placement(layout, shape), gen,
                                 hybridrl.build_specs(shape, naming), "zero_redundancy",
                                 bucket_mb=1, itemsize=4)
    named = {n: p.detach() for n, p in gpt_model.named_parameters()}  # stage-local names
    asm = hybridrl.Assembler(plan, rank, hybridrl.hf_format(shape), sink=engine.update_weights,
                             dtype=torch.float32)
    stats = hybridrl.run_plan(plan, rank, hybridrl.train_sources(plan, rank, named), asm)
    asm.result()
    engine.finish_update()
    return stats


def run(rank: int, world: int, hf_folder: str):
    layout = hybridrl.TrainLayout(world=world, tp=world)
    groups = hybridrl.build_groups(layout, None)
    sharded = hybridrl.build_from_hf(hf_folder, groups)  # the other trainer's model
    shape = hybridrl.LlamaShape.from_model(sharded.spec)
    engine = HFEngine(hf_folder)
    stats = reshard_into(engine, sharded.module, layout, shape, rank,
                         "te" if sharded.uses_te else "local")
    out = engine.generate([[1, 5, 9, 2]], hybridrl.SamplingParams(max_new_tokens=5,
                                                                  temperature=0.0))
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    return {"state": state, "out": out, "bytes_received": stats.bytes_received}


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = run(dist.get_rank(), dist.get_world_size(), sys.argv[1])
    print(f"rank {dist.get_rank()}: received {result['bytes_received']} bytes; greedy "
          f"continuation {result['out'].response_ids.tolist()}", file=sys.stdout)
    dist.destroy_process_group()
