"""``hybridrl plan`` in-process, plus spec-level checks (presets, TE naming, bad shapes)."""

import json
import time

import pytest

from hybridrl.planning.cli import load_shape, main
from hybridrl.reshard.specs import PRESETS, LlamaShape, build_specs


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_1024_ranks_in_seconds(capsys):
    t0 = time.perf_counter()
    rc, out, _ = _run(capsys, "--model", "llama2-70b", "--world", "1024", "--tp", "8", "--pp", "8",
                      "--gen-tp", "4", "--gen-pp", "2", "--json")
    assert rc == 0 and time.perf_counter() - t0 < 10  # ~0.6 s; 10 s absorbs load, not a blow-up
    rep = json.loads(out)
    M = rep["model_bytes"]
    assert M == PRESETS["llama2-70b"].num_params() * 2
    s = rep["strategies"]
    assert set(s) == {"allgather", "vanilla", "zero_redundancy", "p2p"}
    for e in s.values():
        assert {"max_bytes_received_per_rank", "max_peak_bytes_per_rank", "est_seconds"} <= set(e)
    zr = s["zero_redundancy"]
    assert zr["max_bytes_received_per_rank"] == s["p2p"]["max_bytes_received_per_rank"]
    # Table 2 up to the replicated norms and the stage-0 embedding: within 5 %
    assert abs(zr["max_bytes_received_per_rank"] / zr["table2_bytes_received"] - 1) < 0.05
    assert s["allgather"]["max_bytes_received_per_rank"] > 8 * zr["max_bytes_received_per_rank"]
    assert zr["max_peak_bytes_per_rank"] < M / 8 * 1.2
    assert zr["est_seconds"] == pytest.approx(
        max(zr["max_bytes_received_per_rank"], zr["max_bytes_sent_per_rank"]) * 8 / 400e9)


LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
             "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
             "num_hidden_layers": 4, "vocab_size": 1000}


def test_plan_text_and_reason(capsys, tmp_path):
    cfg = {**LLAMA_CFG, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # pp 2 -> gen tp 2 at pp 1 (t = 2 -> tg = 4 would nest the other way round: nothing moves)
    rc, out, _ = _run(capsys, "--model", str(tmp_path / "config.json"), "--world", "8",
                      "--pp", "2", "--gen-tp", "2", "--dtype", "fp32", "--json")
    assert rc == 0
    rep = json.loads(out)
    assert "use p2p" in rep["strategies"]["zero_redundancy"]["reason"]
    assert rep["strategies"]["p2p"]["max_bytes_received_per_rank"] > 0
    rc, out, _ = _run(capsys, "--model", str(tmp_path), "--world", "8", "--tp", "2", "--gen-tp", "1")
    assert rc == 0 and "zero_redundancy" in out and "GB" in out


def test_plan_prices_the_engine_vocab_padding_the_trainer_uses(capsys, tmp_path):
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import default_gen_placement, train_placement
    from hybridrl.reshard.specs import build_specs
    from hybridrl.reshard.summary import summarize

    # vocab 1100: megatron pads to 1280 at tp 2 (multiple of 128 * tp), the engine to 1152; at
    # gen tp 2 the engine's second chunk starts at row 576, inside training shard 0 (rows < 640)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CFG, "vocab_size": 1100}))
    shape = load_shape(str(tmp_path))
    layout = TrainLayout(world=4, tp=2, pp=1)
    got = {}
    for pad in (None, 0, "builtin"):
        extra = {None: (), 0: ("--vocab-pad", "0"), "builtin": ("--engine", "builtin")}[pad]
        rc, out, _ = _run(capsys, "--model", str(tmp_path), "--world", "4", "--tp", "2",
                          "--gen-tp", "2", "--dtype", "fp32", "--json", *extra)
        assert rc == 0
        got[pad] = json.loads(out)["strategies"]["zero_redundancy"]
    assert got["builtin"] == got[0]  # the builtin engine pads as training does
    for pad, vocab_pad in ((None, 64), (0, None)):  # default: the trainer's ENGINE_VOCAB_PAD
        gen = default_gen_placement(layout, shape, 2, 1, vocab_pad)
        want = summarize(train_placement(layout, shape), gen, build_specs(shape),
                         "zero_redundancy", 4, 512 << 20)
        assert got[pad]["max_bytes_received_per_rank"] == max(want.recv)
    assert got[None]["max_bytes_received_per_rank"] != got[0]["max_bytes_received_per_rank"]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-9b", "--world", "8", "--gen-tp", "1"], "--model"),
    (["--model", "llama2-7b", "--world", "6", "--tp", "4", "--gen-tp", "1"], "world=6"),
    (["--model", "llama2-70b", "--world", "16", "--tp", "8", "--gen-tp", "16"], "num_query_groups=8"),
    (["--model", "llama2-7b", "--world", "8", "--gen-tp", "3"], "gen tp=3"),
    (["--model", "llama2-7b", "--world", "8", "--gen-tp", "x"], "invalid int"),
    (["--model", "llama2-7b", "--world", "8", "--gen-tp", "1", "--gbps", "0"], "--gbps"),
    (["--model", "llama2-7b", "--world", "8", "--gen-tp", "1", "--vocab-pad", "-1"], "--vocab-pad"),
])
def test_plan_bad_args_exit_2_one_line(capsys, argv, needle):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("change, needle", [
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
     "architectures=['MixtralForCausalLM'] (model_type='mixtral') is not supported"),
    ({"architectures": None, "model_type": "mixtral"}, "model_type='mixtral') is not supported"),
    ({"vocab_size": None}, "config.json lacks the field 'vocab_size'"),
    ({"num_hidden_layers": "4"}, "num_hidden_layers must be an integer, got '4'"),
])
def test_plan_bad_config_json_exit_2_one_line(capsys, tmp_path, change, needle):
    cfg = {k: v for k, v in {**LLAMA_CFG, **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = _run(capsys, "--model", str(path), "--world", "8", "--gen-tp", "1")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and str(path) in err, err
    rc, out, _ = _run(capsys, "--model", str(tmp_path), "--world", "8", "--gen-tp", "1")  # folder
    assert rc == 2 and out == ""


def test_specs_presets_and_naming():
    assert abs(PRESETS["llama2-7b"].num_params() - 6.738e9) < 0.01e9
    assert abs(PRESETS["llama2-70b"].num_params() - 68.98e9) < 0.05e9
    te = [s.name for s in build_specs(PRESETS["llama2-7b"], naming="te")]
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in n for n in te)
    with pytest.raises(ValueError, match="num_query_groups=3"):
        LlamaShape(hidden=64, ffn=64, heads=8, num_query_groups=3, layers=2, vocab=10)
    qwen = LlamaShape.from_hf_config({
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
        "vocab_size": 151936, "tie_word_embeddings": True})
    assert qwen.qkv_bias and qwen.tied
    names = [s.name for s in build_specs(qwen)]
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert abs(qwen.num_params() - 494.0e6) < 0.5e6  # Qwen2.5-0.5B
    from hybridrl.config.model import ModelConfig

    mc = ModelConfig()
    s = LlamaShape.from_model(mc)
    assert (s.hidden, s.layers, s.num_query_groups, s.vocab) == (
        mc.hidden_size, mc.num_layers, mc.num_query_groups, mc.vocab_size)
    with pytest.raises(ValueError, match="naming"):
        build_specs(PRESETS["llama2-7b"], naming="hf")


def test_wired_into_hybridrl_cli(capsys):
    """``hybridrl plan`` through the top-level CLI (hybridrl/cli.py registers add_parser)."""
    from hybridrl.cli import main as hybridrl_main

    rc = hybridrl_main(["plan", "--model", "llama2-7b", "--world", "8", "--tp", "2", "--pp", "2",
                        "--gen-tp", "1", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0 and json.loads(out)["strategies"]["zero_redundancy"]["max_bytes_received_per_rank"] > 0
    rc = hybridrl_main(["plan", "--model", "llama2-7b", "--world", "8", "--tp", "3", "--gen-tp", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("hybridrl plan: error:")
