"""The SGLang adapter against the installed, pinned SGLang release: version pins and, parsed from
its source, the per-rank parameter table in this one process.

Checks: the version pins (installed == TEST_PIN, its torch pin == TORCH_PIN == the Makefile's,
setup.py's gpu range == SUPPORTED, the one-line refusal of other pairs); the per-rank parameter
table (``engine_param_shapes``) and the reshard's engine format equal SGLang's Llama / Qwen2
parameters at tp 1, 2 and 4 (module tree from models/*.py, per-rank sizes by executing the
release's own split arithmetic). Parsing stays only here, where an import would need a process
group per TP size; the Engine API, request/server/sampling fields, the fake's signatures and the
direct loader are checked on SGLang's imported modules (tests/unit/test_sglang_real.py,
tests/distributed/test_sglang_real.py, which also builds the real models at tp 1, 2, 4).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from importlib import metadata

import pytest
import torch

from hybridrl.reshard.executor import run_plan_local, train_sources
from hybridrl.reshard.formats import engine_format
from hybridrl.reshard.placement import gen_placement, train_placement
from hybridrl.reshard.planner import plan_reshard
from hybridrl.reshard.specs import LlamaShape, build_specs
from hybridrl.rollout.sglang import compat
from hybridrl.rollout.sglang.layout import engine_param_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _srt(*parts) -> str:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    assert spec is not None, "make .venv installs sglang==TEST_PIN with --no-deps"
    return os.path.join(os.path.dirname(spec.origin), "srt", *parts)


def _tree(*parts) -> ast.Module:
    with open(_srt(*parts), encoding="utf-8") as f:
        return ast.parse(f.read())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str):
    return next(f for f in cls.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name)


# ------------------------------------------------------------------ versions


def test_installed_release_is_the_pin_and_pins_our_torch():
    assert metadata.version("sglang") == compat.TEST_PIN
    requires = metadata.requires("sglang")
    assert f"torch=={compat.TORCH_PIN}" in requires, [r for r in requires if "torch" in r]
    low, high = (compat.version_tuple(v) for v in compat.SUPPORTED)
    assert low <= compat.version_tuple(compat.TEST_PIN) < high
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert f"pip install -q torch=={compat.TORCH_PIN}" in makefile
    assert f"pip install -q --no-deps sglang=={compat.TEST_PIN}" in makefile
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert f'"sglang>={compat.SUPPORTED[0]},<{compat.SUPPORTED[1]}"' in setup


def test_unsupported_pairs_fail_in_one_line_naming_both_versions():
    compat.check_versions("0.5.21", "2.13.0+cu130")
    compat.check_versions("0.5.18", "2.13.0")
    for sg, th in (("0.5.22", "2.14.1"), ("0.5.21", "2.14.1"), ("0.5.17", "2.13.0")):
        with pytest.raises(ImportError) as err:
            compat.check_versions(sg, th)
        msg = str(err.value)
        assert "\n" not in msg and f"sglang {sg}" in msg and f"torch {th}" in msg
    assert not compat.has_weight_update_session("0.5.20")
    assert compat.has_weight_update_session("0.5.21")


# ------------------------------------------------------------------ parameters per TP rank


def _ctors(cls: ast.ClassDef) -> dict[str, str]:
    """attr -> constructor name (or source) of ``self.attr = ...`` in the class's __init__."""
    out = {}
    for node in ast.walk(_method(cls, "__init__")):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    v = node.value
                    name = ast.unparse(v.func) if isinstance(v, ast.Call) else ast.unparse(v)
                    out.setdefault(t.attr, set()).add(name)
    return out


MODULES = {  # attr, SGLang layer, parameter names (all models have these; qkv bias varies)
    "Attention": {"qkv_proj": "QKVParallelLinear", "o_proj": "RowParallelLinear"},
    "MLP": {"gate_up_proj": "MergedColumnParallelLinear", "down_proj": "RowParallelLinear"},
    "DecoderLayer": {"input_layernorm": "RMSNorm", "post_attention_layernorm": "RMSNorm"},
    "Model": {"embed_tokens": "VocabParallelEmbedding", "norm": "RMSNorm"},
    "ForCausalLM": {"lm_head": "ParallelLMHead"},
}


def _split_rules():
    """SGLang's own per-rank arithmetic, executed from its source: qkv rows(tp, heads, kv, hd),
    merged rows(sizes, tp), row-parallel cols(size, tp), vocab rows(V, tp)."""
    lin = _tree("layers", "linear.py")
    ns: dict = {}
    for fn in ("divide", "ensure_divisibility"):
        src = _find_function(fn)
        exec(compile(ast.Module([src], []), "sglang-source", "exec"), ns)  # noqa: S102
    qkv = _method(_class(lin, "QKVParallelLinear"), "__init__").body
    first = next(i for i, s in enumerate(qkv) if "self.num_heads = " in ast.unparse(s))
    last = next(i for i, s in enumerate(qkv) if ast.unparse(s).startswith("self.output_sizes ="))
    block = ast.Module(qkv[first:last + 1], [])
    col = ast.unparse(_method(_class(lin, "ColumnParallelLinear"), "__init__"))
    assert "divide(output_size, tp_size) for output_size in self.output_sizes" in col
    row = ast.unparse(_method(_class(lin, "RowParallelLinear"), "__init__"))
    assert "self.input_size_per_partition = divide(input_size, self.tp_size)" in row
    vpe = _tree("layers", "vocab_parallel_embedding.py")
    for node in vpe.body:
        if (isinstance(node, ast.FunctionDef) and node.name == "pad_vocab_size") or (
                isinstance(node, ast.Assign) and "DEFAULT_VOCAB_PADDING_SIZE" in ast.unparse(node)):
            exec(compile(ast.Module([node], []), "sglang-source", "exec"), ns)  # noqa: S102

    def qkv_rows(tp, heads, kv, hd):
        self = type("S", (), {})()
        self.total_num_heads, self.total_num_kv_heads = heads, kv
        self.head_size = self.v_head_size = hd
        self.hidden_size = 1  # only used for input_size, not the rows
        scope = dict(ns, self=self, tp_size=tp, kv_tp_size=tp)
        exec(compile(block, "sglang-source", "exec"), scope)  # noqa: S102
        return sum(ns["divide"](o, tp) for o in self.output_sizes)

    def vocab_rows(vocab, tp):
        return ns["divide"](ns["pad_vocab_size"](vocab, ns["DEFAULT_VOCAB_PADDING_SIZE"]), tp)

    return qkv_rows, (lambda sizes, tp: sum(ns["divide"](s, tp) for s in sizes)), \
        (lambda size, tp: ns["divide"](size, tp)), vocab_rows


def _find_function(name: str) -> ast.FunctionDef:
    for folder, _, files in os.walk(_srt("utils")):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, f), encoding="utf-8").read())
                for node in tree.body:
                    if isinstance(node, ast.FunctionDef) and node.name == name:
                        return node
    for f in ("distributed/utils.py", "layers/utils.py"):
        path = _srt(*f.split("/"))
        if os.path.exists(path):
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return node
    raise AssertionError(f"{name} not found in SGLang's source")


def _sglang_table(arch: str, shape: LlamaShape, tp: int) -> dict[str, tuple[int, ...]]:
    """Per-rank parameters of SGLang's ``{arch}ForCausalLM`` from its source."""
    tree = _tree("models", f"{arch.lower()}.py")
    for suffix, attrs in MODULES.items():
        ctors = _ctors(_class(tree, arch + suffix))
        for attr, layer in attrs.items():
            assert layer in ctors.get(attr, set()), (arch + suffix, attr, ctors.get(attr))
    tied_src = ast.unparse(_method(_class(tree, arch + "ForCausalLM"), "__init__"))
    assert "self.lm_head = self.model.embed_tokens" in tied_src  # tied: no lm_head parameter
    qkv_call = next(n for n in ast.walk(_class(tree, arch + "Attention"))
                    if isinstance(n, ast.Call) and ast.unparse(n.func) == "QKVParallelLinear")
    bias = next((ast.unparse(k.value) for k in qkv_call.keywords if k.arg == "bias"), "True")
    has_bias = bias == "True"  # Qwen2: bias=True; Llama: bias=<config attention_bias>
    assert has_bias == (arch == "Qwen2"), bias
    qkv_rows, merged_rows, row_cols, vocab_rows = _split_rules()
    H, hd = shape.hidden, shape.head_dim
    qkv = qkv_rows(tp, shape.heads, shape.num_query_groups, hd)
    table = {"model.embed_tokens.weight": (vocab_rows(shape.vocab, tp), H),
             "model.norm.weight": (H,)}
    if not shape.tied:
        table["lm_head.weight"] = (vocab_rows(shape.vocab, tp), H)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        table.update({p + "input_layernorm.weight": (H,),
                      p + "post_attention_layernorm.weight": (H,),
                      p + "self_attn.qkv_proj.weight": (qkv, H),
                      p + "self_attn.o_proj.weight": (H, row_cols(shape.heads * hd, tp)),
                      p + "mlp.gate_up_proj.weight": (merged_rows([shape.ffn] * 2, tp), H),
                      p + "mlp.down_proj.weight": (H, row_cols(shape.ffn, tp))})
        if has_bias:
            table[p + "self_attn.qkv_proj.bias"] = (qkv,)
    return table


def _reshard_engine_shapes(shape: LlamaShape, tp: int) -> list[dict[str, tuple[int, ...]]]:
    """Names and shapes the reshard's engine format delivers to each gen TP rank."""
    from hybridrl.parallel.layout import TrainLayout
    from tests.unit.test_reshard_oracle import make_hf, megatron_shards

    layout = TrainLayout(tp, tp=tp)
    train = train_placement(layout, shape)
    gen = gen_placement(layout, shape, tp, 1, "hybridflow", vocab_pad=64)
    plan = plan_reshard(train, gen, build_specs(shape), "zero_redundancy", 1.0, 4)
    hf = make_hf(shape, seed=1)
    sources = [train_sources(plan, r, megatron_shards(shape, hf, tp, r, 1, 0, train.vocab_chunk))
               for r in range(tp)]
    from hybridrl.reshard.assemble import Assembler

    asms = [Assembler(plan, r, engine_format(shape, gen, r)) for r in range(tp)]
    run_plan_local(plan, sources, asms)
    return [{n: tuple(t.shape) for n, t in a.result().items()} for a in asms]


SHAPES = {
    "Llama": LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=4, layers=2, vocab=1000),
    "Llama-tied": LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=8, layers=2, vocab=515,
                             tied=True),
    "Qwen2": LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=4, layers=2, vocab=1001,
                        qkv_bias=True),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_engine_format_equals_sglang_parameters(model, tp):
    shape = SHAPES[model]
    want = _sglang_table(model.split("-")[0], shape, tp)
    assert engine_param_shapes(shape, tp) == want
    for rank_table in _reshard_engine_shapes(shape, tp):
        assert rank_table == want
    with pytest.raises(ValueError, match="num_key_value_heads"):
        engine_param_shapes(LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=2,
                                       layers=1, vocab=100), 4)
    assert torch.Size(want["model.embed_tokens.weight"]) == torch.Size(
        (-(-shape.vocab // 64) * 64 // tp, shape.hidden))
