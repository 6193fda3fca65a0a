"""Start-up checks (hybridrl/trainer/startup.py) that need no process group: a config.json that
SGLang would roll out as another model is refused before any collective, in one line."""

from __future__ import annotations

import json

import pytest

from hybridrl.config import load_config
from hybridrl.trainer.startup import check_startup

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _folder(path, rope_key: str, rope: dict):
    path.mkdir()
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
              "vocab_size": 100, "max_position_embeddings": 64, rope_key: rope}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_yarn_attention_factor_is_refused_with_sglang_only(tmp_path, rope_key):
    folder = _folder(tmp_path / "m", rope_key, {**YARN, "attention_factor": 1.3})
    base = [f"trainer.output_dir={tmp_path}/out", f"data.synthetic.dir={tmp_path}/syn",
            f"model.path={folder}"]
    got = check_startup(load_config([], [*base, "rollout.engine=sglang"]), 0)
    assert got == [f"model.path: '{folder}/config.json' sets {rope_key}.attention_factor=1.3, "
                   "which rollout.engine=sglang does not support: SGLang ignores "
                   "attention_factor (it reads attn_factor as a multiplier of its own yarn "
                   "scale), so it would generate with another model than the one trained; use "
                   "rollout.engine=builtin"]
    assert check_startup(load_config([], [*base, "rollout.engine=builtin"]), 0) == []


def test_yarn_without_attention_factor_passes_with_sglang(tmp_path):
    folder = _folder(tmp_path / "m", "rope_scaling", YARN)
    cfg = load_config([], [f"trainer.output_dir={tmp_path}/out", f"model.path={folder}",
                           f"data.synthetic.dir={tmp_path}/syn", "rollout.engine=sglang"])
    assert check_startup(cfg, 0) == []
