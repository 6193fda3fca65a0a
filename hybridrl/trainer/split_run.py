"""Running a PPO job with ``parallel.placement=split``: training ranks train, generation ranks serve.

Contract: ``fit_split(cfg, train, timeout_s, phases=None, print_fn=print, on_trainer=None,
on_started=None)`` (every rank of the
default group, ``train.world + parallel.gen.world`` of them, same arguments) builds the split
groups (``hybridrl.parallel.split.build_split_groups``: every group made once, on every rank, in
one order). A generation rank runs ``hybridrl.rollout.split.server.serve`` until the trainer stops
it and returns the number of batches it generated (training and validation). A training rank builds the ``PPOTrainer`` with the ``RemoteRollout`` and
fits inside ``training_world`` (the default group = the training ranks, so the trainer's own
collectives never meet the generation loop), then stops the generation loop; returns the
per-step metrics. The default group is the whole world again when it returns (the entrypoint's
last barrier spans every rank). ``on_started()`` is called once this rank's side is built (a
training rank's trainer, a generation rank's engine), so a failure before it is a start-up
failure (the entrypoint's status 2 for bad input, as colocated), one after it a training one.
"""

from __future__ import annotations


def fit_split(cfg, train, timeout_s: float, phases=None, print_fn=print, on_trainer=None,
              on_started=None):
    """Train (training ranks) or serve (generation ranks); see the module docstring.
    ``on_trainer(trainer)``: called on a training rank once the trainer is built (tests)."""
    from hybridrl.parallel.split import build_split_groups, training_world
    from hybridrl.rollout.split.server import serve

    split = build_split_groups(train, cfg.parallel.gen.world, cfg.parallel.gen.tp, timeout_s,
                               gen_timeout_s=cfg.rollout.timeout_s)
    if split.is_gen:
        return serve(cfg, split, phases, on_started=on_started)
    from hybridrl.trainer.ppo import PPOTrainer

    with training_world(split):
        trainer = PPOTrainer(cfg, split.groups, print_fn=print_fn, split=split)
        trainer.phases = phases
        if on_started is not None:
            on_started()
        history = trainer.fit()
        trainer.worker.close()
        if on_trainer is not None:
            on_trainer(trainer)
    return history
