"""examples/: prepare_gsm8k.py writes verl's GSM8K rows; the launch scripts' command lines load
(verl keys included) into the layout their comments promise, through hybridrl.train's parser."""

import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl import train
from hybridrl.config.loader import load_config, resolve_config_name
from hybridrl.data.schema import read_rows
from hybridrl.rewards.gsm8k import compute_score
from tests.support.examples import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
GSM8K = [  # GSM8K's own columns (question, answer); answers end with "#### N"
    {"question": "Tom has 3 apples and buys 4. How many?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day. How many in 2 days?",
     "answer": "1,200 * 2 = <<1200*2=2400>>2,400\n#### 2,400"},
    {"question": "It is 5 degrees and drops 8. Temperature?", "answer": "5 - 8 = -3\n#### -3"},
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _gsm8k_folder(tmp_path):
    main = tmp_path / "gsm8k" / "main"
    main.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GSM8K), main / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K[:1]), main / "test-00000-of-00001.parquet")
    return tmp_path / "gsm8k"


def test_prepare_gsm8k_writes_verls_rows(tmp_path):
    prepare = load_example("prepare_gsm8k")
    out = tmp_path / "out"
    written = prepare.main(["--src", str(_gsm8k_folder(tmp_path)), "--out", str(out)])
    assert written == {"train": str(out / "train.parquet"), "test": str(out / "test.parquet")}
    table = pq.read_table(out / "train.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    truths = ["7", "2400", "-3"]
    for i, (row, src) in enumerate(zip(table.to_pylist(), GSM8K)):
        assert row == {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{src['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truths[i]},
            "extra_info": {"split": "train", "index": i, "answer": src["answer"],
                           "question": src["question"]},
        }
    rows = read_rows(str(out / "train.parquet"))  # hybridrl's loader reads them
    # the reference solution scores 1 under the strict GSM8K rule, a wrong one 0
    assert [compute_score(r.data_source, src["answer"], r.ground_truth)
            for r, src in zip(rows, GSM8K)] == [1.0, 1.0, 1.0]
    assert compute_score("openai/gsm8k", "#### 8", rows[0].ground_truth) == 0.0
    assert read_rows(str(out / "test.parquet"))[0].extra_info["split"] == "test"


def test_prepare_gsm8k_rejects_a_row_without_final_answer(tmp_path):
    prepare = load_example("prepare_gsm8k")
    with pytest.raises(ValueError, match="train row 1: answer has no '#### N' line"):
        prepare.to_rows([GSM8K[0], {"question": "q", "answer": "no final line"}], "train")
    with pytest.raises(ValueError, match="no main/train"):
        prepare.find_split(str(tmp_path), "train")


def _shims(tmp_path):
    """A torchrun that prints its arguments one per line and an srun that just runs its command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; '
                                  'done\nexec "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL_PATH": str(model)}


def _launched(script, env, *extra):
    done = subprocess.run(["bash", os.path.join(EXAMPLES, script), *extra], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()
    return argv[:argv.index("-m")], train.parse_args(argv[argv.index("hybridrl.train") + 1:])


def test_gsm8k_ppo_script_loads_as_verl_would_run_it(tmp_path):
    env = _shims(tmp_path)
    launcher, args = _launched("gsm8k_ppo_megatron.sh", env, "trainer.total_epochs=2")
    assert launcher == ["--standalone", "--nproc-per-node", "8"]
    assert resolve_config_name(args.config_name, args.config_path) is None  # verl's base config
    notices = []
    cfg = load_config([], args.overrides, world_size=8, notices=notices)
    assert cfg.model.path == cfg.critic.model_path == env["MODEL_PATH"]
    assert cfg.use_critic and cfg.rollout.engine == "sglang" and cfg.trainer.total_epochs == 2
    assert cfg.data.train_files == ["data/gsm8k/train.parquet"]
    assert (cfg.parallel.tp, cfg.parallel.gen.tp, cfg.check_world(8)) == (2, 1, 4)
    assert cfg.trainer.logger == ["console", "wandb"]  # a sink hybridrl has is kept
    with pytest.raises(ValueError, match="launcher started 4 ranks"):
        load_config([], args.overrides, world_size=4)


def test_gsm8k_ppo_script_needs_a_model_folder(tmp_path):
    env = {**_shims(tmp_path), "MODEL_PATH": str(tmp_path / "absent")}
    done = subprocess.run(["bash", os.path.join(EXAMPLES, "gsm8k_ppo_megatron.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "has no config.json" in done.stderr


def test_slurm_script_rendezvous_and_shared_paths(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.parquet").write_text("")
    env = {**_shims(tmp_path), "DATA_DIR": str(data), "CKPT_DIR": str(tmp_path / "ckpt"),
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "77", "MASTER_ADDR": "node-a"}
    launcher, args = _launched("slurm_multinode.sbatch", env)
    assert launcher == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "node-a:29500", "--rdzv-id", "77"]
    cfg = load_config(args.config, args.overrides, world_size=16)
    assert cfg.check_world(16) == 4 and cfg.data.train_files == [f"{data}/train.parquet"]
    assert cfg.trainer.checkpoint_dir == str(tmp_path / "ckpt") and cfg.trainer.resume == "auto"
    env["DATA_DIR"] = str(tmp_path / "not_shared")  # a path this node lacks stops the job
    done = subprocess.run(["bash", os.path.join(EXAMPLES, "slurm_multinode.sbatch")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "shared filesystem?" in done.stderr
