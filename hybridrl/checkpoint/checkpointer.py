"""The trainer's checkpoints: sharded parallel save (async on GPU), resume at any layout, rollback.

Contract (``Checkpointer(trainer)``; every method is collective: every rank calls it):
- ``save()`` writes ``global_step_<trainer.step>`` (``hybridrl.checkpoint.folder``: temporary
  folder, fsync, ``COMPLETE``, rename). Every rank writes ONE file, ``rank_<r>.pt``, in
  parallel: its part of each trained model's optimizer (``hybridrl.checkpoint.shards``: fp32 main
  parameters and Adam moments as flat ranges of canonically named parameters, the distributed
  optimizer's 1/dp shard, nothing written twice) and its RNG states (torch, numpy, python, CUDA,
  megatron's RNG tracker). Rank 0 adds ``trainer_state.pt`` (step, KL controller, data
  position, step guard, layout-free optimizer scalars incl. ``lr_scale``; with
  ``rollout.async_steps=k`` the batches in flight, ``hybridrl.trainer.overlap``), ``index.json`` (what
  every file holds, sizes, CRC-32) and ``meta.json`` (run id, layout, each model's HF config,
  tokenizer path). First every rank agrees the state is finite (else ``RuntimeError``, nothing
  written). With ``trainer.async_save`` (``auto``: on when the models are on CUDA) the state is
  copied to host memory, the files are written by a background thread while training goes on,
  and the checkpoint is completed (index, ``COMPLETE``, rename) by ``poll()`` once every rank's
  thread is done (one small all-reduce per step while a save is pending), or by ``wait()``.
  Completed checkpoints beyond ``trainer.max_ckpt_to_keep`` (oldest first) are deleted.
- ``load(path)`` restores a checkpoint written at ANY (tp, pp, dp) and world size: main
  parameters, optimizer state (model weights rebuilt from the main parameters), KL controller,
  data position, step, guard counters, the batch in flight. RNG states are restored per global rank when the layout
  and world are unchanged (bitwise continuation); otherwise each rank keeps its fresh seeding
  (sampling is seeded per step and row, so the numbers do not depend on it) and a notice says
  so. Roles (critic or not) and model shapes must match (``ValueError`` naming them). A
  randomly initialized reference (no ``model.path``) resumed at another tp or pp is not the
  run's (megatron's init depends on them): one notice line says so (``reference_notice``).
- ``start()`` locks the run folder on rank 0 for the process's life
  (``hybridrl.checkpoint.run_lock``: a second run on it is refused naming the holder), prepares
  the run folder and applies ``trainer.resume`` (``hybridrl.checkpoint.run_folder``:
  only the same run id; the layout is not part of it) and returns the folder resumed from (or
  None). Checkpoints live in ``trainer.resolved_checkpoint_dir``. With
  ``resume=auto`` a checkpoint that fails to load (a truncated or corrupt file is named) is
  reported as a warning and the previous complete one is tried (the warnings are printed once
  one has loaded: when none loads, the error is one line naming the first problem). The KL guard's ``checkpoint``
  mode saves ``global_step_0`` when there is nothing to restore yet.
- ``after_step()`` (after ``trainer.step`` was advanced): completes finished async saves, rolls
  back to the latest checkpoint when the step guard asked for it (KL guard ``mode=checkpoint``:
  every trained model's ``lr_scale`` times ``kl_guard.lr_factor``) or saves on the
  ``trainer.save_freq`` cadence and after the last step. ``step_metrics()``, called before it
  (the trainer logs a step before saving it, so no checkpoint ever lacks its metrics line),
  returns ``training/kl_guard_lr`` (the actor's ``lr_scale`` the step trained with) when the KL
  guard runs in checkpoint mode.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.checkpoint import folder as ck
from hybridrl.checkpoint.run_folder import RunDirPlan, apply_run_dir, plan_run_dir, record_run
from hybridrl.checkpoint.run_identity import StartupError
from hybridrl.checkpoint.run_lock import acquire_run_lock
from hybridrl.checkpoint.shards import collect_pieces, load_pieces

FORMAT = 2


def rng_state() -> dict:
    """This process's RNG states (torch, numpy, python, CUDA, megatron's tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    tracker = get_cuda_rng_tracker()
    return {"torch": torch.get_rng_state(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": {k: v.cpu() for k, v in tracker.get_states().items()}}


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = get_cuda_rng_tracker()
    if state["tracker"]:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tracker.set_states({k: v.to(device) if device == "cpu" else v
                            for k, v in state["tracker"].items()})


def reference_notice(meta: dict, layout: dict, random_ref: bool, name: str) -> str | None:
    """The line a resume prints when its randomly initialized reference cannot be the run's:
    megatron's random init depends on tp and pp, so the same seed at another (tp, pp) gives
    another reference (KL target). None when nothing changes."""
    if not random_ref or (meta.get("tp"), meta.get("pp")) == (layout["tp"], layout["pp"]):
        return None
    return (f"hybridrl: notice: the reference model is randomly initialized (no model.path) and "
            f"{name} was written at tp {meta.get('tp')} pp {meta.get('pp')}: at tp "
            f"{layout['tp']} pp {layout['pp']} the same seed gives another reference, so "
            "kl_loss / the KL penalty continue against other weights; resume at the saved tp "
            "and pp, or start from an HF folder (model.path) for a layout-free reference")


class Checkpointer:
    """Save / resume / KL-guard rollback of one ``PPOTrainer`` (see the module docstring)."""

    def __init__(self, trainer):
        self.tr, self.cfg = trainer, trainer.cfg.trainer
        self.root = Path(self.cfg.resolved_checkpoint_dir)
        a = self.cfg.async_save
        self.async_save = (trainer.actor.device.type == "cuda") if a == "auto" else bool(a)
        self.pending = None  # (step, thread, result, entries, trainer_state, meta)
        self.lock = None  # rank 0: the run folder's lock (hybridrl.checkpoint.run_lock)
        self.last_save_s = 0.0  # time the training loop was blocked by the last save

    # ------------------------------------------------------------------ helpers
    def roles(self):
        t = self.tr
        pairs = (("actor", t.actor, t.actor_opt), ("critic", t.critic, t.critic_opt))
        return [(r, m, o) for r, m, o in pairs if m is not None]

    def layout(self) -> dict:
        g = self.tr.groups.train
        return {"world": self.tr.world, "tp": g.tp, "pp": g.pp, "dp": g.dp}

    def _agree(self, value: float, op=dist.ReduceOp.MAX) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.tr.actor.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=op)
        return float(t.item())

    # ------------------------------------------------------------------ save
    def save(self) -> Path:
        self.wait()
        start, tr = time.perf_counter(), self.tr
        tr.memory.enter("all")
        models, entries, extras = {}, {}, {}
        for role, model, opt in self.roles():
            tensors, entries[role], extras[role] = collect_pieces(model, opt)
            models[role] = tensors
        payload = {"format": FORMAT, "rng": rng_state(), "models": models}
        ck.refuse_nonfinite(tr.step, tr.rank, models)
        tmp = ck.begin_folder(self.root, tr.step)
        trainer_state = {"step": tr.step, "guard": tr.guard.state_dict(),
                         "kl_ctrl": tr.kl_ctrl.state_dict(), "loader": tr.loader.state_dict(),
                         "optim_extra": extras}
        overlap = getattr(tr, "overlap", None)  # the batches in flight (rollout.async_steps)
        if overlap is not None and overlap.on:
            trainer_state["overlap"] = overlap.state_dict()
        meta = {"format": FORMAT, "run_id": tr.run_id, "step": tr.step, **self.layout(),
                "roles": {r: m.spec.to_hf_config(m.dtype) for r, m, _ in self.roles()},
                "tokenizer": tr.cfg.model.tokenizer_path or tr.cfg.model.path}
        result = {}
        name = f"rank_{tr.rank:05d}.pt"

        def write():
            try:
                result["info"] = ck.write_file(payload, tmp / name)
            except Exception as err:  # reported by every rank when the save completes
                result["error"] = f"{tmp / name}: {type(err).__name__}: {err}"

        self.pending = (tr.step, None, result, entries, trainer_state, meta)
        if self.async_save:
            thread = threading.Thread(target=write, name="hybridrl-ckpt", daemon=True)
            thread.start()
            self.pending = (tr.step, thread, result, entries, trainer_state, meta)
            self.last_save_s = time.perf_counter() - start
            return ck.step_folder(self.root, tr.step)
        write()
        final = self._complete()
        self.last_save_s = time.perf_counter() - start
        return final

    def poll(self) -> None:
        """Complete a pending async save once every rank's writer is done (no waiting)."""
        if self.pending is not None:
            thread = self.pending[1]
            done = thread is None or not thread.is_alive()
            if self._agree(1.0 if done else 0.0, dist.ReduceOp.MIN):
                self._complete()

    def wait(self) -> None:
        """Complete a pending save, waiting for this rank's writer."""
        if self.pending is not None:
            if self.pending[1] is not None:
                self.pending[1].join()
            self._complete()

    def _complete(self) -> Path:
        step, thread, result, entries, trainer_state, meta = self.pending
        self.pending = None
        if thread is not None:
            thread.join()
        mine = (self.tr.rank, result.get("info"), result.get("error"), entries)
        seen = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(seen, mine)
        else:
            seen = [mine]
        errors = [e for _, _, e, _ in seen if e]
        if errors:
            raise RuntimeError(f"checkpoint global_step_{step} not written: {errors[0]}"
                               + (f" (and {len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
        final = ck.step_folder(self.root, step)
        if self.tr.rank == 0:
            files = {f"rank_{r:05d}.pt": info for r, info, _, _ in seen}
            index = {"files": files, "models": {}}
            for r, _, _, by_role in seen:
                for role, names in by_role.items():
                    for name, entry in names.items():
                        index["models"].setdefault(role, {}).setdefault(name, []).append(
                            {"file": f"rank_{r:05d}.pt", **entry})
            ck.finish_folder(self.root, step, index, meta, trainer_state)
            for old in ck.prune(self.root, self.cfg.max_ckpt_to_keep):
                self.tr.log.line(f"hybridrl: removed {old.name} (trainer.max_ckpt_to_keep="
                                 f"{self.cfg.max_ckpt_to_keep})")
        ck._barrier()
        return final

    # ------------------------------------------------------------------ load
    def _check_meta(self, path: Path, meta: dict) -> None:
        roles = {r: m.spec.to_hf_config(m.dtype) for r, m, _ in self.roles()}
        if set(meta.get("roles", {})) != set(roles):
            raise ValueError(f"checkpoint {str(path)!r} holds models {sorted(meta.get('roles', {}))}"
                             f", this run trains {sorted(roles)} (a critic in one only?)")
        for role, hf in roles.items():
            saved = meta["roles"][role]
            diff = sorted(k for k in set(hf) | set(saved) if k != "torch_dtype"
                          and hf.get(k) != saved.get(k))
            if diff:
                raise ValueError(f"checkpoint {str(path)!r}: the {role} differs in "
                                 + ", ".join(f"{k} (saved {saved.get(k)!r}, now {hf.get(k)!r})"
                                             for k in diff))

    def _load_local(self, path: Path):
        """Every file read and every piece placed on this rank (no communication)."""
        if not (path / ck.COMPLETE).is_file():
            raise ValueError(f"checkpoint {str(path)!r} is not a complete checkpoint "
                             f"(no {ck.COMPLETE} marker)")
        meta, index = ck.read_json(path, ck.META), ck.read_json(path, ck.INDEX)
        if meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint {str(path)!r} has format {meta.get('format')}, this "
                             f"version reads {FORMAT}")
        self._check_meta(path, meta)
        state = ck.read_file(path, ck.TRAINER_STATE, index["files"][ck.TRAINER_STATE])
        opened: dict[str, dict] = {}

        def open_file(name: str) -> dict:
            if name not in opened:
                opened[name] = ck.read_file(path, name, index["files"][name])["models"]
            return opened[name]

        for role, model, opt in self.roles():
            flat = {n: p for n, p in index["models"][role].items()}
            load_pieces(model, opt, flat, lambda f, r=role: open_file(f)[r],
                        state["optim_extra"][role])
        same = {k: meta.get(k) for k in self.layout()} == self.layout()
        mine = f"rank_{self.tr.rank:05d}.pt"
        rng = ck.read_file(path, mine, index["files"][mine])["rng"] if same else None
        return meta, state, rng

    def _first_error(self, mine: str | None) -> str | None:
        """The lowest failing rank's error on every rank (one line shown once, not one per rank)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        return next((e for e in seen if e), None)

    def load(self, path: Path) -> None:
        """Collective: restore ``path`` on every rank (see the module docstring)."""
        tr, error = self.tr, None
        tr.memory.enter("all")
        try:
            meta, state, rng = self._load_local(path)
        except Exception as err:  # missing/corrupt file on this rank
            error = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        if self._agree(0.0 if error is None else 1.0):  # all ranks fail together, none waits
            raise ValueError(self._first_error(error) or f"loading {str(path)!r} failed")
        for _, _, opt in self.roles():
            opt.rebuild_params()
        tr.kl_ctrl.load_state_dict(state["kl_ctrl"])
        tr.loader.load_state_dict(state["loader"])
        tr.step = int(state["step"])
        tr.guard.load_state_dict(state["guard"])
        if getattr(tr, "overlap", None) is not None:  # hybridrl/trainer/overlap.py
            tr.overlap.load_state_dict(state.get("overlap"))
        if rng is not None:
            set_rng_state(rng)
        else:
            tr.log.line(f"hybridrl: {path.name} was written at world {meta['world']} tp "
                        f"{meta['tp']} pp {meta['pp']} dp {meta['dp']}; resharded onto this "
                        "layout (RNG states re-seeded)")
        random_ref = tr.ref is not None and not (tr.cfg.ref.model_path or tr.cfg.model.path)
        notice = reference_notice(meta, self.layout(), random_ref, path.name)
        if notice:
            tr.log.line(notice)

    def start(self) -> Path | None:
        """Apply ``trainer.resume`` (see the module docstring); the folder resumed from."""
        t, tr, plan = self.cfg, self.tr, [None]
        if tr.rank == 0:  # rank 0's view of the folders decides for all (run_dir)
            try:  # held until this process ends: one run per run folder
                self.lock = acquire_run_lock(t.run_dir)
                plan[0] = plan_run_dir(t.run_dir, self.root, t.resume, t.resume_path,
                                       tr.run_id, t.overwrite)
            except (StartupError, OSError) as err:
                plan[0] = RunDirPlan(error=str(err))
            if plan[0].error is None:
                apply_run_dir(t.run_dir, self.root, plan[0], tr.run_id, t.seed,
                              record=plan[0].resume is None)
            older = [str(p) for p in ck.complete_checkpoints(self.root)]
            plan.append(older[older.index(plan[0].resume) + 1:]
                        if t.resume == "auto" and plan[0].resume in older else [])
        else:
            plan.append(None)
        dist.broadcast_object_list(plan, src=0)
        if plan[0].error:
            raise StartupError(plan[0].error)
        if plan[0].notice:
            tr.log.line(f"hybridrl: {plan[0].notice}")
        resumed, failed = None, []
        for i, path in enumerate([plan[0].resume, *plan[1]] if plan[0].resume else []):
            try:
                self.load(Path(path))
                resumed = Path(path)
                break
            except ValueError as err:
                failed.append(str(err))
                if i == len(plan[1]):  # the last one: one line, the first problem in it
                    more = (f" (and the {len(failed) - 1} older complete checkpoints failed "
                            "too)" if len(failed) > 1 else "")
                    raise StartupError(failed[0] + more) from None
        for problem, older in zip(failed, plan[1] or []):  # said once a fallback has loaded:
            tr.log.line(f"hybridrl: warning: {problem}; falling back to {older}")  # else 1 line
        if resumed is not None and tr.rank == 0:  # only now: a failed resume changes nothing
            record_run(t.run_dir, tr.run_id, t.seed)
        k = self.cfg.kl_guard
        if resumed is None and k.mode == "checkpoint" and k.max_kl > 0:
            self.save()  # global_step_0: something to restore before the first save
        return resumed

    # ------------------------------------------------------------------ per step
    def step_metrics(self) -> dict:
        """Metrics of the step just taken, logged BEFORE ``after_step`` saves it: a kill between
        the two leaves a metrics line whose step resume re-runs, never a checkpoint whose
        metrics line is missing. ``training/kl_guard_lr``: the lr multiplier it trained with."""
        t = self.cfg
        if t.kl_guard.mode == "checkpoint" and t.kl_guard.max_kl > 0:
            return {"training/kl_guard_lr": self.tr.actor_opt.lr_scale}
        return {}

    def after_step(self) -> None:
        tr, t = self.tr, self.cfg
        self.poll()
        if tr.guard.restore_checkpoint:
            self.rollback(tr.guard.restore_checkpoint)
        elif t.save_freq > 0 and (tr.step % t.save_freq == 0 or tr.step == tr.total_steps):
            self.save()

    def rollback(self, problem: str) -> None:
        """Restore the latest checkpoint, lr times ``kl_guard.lr_factor`` (KL guard)."""
        tr = self.tr
        self.wait()
        path = ck.latest_checkpoint(self.root)
        if path is None:
            raise RuntimeError(f"{problem}: no checkpoint in {str(self.root)!r} to restore")
        scale = tr.actor_opt.lr_scale * self.cfg.kl_guard.lr_factor
        counters = tr.guard.state_dict()
        self.load(path)
        tr.guard.load_state_dict(counters)
        tr.guard.restore_checkpoint = None
        for _, _, opt in self.roles():
            opt.lr_scale = scale
        tr.log.line(f"{problem}: restored {path.name}, lr x {scale:g} (checkpoint rollback "
                    f"{tr.guard.checkpoint_rollbacks}/{self.cfg.kl_guard.max_rollbacks})")
