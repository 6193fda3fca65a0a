"""Every public reshard name has a docstring and typed parameters (issue 42 item 5).

Public: ``hybridrl.reshard.__all__`` and the torch-side names hybridrl exports from the reshard
(``Assembler``, ``run_plan``, ``train_sources``, ``engine_format``, ``hf_format``) plus what
they return (``RunStats``, ``Sources``) and ``megatron_format``. For a class: its own docstring
(not the dataclass-generated signature) and every public method / property; for a function or
method: a docstring, an annotation on every parameter and a return annotation.
"""

import inspect

import hybridrl.reshard as reshard
from hybridrl.reshard import assemble, executor, formats

TORCH_SIDE = {"Assembler": assemble.Assembler, "run_plan": executor.run_plan,
              "train_sources": executor.train_sources, "engine_format": formats.engine_format,
              "hf_format": formats.hf_format, "megatron_format": formats.megatron_format,
              "RunStats": executor.RunStats, "Sources": executor.Sources}


def _function_problems(qual, fn, need_doc=True):
    out = [] if inspect.getdoc(fn) or not need_doc else [f"{qual}: no docstring"]
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
            out.append(f"{qual}: parameter {p.name!r} has no type")
    if fn.__name__ != "__init__" and sig.return_annotation is inspect.Signature.empty:
        out.append(f"{qual}: no return type")
    return out


def _problems(name, obj):
    if not inspect.isclass(obj):
        return _function_problems(name, obj) if callable(obj) else []
    doc = obj.__doc__ or ""
    out = [] if doc and not doc.startswith(f"{obj.__name__}(") else [f"{name}: no docstring"]
    for attr, value in vars(obj).items():
        if attr.startswith("_") and attr != "__init__":
            continue
        value = value.fget if isinstance(value, property) else value
        value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if inspect.isfunction(value):
            out += _function_problems(f"{name}.{attr}", value, need_doc=attr != "__init__")
    return out


def test_every_public_reshard_name_is_documented_and_typed():
    names = {n: getattr(reshard, n) for n in reshard.__all__} | TORCH_SIDE
    problems = [p for name, obj in sorted(names.items()) for p in _problems(name, obj)]
    assert problems == []


def test_the_named_pieces_say_what_they_are():
    for method in ("recv_bytes", "sent_bytes", "dest_bytes", "transient_bytes", "peak_bytes"):
        assert "rank" in inspect.getdoc(getattr(reshard.Plan, method)), method
    assert "coords[r] = (tp_rank, pp_rank, replica)" in inspect.getdoc(reshard.Placement)
    assert "or None for a rank outside" in inspect.getdoc(reshard.Placement)
