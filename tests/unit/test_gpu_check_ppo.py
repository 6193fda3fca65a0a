"""scripts/gpu_ppo_step.py (gpu_check stage ppo) on the CPU: ``--device cpu --tiny`` runs the
whole loop for both archs in their own processes and prints every summary line, so the script
cannot rot before a GPU runs it; an error building the Qwen3 trainer fails the run (no "not
supported" escape); its FLOP count and report read the trainer's metrics as documented."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_ppo_step as gps  # noqa: E402

KINDS = ("generation", "training", "MFU", "memory", "step")


@pytest.mark.slow
def test_tiny_cpu_run_prints_every_summary_line():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_ppo_step.py"), "--device",
                           "cpu", "--tiny", "--arch", "llama,qwen3", "--steps", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln[len("SUMMARY: "):] for ln in proc.stdout.splitlines()
             if ln.startswith("SUMMARY: ")]
    for kind in KINDS:
        assert any(ln.startswith(f"ppo llama-tiny {kind}: ") for ln in lines), (kind, lines)
    for kind in KINDS:  # hybridrl supports Qwen3: every line, as for the llama
        assert any(ln.startswith(f"ppo qwen3-tiny {kind}: ") for ln in lines), (kind, lines)
    assert not any("NOT SUPPORTED" in ln or "FAILED" in ln for ln in lines), lines
    steps = [ln for ln in lines if " step: " in ln]
    assert steps and all(ln.endswith("metrics finite: True") for ln in steps)
    memory = next(ln for ln in lines if ln.startswith("ppo llama-tiny memory: "))
    assert "plan --memory train_actor" in memory  # the planner ran on this job's config
    assert "hybridrl plan --memory --model " in proc.stdout  # the command, to rerun by hand


def test_a_qwen3_trainer_error_fails_the_run(tmp_path, monkeypatch):
    import hybridrl.trainer.ppo as ppo

    class Refuses:
        def __init__(self, *args, **kwargs):
            raise ValueError("architecture 'Qwen3ForCausalLM' is not supported; supported: ...")

    def write_config_only(folder, size, device):  # no transformers: the trainer never loads it
        Path(folder).mkdir(parents=True)
        (Path(folder) / "config.json").write_text(json.dumps(gps.hf_config("qwen3", size)))

    monkeypatch.setattr(ppo, "PPOTrainer", Refuses)
    monkeypatch.setattr(gps, "write_qwen3", write_config_only)
    with pytest.raises(ValueError, match="is not supported"):  # raised: the process exits 1
        gps.run_one("qwen3", "tiny", "cpu", 2, 1.0)


def _history(step_s):
    m = {"timing_s/step": step_s, "timing_s/gen": 1.0, "timing_s/update_actor": 2.0,
         "timing_s/ref": 0.5, "timing_s/old_log_prob": 0.5, "response_length/mean": 10.0,
         "prompt_length/mean": 30.0, "perf/total_tokens": 4000.0, "actor/loss": 0.1}
    return [dict(m, **{"timing_s/step": 99.0}), m, dict(m)]  # the first one is left out


def test_flops_and_report_read_the_metrics():
    cfg = gps.argparse.Namespace(
        data=gps.argparse.Namespace(train_batch_size=10),
        rollout=gps.argparse.Namespace(n=10),
        actor=gps.argparse.Namespace(ppo_epochs=2),
        model=gps.argparse.Namespace(recompute_granularity="none"))
    history = _history(4.0)
    total, update = gps.flops_per_step(1e9, history[1], 4000, 4000, 2, recompute=False)
    assert update == 6e9 * 4000 * 2 and total == 2e9 * 4000 + 2e9 * 4000 * 2 + update
    lines = gps.report("ppo llama-x", history, cfg, int(1e9), 100.0, (12.0, 14.0),
                       ("train_actor", 10.0, "cmd"))
    assert lines[0] == ("ppo llama-x generation: 4,000 tokens/s (1000 response + 3000 prompt "
                        "tokens of 100 sequences in 1.00 s)")
    assert lines[1].startswith("ppo llama-x training: 4,000 tokens/s (2 epoch(s) of 4000")
    assert lines[2].startswith(f"ppo llama-x MFU: step {100 * total / 4.0 / 1e14:.1f}% ")
    assert lines[3].endswith("vs plan --memory train_actor 10.00 GB (without its 3 GB reserve)"
                             ", ratio 1.20")
    assert lines[4].startswith("ppo llama-x step: 4.00 s over steps 2-3 (gen 1.00")
    assert lines[4].endswith("metrics finite: True")
    history[2]["actor/loss"] = float("nan")
    assert gps.report("x", history, cfg, 1, 1.0, None, "no plan")[-1].endswith("False")
