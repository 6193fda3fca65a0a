"""``hybridrl export``: a checkpoint folder -> a transformers-loadable HF folder (one process).

Contract:
- ``export_checkpoint(ckpt, role, out, dtype=None)`` reads ``meta.json`` / ``index.json`` of a
  complete ``global_step_<N>`` folder (files checked against their size and CRC-32), puts each
  parameter of ``role`` (``actor`` | ``critic``) together from every rank's fp32 main-parameter
  ranges (``hybridrl.checkpoint.shards``; any layout), converts them to HF tensors
  (``hybridrl.models.hf_io.hf_tensors_from_full``: vocab padding dropped, q/k/v and gate/up
  split) and writes ``out/config.json`` (the critic as ``*ForTokenClassification`` with one
  label), ``out/model.safetensors`` in ``dtype`` (``fp32`` | ``bf16`` | ``fp16``; default: the
  run's model dtype) and the tokenizer files of the run's tokenizer folder when it had one.
  Returns the number of tensors written; every problem is one ``ValueError``.
- ``add_parser(sub)`` registers the subcommand on ``hybridrl``'s command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hybridrl.checkpoint import folder as ck
from hybridrl.checkpoint.shards import PARAM, _PieceReader
from hybridrl.models.hf_io import hf_tensors_from_full
from hybridrl.models.spec import DTYPES, LlamaSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


def export_checkpoint(ckpt: str | Path, role: str, out: str | Path,
                      dtype: str | None = None) -> int:
    from safetensors.torch import save_file

    ckpt, out = Path(ckpt), Path(out)
    if not (ckpt / ck.COMPLETE).is_file():
        raise ValueError(f"{str(ckpt)!r} is not a complete checkpoint folder (no "
                         f"{ck.COMPLETE}); pass a global_step_<N> folder")
    meta, index = ck.read_json(ckpt, ck.META), ck.read_json(ckpt, ck.INDEX)
    roles = meta.get("roles", {})
    if role not in roles:
        raise ValueError(f"--role {role}: the checkpoint holds {sorted(roles)}")
    hf_config = dict(roles[role])
    dtype = dtype or {v: k for k, v in (("fp32", "float32"), ("bf16", "bfloat16"),
                                        ("fp16", "float16"))}.get(hf_config.get("torch_dtype"),
                                                                  "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: allowed {sorted(DTYPES)}")
    spec = LlamaSpec.from_hf_config(hf_config)
    files: dict[str, dict] = {}

    def open_file(name: str) -> dict:
        if name not in files:
            files[name] = ck.read_file(ckpt, name, index["files"][name])["models"][role]
        return files[name]

    pieces = index["models"][role]
    reader = _PieceReader(pieces, open_file, spec, role, PARAM)
    tensors = {}
    for name in pieces:
        tensors.update(hf_tensors_from_full(name, reader._shards(name, pieces[name]), spec, role))
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in sorted(tensors.items())}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    if role == "critic":
        hf_config.update(architectures=[hf_config["architectures"][0].replace(
            "ForCausalLM", "ForTokenClassification")], num_labels=1)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    tok = Path(meta.get("tokenizer") or "")
    if meta.get("tokenizer") and tok.is_dir():
        for name in TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copy2(tok / name, out / name)
    return len(tensors)


def _cmd_export(args) -> int:
    n = export_checkpoint(args.checkpoint, args.role, args.out, args.dtype)
    print(f"hybridrl export: {n} tensors of the {args.role} -> {args.out}")
    return 0


def add_parser(sub) -> None:
    cmd = sub.add_parser("export", help="a checkpoint's actor or critic as an HF folder")
    cmd.add_argument("checkpoint", help="a complete global_step_<N> folder")
    cmd.add_argument("--role", choices=["actor", "critic"], default="actor")
    cmd.add_argument("--out", required=True, help="HF folder to write")
    cmd.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="tensor dtype (default: the run's model dtype)")
    cmd.set_defaults(func=_cmd_export)
