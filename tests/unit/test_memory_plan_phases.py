"""``hybridrl plan --memory`` models the run (issue 26): the engine start with SGLang's KV rule,
the forward-only and snapshot phases, the config's own world / model / buckets, the pipeline
bubble of the configured mini-batch. Pure: no process group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybridrl.planning.cli import main as plan_main
from hybridrl.planning.memory import (
    GB,
    RESERVE_BYTES,
    MemoryJob,
    bubble_fraction,
    logits_bytes,
    model_state_bytes,
    plan_memory,
)
from hybridrl.reshard.specs import PRESETS

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "llama70b_256gpu.yaml")


def _json(argv, capsys) -> dict:
    assert plan_main([*argv, "--memory", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_256_gpu_config_has_engine_start_and_its_kv_pool_follows_mem_fraction_static(capsys):
    reps = {f: _json(["--config", CONFIG, "--mem-fraction-static", str(f)], capsys)
            for f in (0.5, 0.8)}
    base = _json(["--config", CONFIG], capsys)  # the config's engine_kwargs: 0.5
    assert base["world"] == 256 and base["mem_fraction_static"] == 0.5
    assert base["gen_kv_pool_bytes"] == reps[0.5]["gen_kv_pool_bytes"]
    for f, rep in reps.items():
        assert {"engine_start", "forward_only", "snapshot"} <= set(rep["phases"])
        start = rep["phases"]["engine_start"]
        # everything offloaded: SGLang starts on (GPU - reserve) free bytes
        free = 80 * GB - RESERVE_BYTES
        assert start["kv_pool"] == int(f * free - start["engine_weights"])
        assert not any(k.startswith(("actor/", "critic/", "reference/")) for k in start)
    kv = {f: r["gen_kv_pool_bytes"] for f, r in reps.items()}
    assert abs((kv[0.8] - kv[0.5]) - 0.3 * (80 * GB - RESERVE_BYTES)) < 2
    assert reps[0.5]["job"]["kl_guard"]  # the config keeps a KL guard


def test_config_reads_bucket_mb(capsys, tmp_path):
    text = Path(CONFIG).read_text().replace("bucket_mb: 1024", "bucket_mb: 256")
    small = tmp_path / "small_buckets.yaml"
    small.write_text(text)
    big = _json(["--config", CONFIG], capsys)["phases"]["reshard"]["reshard_transient"]
    little = _json(["--config", str(small)], capsys)["phases"]["reshard"]["reshard_transient"]
    assert little < big / 2


def test_training_state_resident_at_start_shrinks_the_kv_pool():
    shape = PRESETS["llama-3.1-8b"]
    base = dict(world=8, tp=2, pp=1, gen_tp=2, gpu_gb=141.0, mem_fraction_static=0.6)
    kept = plan_memory(MemoryJob(shape, **base))
    away = plan_memory(MemoryJob(shape, offload=frozenset({"params", "grads", "optim"}), **base))
    resident = sum(v for k, v in kept["phases"]["engine_start"].items()
                   if k.startswith(("actor/", "critic/", "reference/")))
    assert resident > 0 and kept["gen_kv_pool_bytes"] > 0
    assert abs(away["gen_kv_pool_bytes"] - kept["gen_kv_pool_bytes"] - 0.6 * resident) < 2
    tiny = plan_memory(MemoryJob(shape, recompute="full", offload=frozenset({"params", "grads",
                                                                            "optim"}),
                                 **{**base, "mem_fraction_static": 0.05}))
    assert not tiny["fits"] and tiny["overflow"]["phase"] == "gen"  # SGLang would refuse


def test_forward_only_and_snapshot_phases():
    shape = PRESETS["llama2-7b"]
    job = MemoryJob(shape, world=16, tp=4, pp=2, gen_tp=2, kl_guard=True,
                    offload=frozenset({"params", "grads", "optim"}),
                    forward_tokens_per_gpu=8192)
    rep = plan_memory(job)
    snap = rep["phases"]["snapshot"]
    st = snap["stage"]
    assert snap["actor/optim"] == model_state_bytes(job, "actor", st)["optim"]
    assert "actor/grads" not in snap and "critic/params" in snap
    fwd = rep["phases"]["forward_only"]
    assert fwd["stage"] == 1 and fwd["activations"] > logits_bytes(job, 8192, forward_only=True)
    assert "snapshot" not in plan_memory(dataclasses.replace(job, kl_guard=False))["phases"]


def test_logits_term_is_the_vocab_parallel_peak():
    job = MemoryJob(PRESETS["llama-3.1-70b"], world=256, tp=8, pp=4, gen_tp=4)
    # 16k tokens x V/t (128256 padded to 129024 at tp 8): 4 fp32 [T, V/t] tensors + the bf16
    # logits = 18 B/element
    assert logits_bytes(job, 16384) == 16384 * 129024 // 8 * 18
    assert 4.6e9 < logits_bytes(job, 16384) < 4.8e9


def test_pipeline_bubble_and_its_warning(capsys):
    assert bubble_fraction(4, 4) == 3 / 7 and bubble_fraction(1, 3) == 0.0
    rep = _json(["--config", CONFIG], capsys)
    # 128 prompts x n 1 / dp 8 = 16 sequences; 16384 // 3072 = 5 per micro-batch -> 4; the
    # critic's 32768 // 3072 = 10 -> 2, raised to pp = 4 (the trainer's floor for token budgets)
    assert rep["job"]["micro_batches"] == 4 and rep["job"]["critic_micro_batches"] == 4
    assert rep["pipeline_bubble"] == {"actor": 3 / 7, "critic": 3 / 7}
    assert plan_main(["--config", CONFIG, "--memory"]) == 0
    out = capsys.readouterr().out
    assert "pipeline bubble (1F1B, one mini-batch): actor 43%, critic 43%" in out
    assert "WARNING: pipeline bubble above 25 %" in out and "engine_start" in out
    # packed (the default): no padding; packs follow the real tokens: at half-length sequences
    # 16 x 1536 / 16384 -> 2 actor packs, 32768 budget -> 1 critic pack: both raised to pp = 4
    # (bubble 3/7; without the floor 3/5 and 3/4)
    assert ("padding: none (model.pack_sequences: packs of whole sequences, budgets count real "
            "tokens; sequence-parallel tail pad < 8 tokens per pack); at a mean length half the "
            "maximum a mini-batch makes actor 4 packs per pipeline (bubble 43%), critic 4 packs "
            "per pipeline (bubble 43%)") in out
    assert rep["padding"].startswith("padding: none")


def test_trainer_start_up_lines_share_the_plan_s_bubble():
    """What PPOTrainer prints at start-up (hybridrl.planning.report.pipeline_lines)."""
    from hybridrl.config import load_config
    from hybridrl.planning.report import pipeline_lines

    cfg = load_config([CONFIG])
    lines = pipeline_lines(cfg, 8)
    assert lines[0] == ("micro-batches per pipeline per mini-batch (full-length sequences): "
                        "actor 4, critic 4 (pp 4)")
    assert lines[1] == "pipeline bubble (1F1B, one mini-batch): actor 43%, critic 43%"
    assert lines[2].startswith("WARNING: pipeline bubble above 25 %: actor 43% idle")
    assert lines[3].startswith("padding: none")
    padded = load_config([CONFIG], ["model.pack_sequences=false", "parallel.pp=1",
                                    "parallel.dp=32"])
    lines = pipeline_lines(padded, 32)
    assert not any(x.startswith("WARNING") for x in lines)  # pp 1: no bubble
    assert lines[-1].startswith("padding: model.pack_sequences=false")


def test_reshard_traffic_splits_the_received_bytes_by_node(capsys):
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.planning.traffic import reshard_traffic
    from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, gen_placement, train_placement
    from hybridrl.reshard.specs import build_specs
    from hybridrl.reshard.summary import summarize

    shape = PRESETS["llama-3.1-70b"]
    layout = TrainLayout(world=256, tp=8, pp=4)
    train, specs = train_placement(layout, shape), build_specs(shape)
    gen = gen_placement(layout, shape, 4, 1, "hybridflow", vocab_pad=ENGINE_VOCAB_PAD)
    got = reshard_traffic(train, gen, specs, "zero_redundancy", 2, 8)
    recv = summarize(train, gen, specs, "zero_redundancy", 2).recv
    assert got["inter_node_bytes"] + got["worst_rank_intra_bytes"] == recv[got["worst_rank"]]
    # a micro-DP group: 2 TP neighbours on each of 4 nodes -> 6 of the 7 peers are remote
    assert abs(got["inter_node_bytes"] / recv[got["worst_rank"]] - 6 / 7) < 0.02
    one_node = reshard_traffic(train, gen, specs, "zero_redundancy", 2, 256)
    assert one_node["inter_node_bytes"] == 0
    rep = _json(["--config", CONFIG], capsys)["reshard_traffic"]
    assert rep["strategy"] == "zero_redundancy"
    assert rep["inter_node_bytes"] == got["inter_node_bytes"]


def test_the_critic_has_no_vocabulary_logits():
    from hybridrl.planning.memory import activation_bytes

    job = MemoryJob(PRESETS["llama-3.1-70b"], world=256, tp=8, pp=4, gen_tp=4)
    last, logits = job.pp - 1, logits_bytes(job, job.max_tokens_per_gpu)
    assert activation_bytes(job, last) - activation_bytes(job, last, role="critic") == logits
    assert activation_bytes(job, 0) == activation_bytes(job, 0, role="critic")
