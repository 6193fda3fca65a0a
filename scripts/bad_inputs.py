"""Bad-input sweep: every input a user can get wrong must end in ONE clean line, not a traceback.

Contract:
- ``CASES`` is a catalogue of bad inputs (config values, unknown or misspelled keys, verl keys
  hybridrl does not support, missing or corrupt files: YAML, parquet, config.json, safetensors,
  tokenizer, reward files, run folders, checkpoints), each run for real through the launcher
  (``python -m hybridrl.launch --standalone --nproc-per-node N --config configs/demo_cpu.yaml``)
  on CPU gloo ranks with a one-step budget.
- A case is clean when the launcher exits with a status the case allows (2 = bad input, 1 = a
  failure after start, 0 for inputs that must simply run: a reward function that forks or
  changes the working directory), stderr holds exactly the case's number of ``hybridrl...:
  error`` lines (one; none for those that run), its extra check holds, and no ``Traceback``
  or ``Fatal Python error`` (a crash dump). ``sweep(names, ranks)`` runs cases and returns one result dict per case;
  ``main`` prints a table (case, status, clean, the line) and ``N of M clean``; exit 1 if any
  case is not clean.
- Files the cases need are written under a fresh temporary folder (``make_files``); nothing is
  read from the network.
Usage: ``.venv/bin/python scripts/bad_inputs.py [--ranks 1] [--only NAME ...] [--list]``
(about 8 s a case at 1 rank on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ERROR_LINE = re.compile(r"^hybridrl[\w.]*: error")
BAD, FAILED = (2,), (1,)

REWARDS = '''
import os
def raises(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise KeyError("no_such_key")
def wrong_type(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return "high"
def too_few_args(data_source):
    return 0.0
def segfault(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    import ctypes
    ctypes.string_at(0)
def forks(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    os.fork()
    return 0.0
def chdir(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "elsewhere"))
    return 0.0
'''


def make_files(root: Path) -> dict[str, str]:
    """The files the cases read (bad ones and the good ones they are made from)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from hybridrl.models.hf_files import expected_hf_shapes
    from hybridrl.models.spec import LlamaSpec

    f: dict[str, str] = {"root": str(root)}
    (root / "rewards.py").write_text(REWARDS)
    (root / "elsewhere").mkdir()
    (root / "syntax.py").write_text("def fn(a, b, c, d=None):\n    return 1 +\n")
    (root / "imports.py").write_text("import no_such_module_here\ndef fn(*a, **k):\n    return 0\n")
    f["rewards"], f["syntax"], f["imports"] = (str(root / n) for n in
                                               ("rewards.py", "syntax.py", "imports.py"))
    (root / "bad.yaml").write_text("actor:\n  lr: [1, 2\n")
    (root / "dup.yaml").write_text("actor:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    f["bad_yaml"], f["dup_yaml"], f["list_yaml"] = (str(root / n) for n in
                                                    ("bad.yaml", "dup.yaml", "list.yaml"))
    rows = {"data_source": ["arith"] * 8, "prompt": [[{"role": "user", "content": "1+2="}]] * 8,
            "reward_model": [{"ground_truth": "3", "style": "rule"}] * 8}
    pq.write_table(pa.table(rows), root / "good.parquet")
    pq.write_table(pa.table({"data_source": ["x"] * 8}), root / "noprompt.parquet")
    raw = bytearray((root / "good.parquet").read_bytes())
    for k in range(len(raw) // 3, len(raw) - 12):
        raw[k] ^= 0xFF
    (root / "flipped.parquet").write_bytes(bytes(raw))
    (root / "text.parquet").write_text("not a parquet file\n")
    for n in ("good", "noprompt", "flipped", "text"):
        f[f"{n}_parquet"] = str(root / f"{n}.parquet")
    spec = LlamaSpec(hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=64, vocab_size=100)

    def hf(name, config=None, shapes=None, tokenizer="{}", cut=0):
        folder = root / name
        folder.mkdir()
        text = config if isinstance(config, str) else json.dumps({**spec.to_hf_config(),
                                                                  **(config or {})})
        (folder / "config.json").write_text(text)
        sh = {**expected_hf_shapes(spec), **(shapes or {})}
        save_file({k: torch.zeros(v) for k, v in sh.items()}, str(folder / "model.safetensors"))
        if cut:
            path = folder / "model.safetensors"
            path.write_bytes(path.read_bytes()[:-cut])
        (folder / "tokenizer.json").write_text(tokenizer)
        f[name] = str(folder)

    hf("hf_bigger", shapes={"model.embed_tokens.weight": (150, 32)})
    hf("hf_wrong", shapes={"model.layers.0.mlp.up_proj.weight": (64, 40)})
    hf("hf_truncated", cut=100)
    hf("hf_moe", config={"num_experts": 8, "architectures": ["MixtralForCausalLM"],
                         "model_type": "mixtral"})
    hf("hf_sliding", config={"use_sliding_window": True, "sliding_window": 64})
    hf("hf_rope", config={"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    hf("hf_garbage_config", config="{not json")
    hf("hf_garbage_tok", tokenizer="{garbage")
    hf("hf_missing_tensor", shapes={})
    Path(f["hf_missing_tensor"], "model.safetensors").unlink()
    (root / "empty_dir").mkdir()
    f["empty_dir"] = str(root / "empty_dir")
    return f


def _c(name, overrides, status=BAD, config=None, ranks=None, lines=1, torchrun=None,
       check=None):
    """A case: ``lines`` error lines expected (0 for an input that must run through cleanly);
    ``torchrun``: launcher options instead of ``--standalone --nproc-per-node N`` (``{port}``:
    a port this sweep holds busy); ``check(root)``: another condition, a problem line or None."""
    return {"name": name, "overrides": overrides, "status": status, "config": config,
            "ranks": ranks, "lines": lines, "torchrun": torchrun, "check": check}


def _not_split(root: str) -> str | None:
    """The run folder of a relative output_dir stays where the run started."""
    if Path(root, "elsewhere", "relruns").exists():
        return "the run folder was split: files went under elsewhere/relruns"
    if not list(Path(root, "relruns").glob("*/metrics.jsonl")):
        return "relruns/<experiment>/metrics.jsonl is missing"
    return None


def cases(f: dict[str, str]) -> list[dict]:
    rw, pq = f["rewards"], f["good_parquet"]
    data = [f"data.train_files=[{pq}]", f"data.val_files=[{pq}]"]
    return [
        # ---- config values and keys
        _c("lr_negative", ["actor.lr=-1"]),
        _c("lr_text", ["actor.lr=abc"]),
        _c("batch_zero", ["data.train_batch_size=0"]),
        _c("n_zero", ["rollout.n=0"]),
        _c("temperature_negative", ["rollout.temperature=-1"]),
        _c("top_p_above_1", ["rollout.top_p=2"]),
        _c("response_length_zero", ["rollout.response_length=0"]),
        _c("mini_batch_above_batch", ["actor.ppo_mini_batch_size=100"]),
        _c("mini_batch_not_dividing", ["actor.ppo_mini_batch_size=5"]),
        _c("micro_batch_zero", ["actor.ppo_micro_batch_size_per_gpu=0"]),
        _c("total_steps_negative", ["trainer.total_steps=-1"]),
        _c("epochs_zero", ["actor.ppo_epochs=0"]),
        _c("clip_negative", ["actor.clip_ratio=-0.2"]),
        _c("unknown_key", ["actor.lrr=1e-3"]),
        _c("unknown_section", ["foo.bar=1"]),
        _c("no_equals", ["actor.lr"]),
        _c("adv_estimator", ["algorithm.adv_estimator=nope"]),
        _c("policy_loss", ["actor.policy_loss=nope"]),
        _c("kl_loss_type", ["actor.kl_loss_type=nope"]),
        _c("kl_ctrl_type", ["algorithm.kl_ctrl.type=nope"]),
        _c("loss_agg_mode", ["actor.loss_agg_mode=nope"]),
        _c("dtype", ["model.dtype=fp8"]),
        _c("engine_name", ["rollout.engine=nope"]),
        _c("engine_sglang_no_cuda", ["rollout.engine=sglang"]),
        _c("tp_not_dividing", ["parallel.tp=3"], ranks=2),
        _c("pp_above_layers", ["parallel.pp=2", "model.num_layers=1"], ranks=2),
        _c("gen_tp_not_dividing", ["parallel.gen.tp=3"], ranks=2),
        _c("heads_not_dividing_tp", ["parallel.tp=2", "model.num_attention_heads=3"], ranks=2),
        _c("vocab_below_tokenizer", ["model.vocab_size=50"]),
        _c("resume_mode", ["trainer.resume=maybe"]),
        _c("resume_path_missing", ["trainer.resume=path"]),
        _c("resume_path_nonexistent", ["trainer.resume=path",
                                       "trainer.resume_path=/nonexistent/global_step_1"]),
        _c("reward_timeout_negative", ["reward.timeout_s=-1"]),
        _c("collective_timeout_zero", ["trainer.collective_timeout_s=0"]),
        _c("nonfinite_mode", ["trainer.nonfinite=nope"]),
        _c("kl_guard_mode", ["trainer.kl_guard.mode=nope"]),
        _c("max_prompt_tiny", ["data.max_prompt_length=1"]),
        _c("truncation_mode", ["data.truncation=nope"]),
        _c("synthetic_task", ["data.synthetic.task=nope"]),
        # ---- verl command-line keys
        _c("verl_lora", ["actor_rollout_ref.model.lora_rank=8"]),
        _c("verl_unknown", ["actor_rollout_ref.actor.no_such_knob=1"]),
        _c("verl_vllm", ["actor_rollout_ref.rollout.name=vllm"]),
        # ---- config files
        _c("config_missing", [], config="/nonexistent/config.yaml"),
        _c("config_bad_yaml", [], config=f["bad_yaml"]),
        _c("config_duplicate_key", [], config=f["dup_yaml"]),
        _c("config_is_a_list", [], config=f["list_yaml"]),
        # ---- data files
        _c("train_file_missing", ["data.train_files=[/nonexistent/train.parquet]"]),
        _c("train_file_text", [f"data.train_files=[{f['text_parquet']}]",
                               f"data.val_files=[{pq}]"]),
        _c("train_file_flipped", [f"data.train_files=[{f['flipped_parquet']}]",
                                  f"data.val_files=[{pq}]"]),
        _c("train_file_no_prompt", [f"data.train_files=[{f['noprompt_parquet']}]",
                                    f"data.val_files=[{pq}]"]),
        _c("prompt_key", [*data, "data.prompt_key=question"]),
        _c("batch_above_dataset", [*data, "data.train_batch_size=64"]),
        # ---- model folders
        _c("model_path_missing", ["model.path=/nonexistent/model"]),
        _c("model_path_empty", [f"model.path={f['empty_dir']}"]),
        _c("model_tensor_bigger", [f"model.path={f['hf_bigger']}", "model.tokenizer_path=char"]),
        _c("model_tensor_wrong", [f"model.path={f['hf_wrong']}", "model.tokenizer_path=char"]),
        _c("model_truncated", [f"model.path={f['hf_truncated']}", "model.tokenizer_path=char"]),
        _c("model_no_weights", [f"model.path={f['hf_missing_tensor']}",
                                "model.tokenizer_path=char"]),
        _c("model_moe", [f"model.path={f['hf_moe']}", "model.tokenizer_path=char"]),
        _c("model_sliding_window", [f"model.path={f['hf_sliding']}", "model.tokenizer_path=char"]),
        _c("model_rope_type", [f"model.path={f['hf_rope']}", "model.tokenizer_path=char"]),
        _c("model_config_garbage", [f"model.path={f['hf_garbage_config']}",
                                    "model.tokenizer_path=char"]),
        _c("tokenizer_garbage", [f"model.path={f['hf_garbage_tok']}"]),
        _c("tokenizer_path_missing", ["model.tokenizer_path=/nonexistent/tok"]),
        _c("ref_path_missing", ["ref.model_path=/nonexistent/ref"]),
        _c("critic_path_missing", ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=6",
                                   "critic.model_path=/nonexistent/critic"]),
        _c("reward_model_missing", ["reward.reward_fn=", "reward.reward_model_path=/nonexistent/rm"]),
        _c("override_bad_value", ["actor.lr=[1,"]),
        _c("verl_name_in_our_section", ["actor.clip_ratio=0.2"]),
        # ---- reward functions
        _c("reward_file_missing", ["reward.reward_fn=/nonexistent/r.py:fn"]),
        _c("reward_module_missing", ["reward.reward_fn=no_such_module:fn"]),
        _c("reward_fn_missing", [f"reward.reward_fn={rw}:no_such_fn"]),
        _c("reward_no_colon", [f"reward.reward_fn={rw}"]),
        _c("reward_syntax_error", [f"reward.reward_fn={f['syntax']}:fn"]),
        _c("reward_import_error", [f"reward.reward_fn={f['imports']}:fn"]),
        _c("reward_raises", [f"reward.reward_fn={rw}:raises"], status=FAILED),
        _c("reward_wrong_type", [f"reward.reward_fn={rw}:wrong_type"], status=(1, 2)),
        _c("reward_wrong_signature", [f"reward.reward_fn={rw}:too_few_args"], status=(1, 2)),
        _c("reward_segfault", [f"reward.reward_fn={rw}:segfault"], status=FAILED),
        _c("reward_forks", [f"reward.reward_fn={rw}:forks", "trainer.total_steps=2"], status=(0,),
           lines=0),
        _c("reward_chdir_relative_output", [f"reward.reward_fn={rw}:chdir",
                                            "trainer.output_dir=relruns"], status=(0,), lines=0,
           check=_not_split),
        # ---- issue 43: numbers out of range, the launcher's port
        _c("lr_inf", ["actor.lr=inf"]),
        _c("seed_beyond_int64", ["trainer.seed=18446744073709551616"]),
        _c("data_seed_beyond_int64", ["data.seed=-18446744073709551616"]),
        _c("reward_timeout_nan", ["reward.timeout_s=nan"]),
        _c("master_port_in_use", [], torchrun=["--nproc-per-node", "1", "--master-addr",
                                               "127.0.0.1", "--master-port", "{port}"]),
        # ---- run folders
        _c("output_dir_unwritable", ["trainer.output_dir=/proc/hybridrl_runs"]),
        _c("output_dir_is_a_file", [f"trainer.output_dir={rw}"]),
        _c("experiment_name_path", ["trainer.experiment_name=a/b"]),
    ]


def run_case(case: dict, files: dict, ranks: int, timeout: float = 300) -> dict:
    run_dir = [f"trainer.output_dir={Path(files['root'], 'runs')}",
               f"trainer.experiment_name={case['name']}"]
    own = any(o.startswith("trainer.output_dir=") for o in case["overrides"])
    busy = socket.socket()  # held for the run: the port a {port} case is refused
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    torchrun = [a.replace("{port}", str(busy.getsockname()[1])) for a in case["torchrun"]] \
        if case["torchrun"] else ["--standalone", "--nproc-per-node", str(case["ranks"] or ranks)]
    cmd = [sys.executable, "-m", "hybridrl.launch", *torchrun, "--config",
           case["config"] or str(REPO / "configs" / "demo_cpu.yaml"),
           *([] if own else run_dir), "trainer.total_steps=1", *case["overrides"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=files["root"], env=env, capture_output=True, text=True,
                              timeout=timeout)
        status, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        status, err = "timeout", (exc.stderr or b"").decode(errors="replace") \
            if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    finally:
        busy.close()
    lines = [x for x in err.splitlines() if ERROR_LINE.match(x)]
    problem = case["check"](files["root"]) if case["check"] and status in case["status"] else None
    clean = (status in case["status"] and len(lines) == case["lines"] and "Traceback" not in err
             and "Fatal Python error" not in err and problem is None)
    lines += [f"check: {problem}"] if problem else []
    return {"name": case["name"], "status": status, "clean": clean, "lines": lines,
            "tail": "" if clean else err[-1500:], "s": time.monotonic() - start}


def sweep(names: list[str] | None = None, ranks: int = 1, progress=print) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="hybridrl_bad_") as tmp:
        files = make_files(Path(tmp))
        chosen = [c for c in cases(files) if not names or c["name"] in names]
        out = []
        for i, case in enumerate(chosen, 1):
            res = run_case(case, files, ranks)
            out.append(res)
            line = res["lines"][0] if len(res["lines"]) == 1 else f"{len(res['lines'])} lines"
            line = "(ran through)" if not res["lines"] and res["clean"] else line
            progress(f"[{i}/{len(chosen)}] {res['name']:<26} {str(res['status']):>7} "
                     f"{'clean' if res['clean'] else 'NOT CLEAN'} {res['s']:5.1f}s  "
                     f"{line.replace(tmp, '<tmp>')[:160]}")
            if not res["clean"]:
                progress("    " + res["tail"].replace(tmp, "<tmp>").replace("\n", "\n    "))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(c["name"] for c in cases(make_files(Path(tmp)))))
        return 0
    results = sweep(args.only, args.ranks)
    clean = sum(r["clean"] for r in results)
    print(f"{clean} of {len(results)} bad inputs end in one clean line")
    return 0 if clean == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
