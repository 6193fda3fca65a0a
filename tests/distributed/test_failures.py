"""Nothing silently wrong (issue 14): non-finite steps, run identity, one-line failures, timeouts,
exit statuses that survive torchrun. Each test names the defect it guards against.

Trainer cases run in one process group per world size (``test_failure_cases``); the launcher
tests, which start ``python -m hybridrl.launch`` (torchrun's agent) on 2 ranks, are in
``test_launcher_failures`` (their launches run side by side).
"""

from __future__ import annotations

import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_failure_cases as cases_mod
from tests.distributed.test_trainer_cases import run_in

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GAE = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true"]
NAN_REWARD = '''
import math, os
def nan_on_some(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return math.nan if extra_info and extra_info.get("index", 0) >= 0 else 0.5
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("failures")
    (path / "rewards.py").write_text(NAN_REWARD)
    return str(path)


@pytest.fixture(scope="module")
def world1(root):
    ck = lambda name: run_in(f"{root}/{name}")  # noqa: E731
    nan_fn = f"reward.reward_fn={root}/rewards.py:nan_on_some"
    cases = [
        # defect 1: a NaN loss is rolled back, counted, never saved
        ("nan_rollback", [*GAE, *ck("nan_rb"), "trainer.total_steps=3",
                          "trainer.nonfinite=rollback"], "nan_loss"),
        # the default (skip): no snapshot, the optimizer refuses the NaN updates
        ("nan_skip", [*GAE, *ck("nan_skip"), "trainer.total_steps=3"], "nan_loss"),
        ("nan_fail", [*GAE, *ck("nan_fail"), "trainer.nonfinite=fail"], "nan_loss"),
        # defect 1: the KL guard on: a NaN KL is not "small"
        ("nan_kl", [*GAE, *ck("nan_kl"), "trainer.kl_guard.max_kl=100"], "nan_loss"),
        # defect 1: NaN rewards name their rows; skip goes on, fail stops
        ("nan_reward_skip", [*GAE, *ck("rw_skip"), nan_fn, "trainer.nonfinite=skip"], "fit"),
        ("nan_reward_fail", [*GAE, *ck("rw_fail"), nan_fn, "trainer.nonfinite=fail"], "fit"),
        # defect 2: run identity
        ("seed1", [*GAE, *ck("ident"), "trainer.total_steps=1", "trainer.save_freq=1"], "fit"),
        ("seed7_auto", [*GAE, *ck("ident"), "trainer.seed=7"], "fit"),
        ("seed7_disable", [*GAE, *ck("ident"), "trainer.seed=7", "trainer.resume=disable"],
         "fit"),
        ("seed7_overwrite", [*GAE, *ck("ident"), "trainer.seed=7", "trainer.resume=disable",
                             "trainer.overwrite=true", "trainer.total_steps=1",
                             "trainer.save_freq=1"], "fit"),
        ("missing_path", [*GAE, *ck("ident"), "trainer.resume=path",
                          f"trainer.resume_path={root}/nowhere"], "fit"),
        # issue 32 item 10: a resume is bitwise the straight run, vocab padding included
        ("padding", [*GAE, f"trainer.output_dir={root}"], "padding_resume"),
    ]
    return run_on_ranks(cases_mod.run_cases, 1, root, cases, timeout=400,
                        preload=("megatron.core",))[0]


def test_resume_is_bitwise_the_straight_run_vocab_padding_included(world1):
    got = world1["padding"]
    assert got["steps"] == (2, 2) and got["pad_zero"] is True and got["same"], got


def test_nan_loss_is_rolled_back_counted_and_never_saved(world1):
    got = world1["nan_rollback"]
    assert got["error"] is None and got["restored"] and got["finite"]
    rolled = [m["training/rolled_back"] for m in got["history"]]
    assert rolled == [0.0, 1.0, 0.0]
    assert [m["training/nonfinite_steps"] for m in got["history"]] == [0.0, 1.0, 1.0]
    assert got["ckpt_finite"] and all(got["ckpt_finite"])
    assert any("step 2: non-finite actor/" in line and "rolled back" in line
               for line in got["lines"])
    assert any(line.endswith("rolled back: not kept") for line in got["lines"])
    assert "step 2: non-finite" in world1["nan_fail"]["error"]
    assert "trainer.nonfinite=fail" in world1["nan_fail"]["error"]


def test_nan_loss_by_default_is_refused_by_the_optimizer_without_a_snapshot(world1):
    got = world1["nan_skip"]
    assert got["error"] is None and got["finite"] and got["snapshots"] == 0
    assert [m["training/nonfinite_steps"] for m in got["history"]] == [0.0, 1.0, 1.0]
    assert [m["training/rolled_back"] for m in got["history"]] == [0.0, 0.0, 0.0]
    assert any("step 2: non-finite" in line and "skipped by the optimizer" in line
               for line in got["lines"])
    assert world1["nan_rollback"]["snapshots"] == 3  # rollback mode copies every step


def test_nan_kl_is_not_below_max_kl(world1):
    got = world1["nan_kl"]
    assert got["history"][1]["training/rolled_back"] == 1.0 and got["finite"]


def test_nan_rewards_name_rows_and_skip_or_fail(world1):
    skip = world1["nan_reward_skip"]
    assert skip["error"] is None
    assert all(m["training/rolled_back"] == 1.0 for m in skip["history"])
    line = next(x for x in skip["lines"] if "reward is not finite" in x)
    assert "data_source 'hybridrl/arithmetic', index" in line
    fail = world1["nan_reward_fail"]["error"]
    assert fail.startswith("RuntimeError: step 1: the reward is not finite") and "row 0" in fail


def test_resume_auto_refuses_another_run(world1, root):
    assert world1["seed1"]["error"] is None
    err = world1["seed7_auto"]["error"]
    assert err.startswith("StartupError: trainer.resume=auto") and "global_step_1" in err
    ids = json.loads(open(f"{root}/ident/previous_0/run.json").read())["run_id"]
    assert ids in err  # names the folder's run (both ids are in the line)
    assert "already holds" in world1["seed7_disable"]["error"]
    over = world1["seed7_overwrite"]
    assert over["error"] is None and any("aside into" in x for x in over["lines"])
    # overwrite: the whole previous run folder content, checkpoints included, moved aside
    assert sorted(os.listdir(f"{root}/ident/previous_0")) == [
        "checkpoints", "config.yaml", "metrics.jsonl", "run.json"]
    assert os.listdir(f"{root}/ident/previous_0/checkpoints") == ["global_step_1"]
    assert sorted(os.listdir(f"{root}/ident")) == [".hybridrl.lock", "checkpoints", "config.yaml",
                                                   "metrics.jsonl", "previous_0", "run.json"]
    assert "does not exist" in world1["missing_path"]["error"]


def test_checkpoint_refuses_nonfinite_state_and_names_bad_files(tmp_path):
    from hybridrl.checkpoint.folder import (
        begin_folder,
        finish_folder,
        read_file,
        read_json,
        refuse_nonfinite,
        write_file,
    )

    with pytest.raises(RuntimeError, match=r"global_step_1 not written.*rank\(s\) \[0\]"):
        refuse_nonfinite(1, 0, {"actor": {"x/exp_avg": torch.tensor([1.0, math.nan])}})
    tmp = begin_folder(tmp_path, 2)
    info = write_file({"x": torch.arange(1000.0)}, tmp / "rank_00000.pt")
    folder = finish_folder(tmp_path, 2, {"files": {"rank_00000.pt": info}}, {}, {"step": 2})
    index = read_json(folder, "index.json")
    data = bytearray((folder / "rank_00000.pt").read_bytes())
    data[len(data) // 2] ^= 1  # one bit: only the CRC sees it
    (folder / "rank_00000.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rank_00000.pt' cannot be read .*CRC-32"):
        read_file(folder, "rank_00000.pt", index["files"]["rank_00000.pt"])
    (folder / "trainer_state.pt").write_bytes(b"")  # empty
    with pytest.raises(ValueError, match="trainer_state.pt' cannot be read .*truncated"):
        read_file(folder, "trainer_state.pt", index["files"]["trainer_state.pt"])
    (folder / "meta.json").write_text('{"world": ')
    with pytest.raises(ValueError, match="meta.json' cannot be read"):
        read_json(folder, "meta.json")


def test_run_dir_plan_and_leftover_tmp(tmp_path):
    from hybridrl.checkpoint.run_folder import apply_run_dir, plan_run_dir

    ckpt = tmp_path / "checkpoints"
    (ckpt / ".tmp_global_step_4").mkdir(parents=True)
    plan = plan_run_dir(tmp_path, ckpt, "auto", "", "aaaa", False)
    assert plan.error is None and plan.resume is None
    apply_run_dir(tmp_path, ckpt, plan, "aaaa", 1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "run.json"]
    assert os.listdir(ckpt) == []  # the leftover temp folder is gone
    (tmp_path / "metrics.jsonl").write_text("")
    assert "already holds run aaaa" in plan_run_dir(tmp_path, ckpt, "auto", "", "bbbb",
                                                    False).error


def test_run_id_ignores_run_length_not_seed():
    from hybridrl.checkpoint.run_identity import run_id
    from hybridrl.config import load_config

    base = run_id(load_config([], []))
    assert run_id(load_config([], ["trainer.total_steps=9", "trainer.resume=disable"])) == base
    assert run_id(load_config([], ["trainer.seed=7"])) != base
    assert run_id(load_config([], ["actor.lr=1e-5"])) != base


def test_run_id_survives_a_new_knob_with_its_default():
    """A newer hybridrl adds a config field: runs of the older one keep their id (and resume)."""
    import dataclasses

    from hybridrl.checkpoint.run_identity import run_id
    from hybridrl.config import HybridRLConfig, load_config
    from hybridrl.config.model import ModelConfig

    @dataclasses.dataclass(frozen=True)
    class NewerModel(ModelConfig):
        brand_new_knob: int = 3

    @dataclasses.dataclass(frozen=True)
    class NewerConfig(HybridRLConfig):
        model: NewerModel = dataclasses.field(default_factory=NewerModel)

    cfg = load_config([], ["trainer.seed=7", "actor.lr=1e-5"])
    newer = NewerConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                           if f.name != "model"}, model=NewerModel(**dataclasses.asdict(cfg.model)))
    assert run_id(newer) == run_id(cfg)
    changed = dataclasses.replace(newer, model=dataclasses.replace(newer.model, brand_new_knob=4))
    assert run_id(changed) != run_id(cfg)


def _parquet(path, sources, prompts):
    rows = [{"data_source": s, "prompt": [{"role": "user", "content": p}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "1"},
             "extra_info": {"split": "train", "index": i}}
            for i, (s, p) in enumerate(zip(sources, prompts))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_startup_checks_name_the_path_or_key(tmp_path):
    from hybridrl.config import load_config
    from hybridrl.trainer.startup import check_startup

    (tmp_path / "file").write_text("x")
    data = _parquet(tmp_path / "d.parquet", ["openai/gsm8k", "mystery/src", "gsm8k"],
                    ["1+1?", "2+2?", "  "])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"hidden_size": 3')
    cfg = load_config([], [f"trainer.output_dir={tmp_path}/file", "trainer.experiment_name=x",
                           f"trainer.checkpoint_dir={tmp_path}/file/ck",
                           f"data.train_files=[{data}]", f"model.path={hf}"])
    problems = "\n".join(check_startup(cfg, 0))
    assert (f"trainer.output_dir: the run folder '{tmp_path}/file/x' cannot be created or "
            "written (NotADirectoryError") in problems
    assert f"trainer.checkpoint_dir '{tmp_path}/file/ck' cannot be created" in problems
    assert "data_source 'mystery/src' (rows [1]) has no reward function" in problems
    assert "row 2 has an empty prompt" in problems
    assert f"'{hf}/config.json' is not valid JSON" in problems
    assert f"model.path '{hf}' has no tokenizer files" in problems
    ok = load_config([], [f"trainer.output_dir={tmp_path}/out", "data.synthetic.dir="
                          f"{tmp_path}/syn"])
    assert check_startup(ok, 0) == []


def test_unwritable_output_dir_fails_every_rank_before_any_collective(tmp_path):
    """An output_dir that cannot be written (a folder under a regular file; as root a
    permission bit would not stop the writes): every rank of 2 exits 2 with one line naming the
    run folder, none reaches a collective or the process-group set-up."""
    (tmp_path / "file").write_text("x")
    argv = [f"trainer.output_dir={tmp_path}/file/out", "trainer.experiment_name=exp",
            f"data.synthetic.dir={tmp_path}/data", "trainer.device=cpu"]
    out = run_on_ranks(cases_mod.startup_refusal, 2, argv, timeout=120)
    run_folder = f"'{tmp_path}/file/out/exp'"
    for rank, got in enumerate(out):
        assert got["status"] == 2 and got["reached"] == [], got
        lines = got["stderr"].splitlines()
        prefix = "hybridrl.train: error" + ("" if rank == 0 else f" (rank {rank})")
        assert len(lines) == 1 and lines[0].startswith(prefix + ": trainer.output_dir: "), lines
        assert f"the run folder {run_folder} cannot be created or written" in lines[0]
        assert "NotADirectoryError" in lines[0]


def test_timeout_names_the_late_rank_and_its_phase_and_errors_show_once():
    out = run_on_ranks(cases_mod.phase_timeout, 2, timeout=120)
    assert out[0]["timeout"], out[0]
    line = out[0]["line"]
    assert "timed out after 2 s" in line and "in timing_s/update_actor of step 3" in line
    assert "ranks [1] did not arrive (rank 1: timing_s/reward of step 3)" in line
    assert out[0]["stderr"] == "hybridrl.train: error: the same problem everywhere\n"
    assert out[1]["stderr"] == "hybridrl.train: error (rank 1): only rank 1 hit this\n"


def test_launcher_argv_and_status_mapping():
    from hybridrl.checkpoint.run_identity import StartupError
    from hybridrl.exits import one_line, status_of
    from hybridrl.launch import split_argv, status_of_exitcode

    assert split_argv(["--standalone", "--nproc-per-node", "2", "--config", "a.yaml", "x=1"]) == (
        ["--standalone", "--nproc-per-node", "2"], ["--config", "a.yaml", "x=1"])
    assert split_argv(["--nnodes=1", "--", "actor.lr=1"]) == (["--nnodes=1"], ["actor.lr=1"])
    assert [status_of_exitcode(c) for c in (0, 1, 2, 130, -2, -9)] == [0, 1, 2, 130, 130, 1]
    assert status_of(ValueError("x"), started=True) == 1  # user code mid-run: not bad config
    assert status_of(ValueError("x"), started=False) == 2
    assert status_of(StartupError("x"), started=True) == 2
    try:
        {}["k"]
    except KeyError as err:
        assert one_line(err).startswith("KeyError: 'k' (at test_failures.py:")

