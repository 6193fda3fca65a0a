"""Split placement: generation on ranks of its own, serving the training ranks over a bridge.

Contract:
- ``link``: the wire both sides share (the split reshard plan, the commands rank 0 sends, the
  hand-off: each gen replica's response lengths to every training rank, then each training
  rank's own rows; every wait bounded by ``rollout.timeout_s``).
- ``remote``: the training ranks' side, ``RemoteRollout`` (the interface the trainer uses of
  ``hybridrl.rollout.worker.RolloutWorker``; up to ``rollout.async_steps`` requests ahead), and
  ``build_rollout_worker`` (colocated worker or remote, from the config).
- ``server``: the generation ranks' loop, ``serve`` (the builtin engine on its gen shard).
- ``engine``: a generation rank's engine on its own device, builtin or one SGLang ``Engine`` per
  replica (``build_split_engine``), its weights received by the split plan over the bridge
  (``SplitEngine.receive_weights``), and the plan with the engine's vocabulary padding
  (``engine_split_plan``).
The groups and the training world come from ``hybridrl.parallel.split``. Imports only downward:
the rollout protocol, worker, builtin and SGLang engines, reshard, parallel.
"""
