"""Checkpoints and the run folder: what is on disk, how it is written, how a run resumes.

Contract:
- ``folder``: one checkpoint folder ``global_step_<N>/`` (atomic write, size and CRC-32 checked
  reads, the newest complete one, pruning) and in-memory state capture for rollbacks.
- ``shards``: the layout-free optimizer state (flat ranges of canonically named parameters) that
  loads into any (tp, pp, dp).
- ``checkpointer``: the trainer's save / resume / rollback (``Checkpointer``), async on GPU.
- ``run_folder``: the run folder ``<output_dir>/<experiment_name>/`` (what an existing one
  means: resume, refuse or move aside; run.json, config.yaml, metrics line bookkeeping).
- ``run_identity``: the run id a checkpoint resumes, ``StartupError``.
- ``export``: ``hybridrl export`` (a checkpoint -> a transformers-loadable HF folder).

Layering: imports models/ (HF conversion, parameter naming), config/ and the floors below; never
the trainer loops (``hybridrl.trainer``) nor the algorithms (``tests/unit/test_layering.py``).
"""
