"""Nothing silently wrong, round 2 (issue 32): the single-process cases. Each test names the
item of the issue it guards; the multi-rank ones are in tests/distributed/test_failures.py.

1 reward timeouts are not collective timeouts and cost timeout_s once; 2 a torn metrics line;
3 the run-folder lock; 4 a corrupt meta.json falls back; 9 unknown estimator / loss at start;
11 a resume records run.json only once loaded; 12 a duplicate YAML key; 13 Hydra's {k:v};
14 verl's LoRA keys; 15 the non-finite cap, SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from hybridrl.checkpoint.run_folder import apply_run_dir, keep_steps_upto, plan_run_dir
from hybridrl.checkpoint.run_identity import StartupError
from hybridrl.checkpoint.run_lock import acquire_run_lock
from hybridrl.config import load_config
from hybridrl.parallel.phases import is_timeout
from hybridrl.rewards.distributed import RewardError, RowItem, score_rows
from hybridrl.rewards.scoring import build_reward_scorer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG = '''
import time
def hang(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(3600)
def timed_out(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise ConnectionError("read timed out")
'''


# ---------------------------------------------------------------- 1: reward timeouts
def test_reward_errors_are_not_collective_timeouts():
    line = ("reward function 'f.py:hang' no result within 5 s (reward.timeout_s) on row 0 "
            "(data_source 'x', index 3)")
    assert not is_timeout(RewardError(line))  # was taken for a collective timeout (600 s line)
    try:
        try:
            raise ConnectionError("read timed out")
        except ConnectionError:
            raise RuntimeError("read timed out") from None
    except RuntimeError as err:
        wrapped = err
    assert not is_timeout(wrapped)
    assert is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                                   "waiting 2000ms for recv operation to complete"))


@pytest.mark.parametrize("pooled", [False, True])
def test_hanging_reward_fails_at_timeout_naming_function_source_and_row(tmp_path, pooled):
    (tmp_path / "rw.py").write_text(HANG)
    cfg = load_config([], [f"reward.reward_fn={tmp_path}/rw.py:hang", "reward.timeout_s=1",
                           f"reward.num_workers={1 if pooled else 0}"])
    scorer = build_reward_scorer(cfg.reward)
    items = [RowItem(r, "7", [1], "7", "src_a", {"index": 10 + r}) for r in range(30)]
    pool = None
    if pooled:
        import multiprocessing as mp

        pool = mp.get_context("forkserver").Pool(1)
        pool.apply(time.sleep, (0,))  # the worker is up before the clock starts
    try:
        start = time.monotonic()
        import dataclasses

        got = score_rows(scorer, items, 1.0, pool, json.dumps(dataclasses.asdict(cfg.reward)))
        took = time.monotonic() - start
    finally:
        if pool is not None:
            pool.terminate()
    assert isinstance(got, str), got
    assert got.startswith(f"reward function '{tmp_path}/rw.py:hang' no result within 1 s "
                          "(reward.timeout_s) on row 0 (data_source 'src_a', index 10)"), got
    assert took < 20, took  # once (~1 s), not once per row (30 rows: 30 s); 19 s for load


def test_reward_connection_error_names_the_function(tmp_path):
    (tmp_path / "rw.py").write_text(HANG)
    cfg = load_config([], [f"reward.reward_fn={tmp_path}/rw.py:timed_out"])
    got = score_rows(build_reward_scorer(cfg.reward), [RowItem(2, "7", [1], "7", "s", None)], 5.0)
    assert got == (f"reward function '{tmp_path}/rw.py:timed_out' raised ConnectionError: read "
                   "timed out on row 2 (data_source 's', index None)")
    assert not is_timeout(RewardError(got))


# ---------------------------------------------------------------- 2: torn metrics lines
def test_torn_last_metrics_line_is_moved_aside_and_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in (1, 2, 3))
    path.write_text(good + '{"step": 4, "x": 1.')  # the disk filled mid-append
    notices = []
    assert keep_steps_upto(path, 2, notices) == 1
    assert path.read_text() == "".join(good.splitlines(keepends=True)[:2])
    assert (tmp_path / "metrics.torn.txt").read_text() == '{"step": 4, "x": 1.\n'
    assert notices == ["metrics.jsonl line 4 was half-written (torn); moved to metrics.torn.txt"]
    path.write_text(good + "garbage\n" + json.dumps({"step": 5}) + "\n")
    with pytest.raises(StartupError, match=r"metrics.jsonl' line 4 is not a JSON object"):
        keep_steps_upto(path, 2)


# ---------------------------------------------------------------- 3: the run-folder lock
def test_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from hybridrl.checkpoint.run_lock import acquire_run_lock\n"
         f"lock = acquire_run_lock({str(run_dir)!r}); print('held', flush=True)\n"
         "time.sleep(120)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StartupError) as err:
            acquire_run_lock(run_dir, wait_s=0.3)
        assert str(err.value).startswith(f"the run folder {str(run_dir)!r} is in use by another "
                                         f"run (host {socket.gethostname()}, pid {holder.pid};")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = acquire_run_lock(run_dir, wait_s=0.3)  # the dead holder's lock is free
    assert json.loads((run_dir / ".hybridrl.lock").read_text())["pid"] == os.getpid()
    assert acquire_run_lock(run_dir, wait_s=0.0).fd == -1  # this process again: allowed
    lock.release()


# ---------------------------------------------------------------- 4, 11: the plan and run.json
def _ckpt(root, step, run, meta=None):
    path = root / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(meta if meta is not None else json.dumps({"run_id": run}))
    (path / "COMPLETE").write_text("")
    return path


def test_corrupt_meta_json_falls_back_to_the_previous_checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _ckpt(root, 4, "r1")
    _ckpt(root, 8, "r1", meta='{"run_id": "r1", "st')  # was: "holds global_step_8 of run None"
    plan = plan_run_dir(tmp_path / "run", root, "auto", "", "r1", False)
    assert plan.error is None and plan.resume == str(root / "global_step_4")
    assert f"'{root / 'global_step_8' / 'meta.json'}' cannot be read" in plan.notice
    (root / "global_step_4" / "meta.json").write_text("[")
    plan = plan_run_dir(tmp_path / "run", root, "auto", "", "r1", False)
    assert plan.resume is None and plan.error.startswith("trainer.resume=auto: no complete "
                                                         "checkpoint")


def test_resume_plan_does_not_write_run_json_before_the_load(tmp_path):
    run_dir = tmp_path / "run"
    other = _ckpt(tmp_path / "elsewhere", 2, "other")
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"run_id": "mine", "seed": 1}\n')
    plan = plan_run_dir(run_dir, run_dir / "checkpoints", "path", str(other), "new", False)
    apply_run_dir(run_dir, run_dir / "checkpoints", plan, "new", 5, record=plan.resume is None)
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == "mine"


# ---------------------------------------------------------------- 9: registries at start
def test_unknown_estimator_and_policy_loss_are_found_at_start(tmp_path):
    from hybridrl.algos.advantages import ADVANTAGE_ESTIMATORS
    from hybridrl.trainer.startup import _registry_problems

    cfg = load_config([], ["algorithm.adv_estimator=nope", "actor.policy_loss=nope2"])
    got = _registry_problems(cfg)
    assert got[0].startswith("algorithm.adv_estimator 'nope' is not a registered advantage "
                             "estimator; registered: [") and "'grpo'" in got[0]
    assert got[1].startswith("actor.policy_loss 'nope2' is not a registered policy loss")
    ADVANTAGE_ESTIMATORS.register("nope", lambda **kw: None, override=True)  # a user's own
    try:
        assert len(_registry_problems(cfg)) == 1
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop("nope")


# ---------------------------------------------------------------- 12, 13, 14: config input
def test_duplicate_yaml_key_is_named_with_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  lr: 1.0e-3\nactor:\n  lr: 2.0e-3\n")
    with pytest.raises(ValueError, match=r"c.yaml': found duplicate key actor \(line 3\)$"):
        load_config([str(path)])


def test_hydra_brace_mapping_override_is_a_mapping():
    cfg = load_config([], ["reward.reward_fn=hybridrl.rewards.gsm8k:compute_score",
                           "reward.reward_fn_kwargs={method:strict,digits:3}"])
    assert cfg.reward.reward_fn_kwargs == {"method": "strict", "digits": 3}


def test_verl_lora_rank_says_lora_is_not_supported():
    with pytest.raises(ValueError, match="LoRA is not supported"):
        load_config([], ["actor_rollout_ref.model.lora_rank=8"])
    load_config([], ["actor_rollout_ref.model.lora_rank=0"])  # verl's default: no LoRA


# ---------------------------------------------------------------- 15: cap, SIGTERM
class _Log:
    def __init__(self):
        self.lines = []

    def line(self, text):
        self.lines.append(text)


def test_nonfinite_skip_gives_up_after_nonfinite_max_steps():
    from hybridrl.trainer.guards import StepGuard

    t = load_config([], ["trainer.nonfinite_max_steps=2"]).trainer
    guard = StepGuard(t, torch.device("cpu"), _Log())
    nan = {"actor/pg_loss": float("nan")}
    for step in (1, 2):
        guard.judge(step, nan, None, None, None, [])
    guard.judge(3, {"actor/pg_loss": 0.1}, None, None, None, [])  # a finite step resets
    for step in (4, 5):
        guard.judge(step, nan, None, None, None, [])
    with pytest.raises(RuntimeError, match=r"step 6: non-finite actor/pg_loss; 3 consecutive "
                                           r"non-finite steps \(trainer.nonfinite_max_steps=2\)"):
        guard.judge(6, nan, None, None, None, [])
    assert load_config([]).trainer.nonfinite_max_steps == 3


def _terminated(code: str) -> tuple[int, str]:
    """Run ``code`` (which prints 'ready' once its SIGTERM handling is in place, and waits for
    the signal), send it SIGTERM: (exit status, stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)  # a bound on a hang: it ends in < 1 s
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_sigterm_is_one_line_and_status_143():
    # hybridrl.train's structure: the handler is installed inside the try that handles
    # Terminated, so a SIGTERM at any time after it (before 'ready' included) is handled (the
    # handler used to be installed before the try, and a SIGTERM landing between the two, as it
    # did on a loaded machine, ended in a traceback and status 1)
    code = ("import sys, time\nfrom hybridrl.exits import TERMINATED, FailureReporter, "
            "Terminated, handle_sigterm\n"
            "try:\n    handle_sigterm(0)\n    print('ready', flush=True)\n"
            "    while True:\n        time.sleep(3600)\n"
            "except Terminated:\n"
            "    sys.exit(FailureReporter(0).report(TERMINATED, 'terminated (SIGTERM)'))\n")
    assert _terminated(code) == (143, "hybridrl.train: error: terminated (SIGTERM)\n")


def test_sigterm_while_stuck_in_c_still_ends_with_the_line():
    code = ("import signal, time\nimport hybridrl.exits as ex\nex.TERM_GRACE_S = 0.5\n"
            "ex.handle_sigterm(1)\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"  # as if stuck in a collective:
            "print('ready', flush=True)\n"  # the main thread never raises Terminated
            "while True:\n    time.sleep(0.1)\n")  # only the watchdog ends it
    assert _terminated(code) == (143, "hybridrl.train: error (rank 1): terminated (SIGTERM)\n")


# ---------------------------------------------------------------- 5, 12: input files named
def _hf_folder(folder, shapes_override=None):
    from safetensors.torch import save_file

    from hybridrl.models.hf_files import expected_hf_shapes
    from hybridrl.models.spec import LlamaSpec

    spec = LlamaSpec(hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=64, vocab_size=100)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(spec.to_hf_config()))
    shapes = {**expected_hf_shapes(spec), **(shapes_override or {})}
    save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _startup_lines(folder):
    from hybridrl.trainer.startup import _model_problems

    return _model_problems(load_config([], [f"model.path={folder}"]))


def test_safetensors_shapes_are_checked_against_config_json(tmp_path):
    assert _startup_lines(_hf_folder(tmp_path / "ok")) == []
    bad = _hf_folder(tmp_path / "big", {"model.layers.0.mlp.up_proj.weight": (65, 32),
                                        "model.embed_tokens.weight": (150, 32)})
    got = _startup_lines(bad)  # bigger than config.json: loaded silently before
    assert got == [f"model.path: '{bad}/model.safetensors': tensor model.embed_tokens.weight has "
                   "shape [150, 32], config.json says [100, 32]",
                   f"model.path: '{bad}/model.safetensors': tensor "
                   "model.layers.0.mlp.up_proj.weight has shape [65, 32], config.json says [64, 32]"]


def test_truncated_safetensors_and_garbage_tokenizer_are_named(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    (folder / "tokenizer.json").write_text("{garbage")
    got = _startup_lines(folder)
    assert got[0].startswith(f"model.path: '{path}' is truncated (") and len(got) == 2
    assert got[1].startswith(f"model.path: '{folder}/tokenizer.json' is not valid JSON (")


def test_reward_file_with_a_syntax_error_is_bad_input(tmp_path):
    from hybridrl.exits import BAD_INPUT, status_of
    from hybridrl.rewards.custom import load_reward_fn

    (tmp_path / "rw.py").write_text("def fn(a, b, c, d=None):\n    return 1 +\n")
    with pytest.raises(ValueError) as err:
        load_reward_fn(f"{tmp_path}/rw.py:fn")
    assert str(err.value) == (f"reward function '{tmp_path}/rw.py:fn': {tmp_path}/rw.py line 2: "
                              "SyntaxError: invalid syntax")
    assert status_of(err.value, started=False) == BAD_INPUT


def test_byte_flipped_parquet_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrl.trainer.startup import _data_problems

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"data_source": ["x"] * 50, "prompt": ["hello there"] * 50}), path)
    raw = bytearray(path.read_bytes())
    for k in range(len(raw) // 3, len(raw) - 12):
        raw[k] ^= 0xFF
    path.write_bytes(bytes(raw))
    got = _data_problems(load_config([], [f"data.train_files=[{path}]", f"data.val_files=[{path}]",
                                          "reward.reward_fn=hybridrl.rewards.gsm8k:compute_score"]))
    assert got and all("\n" not in p and p.startswith(f"data file '{path}'") for p in got), got


def test_checkpoint_write_on_a_full_disk_says_so(tmp_path, monkeypatch):
    import errno

    from hybridrl.checkpoint import folder as ck

    def full(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64")

    monkeypatch.setattr(ck.torch, "save", full)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096})())
    with pytest.raises(OSError) as err:
        ck.write_file({"x": 1}, tmp_path / "rank_00000.pt")
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == f"[Errno 28] no space left on the disk of {tmp_path} (0.0 MiB free)"


# ---------------------------------------------------------------- 6, 7: late and dead ranks
def test_a_silent_rank_is_named_in_one_line_that_any_rank_writes_alike():
    import torch.distributed as dist

    from hybridrl.parallel import phases

    store = dist.HashStore()
    boards = [phases.PhaseBoard(store, r, 4) for r in range(4)]
    for r, b in enumerate(boards):
        b.record(3, "timing_s/reward" if r == 1 else "timing_s/update_actor")
        b.start_heartbeat(0.05)
    boards[1].stop_heartbeat()  # SIGSTOP, kill -9 or os._exit: its heartbeat ends
    time.sleep(0.6)  # rank 1's last beat is then >= 0.6 s old: past describe_timeout's 0.5 s
    for _ in range(300):  # the others beat every 0.05 s, but a loaded machine can hold one back
        silent = set(boards[0].silent(0.3))
        if silent == {1}:
            break
        time.sleep(0.1)
    assert silent == {1}
    lines = {boards[r].describe_timeout(r, 1.0) for r in (0, 2, 3)}
    assert len(lines) == 1, lines  # the reporter shows it once (was: one line per rank)
    line = lines.pop()
    assert line.startswith("a collective timed out after 1 s (trainer.collective_timeout_s) in "
                           "timing_s/update_actor of step 3: rank 1 stopped responding (no "
                           "heartbeat for "), line
    assert line.endswith("last in timing_s/reward of step 3"), line
    lost = boards[2].describe_peer_loss(2, RuntimeError("Connection closed by peer"))
    assert lost.startswith("a rank's process is gone (killed, crashed, or it exited: os._exit, "
                           "a signal): rank 1 has sent no heartbeat for "), lost
    for b in boards:
        b.stop_heartbeat()


def test_a_timeout_raised_as_a_peer_dies_names_the_dead_rank():
    """CI of stop 47: rank 1 killed while all ranks were in the same phase; gloo raised a
    "timed out" error on rank 0 before rank 1's heartbeat aged, and the line said "no rank
    recorded another phase" instead of naming rank 1."""
    import torch.distributed as dist

    from hybridrl.parallel import phases

    store = dist.HashStore()
    boards = [phases.PhaseBoard(store, r, 2) for r in range(2)]
    for b in boards:
        b.record(3, "timing_s/gen")
        b.start_heartbeat(0.05)
    boards[1].stop_heartbeat()  # kill -9 just now: its last beat is still fresh
    line = boards[0].describe_timeout(0, 600.0)
    boards[0].stop_heartbeat()
    assert line.startswith("a rank's process is gone (killed, crashed, or it exited: "
                           "os._exit, a signal): rank 1 has sent no heartbeat for "), line
    assert "last in timing_s/gen of step 3" in line, line


# ---------------------------------------------------------------- 8: the reference at another layout
def test_random_reference_resumed_at_another_tp_or_pp_says_so():
    from hybridrl.checkpoint.checkpointer import reference_notice

    meta = {"tp": 2, "pp": 2, "dp": 1, "world": 4}
    got = reference_notice(meta, {"world": 4, "tp": 1, "pp": 1, "dp": 4}, True, "global_step_8")
    assert got.startswith("hybridrl: notice: the reference model is randomly initialized (no "
                          "model.path) and global_step_8 was written at tp 2 pp 2: at tp 1 pp 1")
    assert reference_notice(meta, {"world": 8, "tp": 2, "pp": 2, "dp": 2}, True, "g") is None
    assert reference_notice(meta, {"world": 4, "tp": 1, "pp": 1, "dp": 4}, False, "g") is None


def test_malformed_overrides_are_one_line_naming_the_override_once():
    for item, said in (("actor.lr", "override 'actor.lr': must look like key=value"),
                       ("actor.lr=[1,", "override 'actor.lr=[1,': cannot be parsed: while "
                                        "parsing a flow node")):
        with pytest.raises(ValueError) as err:
            load_config([], [item])
        assert str(err.value).startswith(said) and "\n" not in str(err.value), str(err.value)
        assert str(err.value).count(f"override {item!r}") == 1


def test_a_verl_name_under_a_hybridrl_section_says_what_it_is():
    with pytest.raises(ValueError) as err:  # was: "did you mean 'actor.clip_ratio_c'?"
        load_config([], ["actor.clip_ratio=0.2"])
    assert str(err.value).endswith("unknown key 'actor.clip_ratio'; verl's 'actor_rollout_ref."
                                   "actor.clip_ratio' is hybridrl's 'actor.clip_ratio_low', "
                                   "'actor.clip_ratio_high'"), str(err.value)
