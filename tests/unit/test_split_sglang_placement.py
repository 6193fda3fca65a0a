"""Split placement on CUDA and with SGLang (issue 39 item 1), no process group: the config
accepts them (and refuses SGLang without CUDA in one line), the groups' backends on NCCL, every
generation replica inside one node, the engine split plan's vocabulary padding."""

from __future__ import annotations

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.parallel.layout import TrainLayout
from hybridrl.parallel.split import replica_node_problem, split_backends
from hybridrl.reshard.specs import LlamaShape
from hybridrl.rollout.sglang.layout import engine_param_shapes
from hybridrl.rollout.split.engine import engine_split_plan, split_vocab_pad

SPLIT = ["parallel.placement=split", "parallel.gen.world=1"]


@pytest.mark.parametrize("extra", [["trainer.device=cuda"],
                                   ["trainer.device=cuda", "rollout.engine=sglang"]])
def test_split_with_cuda_or_sglang_is_accepted(extra):
    cfg = load_config([], [*SPLIT, *extra])
    assert cfg.parallel.split and cfg.trainer.device == "cuda"


def test_split_sglang_without_cuda_is_one_line():
    with pytest.raises(ValueError) as err:
        load_config([], [*SPLIT, "rollout.engine=sglang", "trainer.device=cpu"])
    line = str(err.value)
    assert "needs trainer.device=cuda" in line and "\n" not in line.strip()


def test_nccl_split_groups_keep_objects_on_gloo():
    kinds = split_backends("nccl")
    assert kinds["bridge"] == kinds["handoff"] == kinds["gen_tp"] == kinds["train"] == "nccl"
    assert kinds["command"] == kinds["gloo_twins"] == kinds["gen_gloo"] == "gloo"
    assert set(split_backends("gloo").values()) == {"gloo"}
    with pytest.raises(ValueError, match="gloo .CPU. or nccl .CUDA."):
        split_backends("mpi")


@pytest.mark.parametrize("train, gen, tp, node, problem", [
    (8, 8, 8, 8, None),  # generation ranks are a whole node
    (6, 2, 2, 8, None),  # the last two GPUs of the first node
    (4, 12, 4, 8, None),  # replicas 4..7, 8..11, 12..15
    (7, 2, 2, 8, "ranks 7..8 spans two nodes of 8"),
    (6, 4, 4, 8, "ranks 6..9 spans two nodes of 8"),
    (8, 16, 16, 8, "parallel.gen.tp=16 is more than the 8 GPUs of a node"),
    (7, 2, 2, None, None),  # one node (no LOCAL_WORLD_SIZE): nothing to check
])
def test_every_generation_replica_sits_in_one_node(train, gen, tp, node, problem):
    got = replica_node_problem(train, gen, tp, node)
    if problem is None:
        assert got is None
    else:
        assert problem in got and "\n" not in got


def test_sglang_split_plan_pads_the_vocabulary_as_sglang():
    # 515 rows: training at tp 2 pads to 768 (128 x tp), SGLang to 576 (64)
    shape = LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=8, layers=2, vocab=515,
                       tied=True)
    train = TrainLayout(2, tp=2)
    assert split_vocab_pad("builtin") is None
    sglang = engine_split_plan("sglang", train, shape, 2, 2, 1, torch.float32, False)
    builtin = engine_split_plan("builtin", train, shape, 2, 2, 1, torch.float32, False)
    rows = engine_param_shapes(shape, 2)["model.embed_tokens.weight"][0]
    assert sglang.gen.vocab_chunk == rows == 288
    assert builtin.gen.vocab_chunk == 384
    with pytest.raises(ValueError, match="rollout.engine must be one of"):
        split_vocab_pad("vllm")
