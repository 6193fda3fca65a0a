"""SGLang's CUDA-graph memory in ``plan --memory`` (issue 37 item 1): it sits outside the static
pool (weights + KV), so it adds to the engine phases (``engine_start``, ``gen``) without
shrinking the KV pool, and, released with the engine (``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``), it
is absent from every training phase."""

from __future__ import annotations

import dataclasses

from hybridrl.planning.memory import MemoryJob, plan_memory
from hybridrl.reshard.specs import PRESETS

ENGINE_PHASES = ("engine_start", "gen")


def _job(**kw) -> MemoryJob:
    base = dict(world=8, tp=2, pp=1, gen_tp=2, gpu_gb=141.0, mem_fraction_static=0.6,
                max_tokens_per_gpu=8192)
    return MemoryJob(PRESETS["llama-3.1-8b"], **{**base, **kw})


def test_cuda_graphs_count_in_the_engine_phases_only():
    job = _job(cuda_graph_max_bs=256)
    with_graphs, without = plan_memory(job), plan_memory(dataclasses.replace(job,
                                                                             cuda_graph_max_bs=0))
    graphs = 256 * 2 * 1024 * 1024  # SGLang 0.5.21: 2 MB per captured decode batch size
    for phase in with_graphs["phases"]:
        delta = with_graphs["totals"][phase] - without["totals"][phase]
        assert delta == (graphs if phase in ENGINE_PHASES else 0), phase
    assert with_graphs["phases"]["gen"]["cuda_graphs"] == graphs
    # outside the static pool: the KV cache SGLang sizes from mfs x free is the same
    assert with_graphs["gen_kv_pool_bytes"] == without["gen_kv_pool_bytes"]


def test_cuda_graphs_can_overflow_a_tight_gen_phase():
    job = _job(cuda_graph_max_bs=0)
    plain = plan_memory(job)
    room = plain["gpu_bytes"] - plain["totals"]["gen"]
    bs = room // (2 * 1024 * 1024) + 1  # just enough graphs to pass the GPU
    tight = plan_memory(dataclasses.replace(job, cuda_graph_max_bs=int(bs)))
    assert plain["fits"] and not tight["fits"]
    assert tight["largest_phase"] in ENGINE_PHASES
    assert tight["overflow"]["bytes"] == tight["totals"]["gen"] - tight["gpu_bytes"] > 0


def test_builtin_engine_has_no_cuda_graphs():
    rep = plan_memory(_job(engine="builtin", cuda_graph_max_bs=512))
    assert all("cuda_graphs" not in rep["phases"][p] for p in ENGINE_PHASES)
