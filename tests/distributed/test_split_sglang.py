"""Split placement with SGLang (issue 39 items 1-2), on CPU gloo ranks against SGLang's real
scheduler-side weight updater: tests/distributed/test_split_sglang_cases.py runs every case in
one torchrun launch of 4 ranks (2 training ranks at tp 2, 2 generation ranks as one replica of
gen tp 2, or two of gen tp 1) and this file checks what each rank saw:
- the split plan's shards arrive bit-identically: every parameter of SGLang's own model (Llama,
  Qwen2 with q/k/v biases) equals, bitwise, the same model after its ``load_weights`` on the HF
  tensors, after two syncs through ``build_split_engine(...).receive_weights``;
- each generation rank receives exactly its engine shard once per sync (its parameters' bytes
  less the vocabulary padding rows nobody holds), and the training ranks send
  nothing twice and about evenly (train dp 1: a sharded row has one holder; the balance over
  dp replicas is checked by tests/unit/test_split_config.py on the plan);
- SGLang's own ``update_weights_from_distributed`` receive side gives every TP rank the whole
  tensor from one sender (why the split sync pushes per-rank shards instead);
- the replica's engine starts with tp_size = gen tp and base_gpu_id = its first rank's local GPU;
  the updater sees a weight-update session of direct-format tensor updates.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridrl.testing.dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = (("llama", 2), ("qwen2", 1), ("llama_tied", 2))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("sglang", reason="SGLang is not installed (make test installs it)")
    out = tmp_path_factory.mktemp("split_sglang")
    env = dict(os.environ, HYBRIDRL_TEST_PORT_BASE=str(20000 + free_port() % 20000),
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "-m", "tests.distributed.test_split_sglang_cases", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.parametrize("case", CASES)
def test_split_plan_shards_arrive_bit_identically_in_sglang(ranks, case):
    gen = [res[case] for res in ranks if res[case]["is_gen"]]
    assert len(gen) == 2
    for res in gen:
        assert res["differ"] == [], res["differ"]
        assert res["names"]  # the model has parameters, all compared
        handled = res["handled"]
        assert "BeginWeightUpdateReqInput" in handled and "EndWeightUpdateReqInput" in handled
        assert handled.count("UpdateWeightsFromTensorReqInput") >= 2  # bucket by bucket


@pytest.mark.parametrize("case", CASES)
def test_each_gen_rank_receives_its_shard_once_each_holder_sends_once(ranks, case):
    gen = [res[case] for res in ranks if res[case]["is_gen"]]
    train = [res[case] for res in ranks if not res[case]["is_gen"]]
    for res in gen:
        for received, sent, _ in res["syncs"]:  # both syncs
            assert received == res["shard_bytes"] - res["vocab_pad_bytes"]
            assert sent == 0
    for sync in range(2):
        sent = [res["syncs"][sync][1] for res in train]
        assert sum(sent) == sum(res["syncs"][sync][0] for res in gen)  # nothing twice
        # train dp 1: a sharded row has one holder, only replicated tensors can be balanced
        # (the tied vocabulary, 515 rows over training chunks of 384, makes rank 0 send more)
        assert max(sent) / (sum(sent) / len(sent)) < 1.2
        assert all(res["syncs"][sync][0] == 0 for res in train)


def test_sglangs_distributed_update_path_cannot_take_a_shard(ranks):
    """Why the split sync does not use SGLang's ``update_weights_from_distributed``
    (docs/scaling.md 5b): with the pinned release's own runner-side code, an engine's TP ranks
    join a custom group at rank_offset + tp rank and each receives the whole tensor broadcast
    from the group's rank 0 (one sender, the same tensor for every TP rank: no per-rank shard).
    A release that changes this fails here, and the split sync may then use that path."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    for r in (1, 2):  # the engine's TP ranks 0 and 1
        probe = ranks[r]["distributed_path"]
        assert probe["init"][0], probe["init"]
        ((name, tensor),) = probe["received"]
        assert name == "w" and torch.equal(tensor, full)


@pytest.mark.parametrize("case", CASES)
def test_one_engine_per_replica_on_its_first_ranks_gpu(ranks, case):
    _, gen_tp = case
    for r, res in enumerate(ranks):
        res = res[case]
        if not res["is_gen"]:
            continue
        if res["members"][0] == r:
            # torchrun's LOCAL_RANK of the replica's first rank (one node here: its rank)
            assert (res["tp_size"], res["base_gpu"]) == (gen_tp, r)
        else:
            assert res["base_gpu"] is None  # only the replica's first rank starts an engine
        assert len(res["members"]) == gen_tp


def test_builtin_split_engine_on_gloo():
    """The builtin engine of ``build_split_engine`` on 4 gloo ranks (2 training at tp 2, one
    replica of gen tp 2): the GPU test's function (tests/gpu/test_split_gpu.py) on CPU."""
    from hybridrl.testing.dist import run_on_ranks
    from tests.gpu.test_split_gpu import split_builtin_rank

    res = run_on_ranks(split_builtin_rank, 4, 2, 2, timeout=300)
    assert all(r["handoff_apart"] for r in res)
    for r in (2, 3):
        assert res[r]["backend"] == "gloo" and res[r]["engine_devices"] == ["cpu"]
        assert res[r]["bad"] == [], res[r]["bad"]
        assert res[r]["received"] == [res[r]["shard_bytes"]] * 2


def group_timeouts(rank: int, world: int) -> dict:
    """Each split group's timeout on this rank (seconds), gen_timeout_s 90, timeout_s 30."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.split import build_split_groups

    split = build_split_groups(TrainLayout(2, tp=2), 2, 2, timeout_s=30, gen_timeout_s=90)

    def seconds(group):
        if group is None:
            return None
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    out = {name: seconds(getattr(split, name)) for name in
           ("bridge", "handoff", "command", "gen_tp", "gen_tp_gloo", "gen_gloo", "train_world")}
    if split.groups is not None:  # megatron's gloo twins: on gloo the DP groups themselves
        g = split.groups
        out["twins"] = [g.gloo_dp is g.dp, g.gloo_dp_cp is g.dp_cp, g.gloo_expt_dp is g.expt_dp]
    return out


def test_generation_side_groups_wait_for_generation():
    """An SGLang replica's other ranks wait on its gloo twin while its first rank generates:
    those groups take ``gen_timeout_s`` (rollout.timeout_s), the others the collective one.
    The training ranks' megatron gloo twins (dp, dp_cp, expt_dp) are set as build_groups sets
    them."""
    from hybridrl.testing.dist import run_on_ranks

    res = run_on_ranks(group_timeouts, 4, timeout=120)
    for r in (0, 1):
        assert res[r]["bridge"] == res[r]["train_world"] == 30
        # the hand-off's waits carry their own bound (rollout.timeout_s): its group's timeout,
        # NCCL's watchdog, is the command group's day (a long generation is not cut short)
        assert res[r]["handoff"] == 86400
        assert res[r]["gen_gloo"] is None and res[r]["gen_tp_gloo"] is None
        assert res[r]["twins"] == [True, True, True]
    for r in (2, 3):
        assert res[r]["gen_tp_gloo"] == res[r]["gen_gloo"] == 90
        assert res[r]["gen_tp"] == res[r]["bridge"] == 30 and res[r]["command"] == 86400
