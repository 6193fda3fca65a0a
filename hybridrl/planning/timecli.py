"""``hybridrl plan --time`` and ``--search``: the step-time model on the command line.

Contract:
- ``add_time_args(parser)`` adds the flags (the workload: ``--prompts``, ``--n``,
  ``--prompt-len``, ``--response-len``, ``--max-response-len``, ``--algo``, ``--ppo-epochs``,
  ``--mini-batches``, ``--save-freq``; the machine: ``--gpu``; the placement: ``--placement``
  with ``--gen-world``; ``--top`` for the search) to ``hybridrl plan``'s parser, whose layout,
  memory and ``--config`` flags they share.
- ``time_report(args, cache=None)`` -> the prediction of ``timing.predict`` plus ``memory``
  (``plan --memory``'s verdict for the ranks that train; split: its phases that run on the
  training ranks, ``SPLIT_TRAIN_PHASES``, at world - gen_world, and the generation ranks' own:
  weights M/tg and the KV pool of a whole GPU),
  ``layout``, ``workload`` and ``gpu``. The memory plan is ``cli.memory_report`` itself, so
  ``--time`` and ``--memory`` never disagree; ``cache`` (a dict) keeps the reshard plans of
  layouts already seen (the search re-uses them).
- ``search_report(args)``: every layout of ``search.candidates`` that ``plan --memory`` (and
  the split generation side) says fits, the best ``--top`` by ``step_s`` (``search.py``).
- ``time_text`` / ``search_text``: the human forms. Bad input: ValueError, one line.
"""

from __future__ import annotations

import argparse
import copy
import json
import math

from hybridrl.planning.hardware import KINDS, hardware
from hybridrl.planning.timing import PHASE_ORDER, Layout, Workload, predict

GB = 1e9
SPLIT_TRAIN_PHASES = ("train_actor", "train_critic", "forward_only", "snapshot")


def add_time_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("--time / --search: predicted seconds per step")
    t.add_argument("--time", action="store_true", help="predict the seconds of each phase")
    t.add_argument("--search", action="store_true",
                   help="the best layouts for --world GPUs by predicted step time")
    t.add_argument("--calibrate", action="store_true",
                   help="measure this machine for --gpu cpu (seconds; cached per machine)")
    t.add_argument("--gpu", choices=KINDS, default="h100", help="accelerator kind (cpu: "
                   "calibrated on this machine by --calibrate)")
    t.add_argument("--placement", choices=("colocated", "split"), default=None,
                   help="split: the last --gen-world ranks generate one step ahead (default "
                        "colocated; --search: both unless given)")
    t.add_argument("--prompts", type=int, help="prompts per step (default: the config's "
                   "data.train_batch_size, else 512)")
    t.add_argument("--n", type=int, help="samples per prompt (default: rollout.n, else 1)")
    t.add_argument("--prompt-len", type=float, help="mean prompt tokens (default: "
                   "data.max_prompt_length, else 512)")
    t.add_argument("--response-len", type=float, help="mean response tokens (default: half "
                   "of --max-response-len)")
    t.add_argument("--max-response-len", type=int, help="longest response (default: "
                   "rollout.response_length, else 1024)")
    t.add_argument("--algo", choices=("grpo", "gae"), help="grpo: no critic; gae: a critic "
                   "(default: gae when the config trains a critic, else grpo)")
    t.add_argument("--ppo-epochs", type=int, help="passes over each batch (default 1)")
    t.add_argument("--mini-batches", type=int, help="optimizer steps per epoch (default: "
                   "train_batch_size / ppo_mini_batch_size, else 1)")
    t.add_argument("--save-freq", type=int, help="checkpoint every N steps (0: never)")
    t.add_argument("--top", type=int, default=5, help="--search: layouts to print")


def _pick(flag, cfg_value, default):
    return flag if flag is not None else (cfg_value if cfg_value is not None else default)


def _workload(args, cfg) -> Workload:
    d, r = (cfg.data, cfg.rollout) if cfg is not None else (None, None)
    prompts = _pick(args.prompts, d and d.train_batch_size, 512)
    max_resp = _pick(args.max_response_len, r and r.response_length, 1024)
    mini = None
    if cfg is not None:
        mini = max(cfg.data.train_batch_size // max(cfg.actor.ppo_mini_batch_size, 1), 1)
    return Workload(
        prompts=prompts, n=_pick(args.n, r and r.n, 1),
        prompt_len=_pick(args.prompt_len, d and d.max_prompt_length, 512),
        response_len=_pick(args.response_len, None, max_resp / 2), max_response_len=max_resp,
        algo=_pick(args.algo, cfg and ("gae" if cfg.use_critic else "grpo"), "grpo"),
        ppo_epochs=_pick(args.ppo_epochs, cfg and cfg.actor.ppo_epochs, 1),
        mini_batches=_pick(args.mini_batches, mini, 1),
        save_freq=_pick(args.save_freq, cfg and max(cfg.trainer.save_freq, 0), 0))


def _memory_args(args, work: Workload, cfg) -> argparse.Namespace:
    """``plan --memory``'s flags for the ranks that train."""
    m = copy.copy(args)
    m.memory, m.no_critic = True, not work.critic
    if cfg is None:
        m.rollout_seqs = work.seqs
        m.seq_len = int(math.ceil(work.prompt_len)) + work.max_response_len
        if m.seq_len > m.max_tokens_per_gpu:
            raise ValueError(f"a sequence ({m.seq_len} tokens: --prompt-len + "
                             f"--max-response-len) exceeds --max-tokens-per-gpu "
                             f"{m.max_tokens_per_gpu}")
    if args.placement == "split":
        m.world = args.world - args.gen_world
    return m


def _split_gen(lay: Layout, mfs: float, work: Workload, shape, hw) -> dict:
    """The split placement's generation ranks: weights M/tg and a KV pool of a whole GPU."""
    from hybridrl.planning.flops import kv_bytes_per_token
    from hybridrl.planning.memory import DTYPE_BYTES, RESERVE_BYTES

    item = DTYPE_BYTES[lay.dtype]
    weights = shape.num_params() * item / lay.gen_tp
    kv = mfs * (hw.hbm_bytes - RESERVE_BYTES) - weights
    per_seq = kv_bytes_per_token(shape, item) * (work.prompt_len + work.max_response_len) \
        / lay.gen_tp
    replicas = lay.gen_world // lay.gen_tp
    seqs = math.ceil(work.seqs / replicas)
    concurrent = int(min(max(kv // per_seq, 0), seqs))
    return {"engine_weights": weights, "kv_pool_bytes": max(kv, 0), "concurrent": concurrent,
            "fits": concurrent >= 1 and weights + RESERVE_BYTES <= hw.hbm_bytes,
            "headroom_bytes": hw.hbm_bytes - RESERVE_BYTES - weights - max(kv, 0)
            if kv > 0 else hw.hbm_bytes - RESERVE_BYTES - weights}


def _shares_prompts(job: dict, cfg) -> bool:
    """Packed micro-batches compute a shared prompt once (``model.share_prompts``): the local
    spec without recompute (the trainer turns it off on the TE spec and with recompute)."""
    on = cfg is None or (cfg.model.pack_sequences and cfg.model.share_prompts)
    return bool(on and job["spec"] == "local" and job["recompute"] == "none")


def time_report(args: argparse.Namespace, cache: dict | None = None) -> dict:
    """``hybridrl plan --time`` (see the module docstring)."""
    from hybridrl.planning.cli import DTYPE_BYTES, load_shape, memory_report

    cfg = None
    if args.config:
        from hybridrl.config import load_config

        cfg = load_config([args.config])
        p = cfg.parallel
        if p.split and args.placement is None:
            args.placement, args.gen_world = "split", p.gen.world
        if args.world is None and p.dp:
            args.world = p.tp * p.pp * p.dp + (p.gen.world if p.split else 0)
    if args.world is None:
        raise ValueError("--world is required")
    args.placement = args.placement or "colocated"
    calibration = None
    if args.gpu == "cpu":
        from hybridrl.planning.calibrate import load_calibration

        calibration = load_calibration()
    hw = hardware(args.gpu, args.gpu_gb, calibration)
    if args.gpus_per_node:
        import dataclasses

        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    if args.gpu_gb is None:
        args.gpu_gb = hw.hbm_bytes / GB
    if args.placement == "split" and not 0 < (args.gen_world or 0) < args.world:
        raise ValueError(f"--placement split needs --gen-world in 1 .. {args.world - 1}")
    if args.placement == "colocated" and args.gen_world:
        raise ValueError("--gen-world goes with --placement split")
    work = _workload(args, cfg)
    mem = memory_report(_memory_args(args, work, cfg), cache)
    shape = load_shape(args.model)
    j = mem["job"]
    lay = Layout(world=args.world, tp=mem["tp"], pp=mem["pp"], gen_tp=mem["gen_tp"],
                 gen_pp=mem["gen_pp"], placement=args.placement,
                 gen_world=args.gen_world or 0, tokens_per_gpu=j["max_tokens_per_gpu"],
                 critic_tokens_per_gpu=j["critic_tokens_per_gpu"],
                 forward_tokens_per_gpu=j["forward_tokens_per_gpu"],
                 recompute=j["recompute"], sp=j["sequence_parallel"],
                 offload=frozenset(j["offload"]), ref=j["ref"], dtype=j["dtype"],
                 dist_opt=j["dist_opt"], share_prompts=_shares_prompts(j, cfg))
    verdict = {"fits": mem["fits"], "headroom_bytes": mem["headroom_bytes"],
               "largest_phase": mem["largest_phase"]}
    if lay.placement == "split":
        if lay.gen_pp != 1 or lay.gen_world % lay.gen_tp:
            raise ValueError("split placement needs --gen-pp 1 and --gen-world a multiple of "
                             "--gen-tp")
        gen = _split_gen(lay, mem["mem_fraction_static"], work, shape, hw)
        mem = {**mem, "gen_concurrent_seqs": gen["concurrent"]}
        # the split sync: each generation rank receives its engine shard M/tg, each training
        # rank sends R x M / (training ranks) (R replicas; balanced within a few %, counted
        # exactly by plan --gen-world)
        model_bytes = shape.num_params() * DTYPE_BYTES[lay.dtype]
        replicas = lay.gen_world // lay.gen_tp
        busiest = max(model_bytes / lay.gen_tp, replicas * model_bytes / lay.train_world)
        reshard = {"busiest_bytes": busiest}
        train = {k: v for k, v in mem["totals"].items() if k in SPLIT_TRAIN_PHASES}
        largest = max(train, key=train.get)
        room = mem["gpu_bytes"] - train[largest]
        verdict = {"fits": room >= 0 and gen["fits"],
                   "headroom_bytes": min(room, gen["headroom_bytes"]),
                   "largest_phase": largest, "gen_ranks": gen}
    else:
        reshard = mem["reshard_traffic"]
    out = predict(work, lay, hw, shape, mem, reshard)
    verdict["gen_concurrent_seqs"] = mem["gen_concurrent_seqs"]
    return {**out, "memory": verdict, "gpu": hw.name, "model": args.model,
            "layout": {"world": lay.world, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                       "gen_tp": lay.gen_tp, "gen_pp": lay.gen_pp, "placement": lay.placement,
                       "gen_world": lay.gen_world, "tokens_per_gpu": lay.tokens_per_gpu,
                       "recompute": lay.recompute, "sp": lay.sp,
                       "offload": sorted(lay.offload)},
            "workload": {k: getattr(work, k) for k in (
                "prompts", "n", "prompt_len", "response_len", "max_response_len", "algo",
                "ppo_epochs", "mini_batches", "save_freq")}}


def layout_name(lay: dict) -> str:
    knobs = [lay["recompute"] + " recompute"] if lay["recompute"] != "none" else []
    knobs += ["sp"] if lay["sp"] else []
    knobs += ["offload " + ",".join(lay["offload"])] if lay["offload"] else []
    place = (f"split gen {lay['gen_world']}" if lay["placement"] == "split" else "colocated")
    return (f"p{lay['pp']} t{lay['tp']} d{lay['dp']}, tg{lay['gen_tp']}, {place}, "
            f"{lay['tokens_per_gpu'] // 1024}k tok/mb" + (", " + " + ".join(knobs)
                                                          if knobs else ""))


def time_text(rep: dict) -> str:
    w, g = rep["workload"], rep["detail"]["generate"]
    lines = [f"{rep['model']} on {rep['layout']['world']} x {rep['gpu']}: "
             f"{layout_name(rep['layout'])}",
             f"workload: {w['prompts']} prompts x n {w['n']}, prompt {w['prompt_len']:g}, "
             f"response {w['response_len']:g} (max {w['max_response_len']}), {w['algo']}, "
             f"{w['ppo_epochs']} epoch(s) x {w['mini_batches']} mini-batch(es)",
             f"{'phase':<14} {'seconds':>10}"]
    for name in PHASE_ORDER:
        lines.append(f"{name:<14} {rep['phases_s'][name]:>10.3f}")
    lines += [f"{'step':<14} {rep['step_s']:>10.3f}"
              + ("  (split: max(generate, training) + sync)"
                 if rep["layout"]["placement"] == "split" else ""),
              f"generate: prefill {g['prefill_s']:.2f} s, {g['decode_steps']:.0f} decode steps "
              f"of {1e3 * g['decode_step_s']:.2f} ms ({g['decode_bound']}-bound, batch "
              f"{g['batch']} per engine)",
              f"tokens/s/GPU {rep['tokens_per_s_per_gpu']:.1f}, actor-update MFU "
              f"{100 * rep['mfu']:.1f} %, step MFU {100 * rep['mfu_step']:.1f} %"]
    m = rep["memory"]
    lines.append(f"memory (plan --memory): {'fits' if m['fits'] else 'does NOT fit'}, "
                 f"headroom {m['headroom_bytes'] / GB:.1f} GB")
    return "\n".join(lines)


def search_report(args: argparse.Namespace) -> dict:
    from hybridrl.planning.search import search

    return search(args, time_report)


def search_text(rep: dict) -> str:
    lines = [f"{rep['model']} on {rep['world']} x {rep['gpu']}: {rep['evaluated']} layouts "
             f"evaluated, {rep['fit']} fit; best {len(rep['best'])} by predicted step:"]
    short = ("generate", "reshard", "old_log_prob", "reference", "values", "actor_update",
             "critic_update", "offload", "checkpoint")
    lines.append(f"{'#':>2} {'step s':>8} " + " ".join(f"{s[:8]:>8}" for s in short)
                 + f" {'headroom':>9}  layout")
    for i, r in enumerate(rep["best"], 1):
        lines.append(f"{i:>2} {r['step_s']:>8.1f} "
                     + " ".join(f"{r['phases_s'][s]:>8.1f}" for s in short)
                     + f" {r['memory']['headroom_bytes'] / GB:>7.1f}GB  "
                     + layout_name(r["layout"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The ``--time`` / ``--search`` / ``--calibrate`` handler."""
    if args.calibrate:
        from hybridrl.planning.calibrate import calibrate_text, run_calibration

        rep = run_calibration()
        print(json.dumps(rep) if args.json else calibrate_text(rep))
        return 0
    if args.model is None and not args.config:
        raise ValueError("--model is required (or --config naming model.path)")
    if args.model is None:
        from hybridrl.config import load_config
        from hybridrl.planning.cli import model_of_config

        args.model = model_of_config(load_config([args.config]))
    if args.search:
        rep = search_report(args)
        print(json.dumps(rep) if args.json else search_text(rep))
        return 0
    if args.gen_tp is None and not args.config:
        raise ValueError("--gen-tp is required (or --config)")
    rep = time_report(args)
    print(json.dumps(rep) if args.json else time_text(rep))
    return 0
