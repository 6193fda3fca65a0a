"""Model presets are the published config.json files; ``hybridrl plan`` takes every supported
architecture as a folder, a config.json or a preset, refuses the old Llama-2 names and plans the
model a run config names."""

from __future__ import annotations

import json

import pytest

from hybridrl.reshard.specs import PRESETS, LlamaShape, preset

_LLAMA31 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
            "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "vocab_size": 128256}
_LLAMA32 = {**_LLAMA31, "eos_token_id": 128001, "tie_word_embeddings": True,
            "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}}
_QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 32768, "model_type": "qwen2",
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
           "use_sliding_window": False, "vocab_size": 152064}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
          "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
          "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
          "max_position_embeddings": 40960, "model_type": "qwen3", "rms_norm_eps": 1e-06,
          "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
          "use_sliding_window": False, "vocab_size": 151936}


def _sizes(hidden, ffn, heads, kv, layers, **extra):
    return dict(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                num_key_value_heads=kv, num_hidden_layers=layers, **extra)


REAL = {  # the published config.json of each preset's model (Instruct variants)
    "llama-3.1-8b": {**_LLAMA31, **_sizes(4096, 14336, 32, 8, 32)},
    "llama-3.1-70b": {**_LLAMA31, **_sizes(8192, 28672, 64, 8, 80)},
    "llama-3.2-1b": {**_LLAMA32, **_sizes(2048, 8192, 32, 8, 16, head_dim=64)},
    "llama-3.2-3b": {**_LLAMA32, **_sizes(3072, 8192, 24, 8, 28, head_dim=128)},
    "qwen2.5-7b": {**_QWEN25, **_sizes(3584, 18944, 28, 4, 28, max_window_layers=28)},
    "qwen2.5-72b": {**_QWEN25, **_sizes(8192, 29568, 64, 8, 80, max_window_layers=80)},
    "qwen3-8b": {**_QWEN3, **_sizes(4096, 12288, 32, 8, 36, max_window_layers=36)},
    "qwen3-32b": {**_QWEN3, **_sizes(5120, 25600, 64, 8, 64, max_window_layers=64)},
}
BILLIONS = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "llama-3.2-1b": 1.24,
            "llama-3.2-3b": 3.21, "qwen2.5-7b": 7.62,
            "qwen2.5-72b": 72.71, "qwen3-8b": 8.19, "qwen3-32b": 32.76, "llama2-7b": 6.74,
            "llama2-70b": 68.98}


@pytest.mark.parametrize("name", list(REAL))
def test_presets_are_the_published_configs(name):
    assert preset(name) == LlamaShape.from_hf_config(REAL[name])
    assert abs(PRESETS[name].num_params() / 1e9 - BILLIONS[name]) < 0.01


def test_llama2_presets_keep_their_sizes():
    for name in ("llama2-7b", "llama2-70b"):
        assert abs(PRESETS[name].num_params() / 1e9 - BILLIONS[name]) < 0.01
        assert PRESETS[name].vocab == 32000


@pytest.mark.parametrize("old", ["llama-7b", "llama-13b", "llama-34b", "llama-70b"])
def test_old_names_are_refused_naming_the_new_ones(old, capsys):
    with pytest.raises(ValueError, match=f"renamed 'llama2-{old[6:]}'"):
        preset(old)
    from hybridrl.planning.cli import main

    assert main(["--model", old, "--world", "8", "--gen-tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'llama2-{old[6:]}'" in err, err


@pytest.mark.parametrize("name", list(REAL))
def test_plan_takes_every_architecture_as_folder_or_file(tmp_path, capsys, name):
    from hybridrl.planning.cli import main

    (tmp_path / "config.json").write_text(json.dumps(REAL[name]))
    for model in (str(tmp_path), str(tmp_path / "config.json"), name):
        assert main(["--model", model, "--world", "16", "--tp", "4", "--gen-tp", "4",
                     "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model_bytes"] == PRESETS[name].num_params() * 2
        assert main(["--model", model, "--world", "16", "--tp", "4", "--pp", "2",
                     "--gen-tp", "4", "--memory", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["totals"]


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
      "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0]},
     "mlp_only_layers"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
])
def test_plan_refuses_unsupported_configs_with_the_key(tmp_path, capsys, change, needle):
    from hybridrl.planning.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**REAL["qwen3-8b"], **change}))
    assert main(["--model", str(tmp_path), "--world", "8", "--gen-tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_the_256_gpu_config_plans_its_named_model(capsys):
    """configs/llama70b_256gpu.yaml names Llama-3.1-70B-Instruct: --memory --config without
    --model plans exactly that model (the preset of its folder's name)."""
    from hybridrl.config import load_config
    from hybridrl.planning.cli import main, model_of_config

    cfg = load_config(["configs/llama70b_256gpu.yaml"])
    assert cfg.model.path.endswith("Llama-3.1-70B-Instruct")
    assert model_of_config(cfg) == "llama-3.1-70b"
    assert preset(model_of_config(cfg)) == LlamaShape.from_hf_config(REAL["llama-3.1-70b"])
    assert main(["--memory", "--config", "configs/llama70b_256gpu.yaml", "--world", "256",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "llama-3.1-70b"


@pytest.mark.parametrize("folder,name", [
    ("/ckpt/meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("/ckpt/meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b"),  # the 3.1 70B shape
    ("Meta-Llama-3-8B-Instruct/", "llama-3.1-8b"),
    ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    ("Llama-3.2-3B", "llama-3.2-3b"),
    ("Qwen/Qwen3-8B", "qwen3-8b"),
    ("Llama-3.2-11B-Vision-Instruct", None),
    ("my-model", None),
])
def test_preset_of_folder_names(folder, name):
    from hybridrl.reshard.specs import preset_of_folder

    assert preset_of_folder(folder) == name


def test_preset_tables_are_read_only():
    from hybridrl.config.hf_model import MODEL_TYPES
    from hybridrl.reshard.specs import RENAMED_PRESETS

    for table in (PRESETS, RENAMED_PRESETS, MODEL_TYPES):
        with pytest.raises(TypeError):
            table["x"] = None
