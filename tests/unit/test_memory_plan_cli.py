"""``hybridrl plan --memory``: the verdicts the docs promise, what each knob changes, bad input.
(The figures themselves are checked against real tensors in tests/distributed/test_memory_plan.py.)"""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.planning.cli import main as plan_main
from hybridrl.planning.memory import MemoryJob, model_state_bytes, plan_memory
from hybridrl.reshard.specs import PRESETS

REPO = Path(__file__).resolve().parents[2]
BIG = ["--model", "llama2-70b", "--world", "256"]


def _json(argv, capsys) -> dict:
    assert plan_main([*argv, "--memory", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_70b_256_gpu_config_fits_on_80_gb(capsys):
    rep = _json([*BIG, "--config", str(REPO / "configs" / "llama70b_256gpu.yaml"),
                 "--gpu-gb", "80"], capsys)
    assert rep["fits"] and rep["tp"] == 8 and rep["pp"] == 4 and rep["dp"] == 8
    assert rep["job"]["recompute"] == "full" and rep["job"]["sequence_parallel"]
    assert rep["totals"][rep["largest_phase"]] <= 80e9
    assert rep["gen_concurrent_seqs"] == rep["gen_seqs_per_replica"]


def test_same_layout_without_the_knobs_does_not_fit(capsys):
    rep = _json([*BIG, "--tp", "8", "--pp", "4", "--gen-tp", "4", "--gpu-gb", "80"], capsys)
    assert not rep["fits"] and rep["overflow"]["phase"] in ("train_actor", "train_critic")
    assert rep["overflow"]["bytes"] == rep["totals"][rep["overflow"]["phase"]] - 80e9
    assert plan_main([*BIG, "--tp", "8", "--pp", "4", "--gen-tp", "4", "--memory"]) == 0
    assert "does NOT fit in 80 GB" in capsys.readouterr().out


def test_each_knob_moves_the_bytes_it_should():
    shape, base = PRESETS["llama2-13b"], dict(world=64, tp=4, pp=1, gen_tp=4)
    plain = plan_memory(MemoryJob(shape, **base))
    sharded = model_state_bytes(MemoryJob(shape, **base), "actor", 0)["optim"]
    unsharded = model_state_bytes(MemoryJob(shape, dist_opt=False, **base), "actor", 0)["optim"]
    assert unsharded == 16 * sharded  # dp = 16
    recompute = plan_memory(MemoryJob(shape, recompute="full", **base))
    act = lambda rep: rep["phases"]["train_actor"]["activations"]  # noqa: E731
    assert act(recompute) < act(plain) / 5
    sp = plan_memory(MemoryJob(shape, recompute="full", sequence_parallel=True, **base))
    assert act(sp) < act(recompute)
    off = plan_memory(MemoryJob(shape, offload=frozenset({"params", "grads", "optim"}), **base))
    gen_parts = off["phases"]["gen"]
    assert not any(k.startswith(("actor/", "critic/", "reference/")) for k in gen_parts)
    assert set(plain["phases"]["gen"]) > set(gen_parts)
    assert off["gen_kv_pool_bytes"] > plain["gen_kv_pool_bytes"]
    grpo = plan_memory(MemoryJob(shape, critic=False, **base))
    assert "train_critic" not in grpo["phases"]


def test_text_report_and_one_line_errors(capsys):
    assert plan_main(["--model", "llama2-7b", "--world", "8", "--tp", "2", "--gen-tp", "2",
                      "--memory", "--recompute", "full", "--sp", "--offload", "params,grads,optim"]) == 0
    out = capsys.readouterr().out
    assert "train_actor" in out and "reshard" in out and "fits in 80 GB" in out
    bad = [(["--tp", "1", "--gen-tp", "1", "--sp"], "--sp needs --tp > 1"),
           (["--tp", "2", "--gen-tp", "2", "--offload", "weights"], "--offload takes parts"),
           (["--tp", "2"], "--gen-tp is required"),
           (["--tp", "2", "--gen-tp", "2", "--seq-len", "99999"], "exceeds --max-tokens")]
    for extra, message in bad:
        assert plan_main(["--model", "llama2-7b", "--world", "8", "--memory", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_docs_table_is_current():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "memory_table.py"), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_builtin_engine_weights_that_are_training_tensors_count_once():
    """The builtin engine reads the rank's own training shards (gen tp | train tp, gen pp 1):
    its gen/reshard weights shrink by exactly the actor's params of the stage; not for SGLang,
    not with offloaded params, not when the shards do not nest; independent count here."""
    from hybridrl.planning.memory import aliased_bytes
    from hybridrl.reshard.specs import build_specs, storage_shape

    shape = PRESETS["llama2-7b"]
    base = dict(world=16, tp=4, pp=2, gen_tp=2, dtype="bf16", gpu_gb=80.0)
    sg = plan_memory(MemoryJob(shape, **base))
    bi = plan_memory(MemoryJob(shape, engine="builtin", **base))
    for stage in (0, 1):  # the rank's stage tensors at train tp 4, counted from the specs
        own = sum(math.prod(storage_shape(s, 4, shape.padded_vocab(4) // 4)) for s in
                  build_specs(shape) if s.on_stage(2, shape.layers, stage)) * 2
        assert aliased_bytes(MemoryJob(shape, engine="builtin", **base), stage) == own
    worst = bi["phases"]["gen"]["stage"]
    assert sg["phases"]["gen"]["engine_weights"] - bi["phases"]["gen"]["engine_weights"] == \
        aliased_bytes(MemoryJob(shape, engine="builtin", **base), worst)
    assert bi["totals"]["gen"] < sg["totals"]["gen"]
    off = MemoryJob(shape, engine="builtin", offload=frozenset({"params"}), **base)
    odd = MemoryJob(shape, engine="builtin", **{**base, "tp": 2, "gen_tp": 4, "pp": 4})
    assert aliased_bytes(off, 0) == 0 and aliased_bytes(odd, 0) == 0
    # another grouping: a rank's training shard need not lie in its gen shard, only the
    # replicated norms of its stage are surely its own (16 layers' two + the final one)
    vanilla = MemoryJob(shape, engine="builtin", gen_grouping="vanilla", **base)
    assert aliased_bytes(vanilla, 1) == (2 * 16 + 1) * shape.hidden * 2
    # tied embeddings at pp > 1: the last stage's output-layer copy is not read (no lm_head)
    tied = dataclasses.replace(shape, tied=True)
    a = aliased_bytes(MemoryJob(tied, engine="builtin", **base), 1)
    b = aliased_bytes(MemoryJob(shape, engine="builtin", **base), 1)
    assert b - a == shape.padded_vocab(4) // 4 * shape.hidden * 2
