"""The builtin engine's weight store: one gen TP rank's shard, kept as training-TP sub-shards.

Contract:
- ``EngineWeights(spec, tp_size, blocks=1, dtype, device)`` holds gen TP rank's tensors of a
  llama decoder (``hybridrl.rollout.builtin.EngineSpec``) by HF-style engine name. ``expected``
  maps each name to the shape of the rank's whole gen shard in the STORED layout: megatron's
  gen-layout layout (``qkv_proj`` grouped per KV head, [q heads of the group; k; v], as
  megatron's ``linear_qkv``; every other tensor as the engine format has it). Qwen3's per-head
  ``self_attn.q_norm.weight`` / ``k_norm.weight`` [hd] are replicated, like the other norms.
- Qwen3-MoE (``spec.num_experts`` E > 0): every layer's MLP is the router
  ``model.layers.L.mlp.gate.weight`` [E, H] (replicated, like a norm) and, per expert e,
  ``mlp.experts.e.gate_up_proj.weight`` [2·Fm/tp, H] = [gate; up] and ``mlp.experts.e.down_proj
  .weight`` [H, Fm/tp] (Fm = ``moe_ffn_hidden_size``): each expert's F split over gen TP as the
  dense MLP's is (SGLang's FusedMoE at ep 1 shards its experts the same way), kept in K parts
  like the dense ones.
- ``blocks`` = K >= 1: every TP-sharded tensor is kept as K separate, contiguous sub-shards,
  each laid out exactly as megatron stores that tensor on one rank of TP size ``tp_size * K``
  (the gen rank's shard is the concatenation of K such shards: consecutive KV groups of qkv,
  consecutive columns of o_proj/down_proj, [gate_k; up_k] row pairs of gate_up_proj,
  consecutive vocabulary rows of embed_tokens/lm_head). With K = train TP / gen TP every
  sub-shard IS one training rank's tensor, so a reshard into the engine receives whole training
  tensors into contiguous sub-shards and the rank's own one can be the training tensor itself:
  no copies, no temporary buffers. Norms are replicated: one part. ``parts[name]`` is the list.
- ``block_shape(name)``: one part's shape. ``buffer(name, shape, block=None)`` returns the part
  (allocated zeroed on first use, or after an alias) for a reshard to fill in place;
  ``alias(name, tensor, block=None)`` makes a part someone else's tensor (same shape, dtype,
  device; no copy). ``block`` may be omitted only for a name kept as one part. ``aliased``
  holds the aliased parts' labels (``name``, or ``name#k`` when K > 1 and the name is sharded).
- ``arrange(order, spare)`` re-allocates the listed parts in one buffer (zeroed), in that
  order, each followed by its ``spare`` elements of scratch; ``spare(view)`` says how much
  scratch follows a view (0 unless it ends an arranged part with room after it).
- ``update(named)`` loads whole gen shards in the ENGINE format ([q; k; v] for qkv), regrouping
  and splitting into parts; ``full(name)`` returns the whole stored-layout shard (a view when
  kept as one part, else a new tensor); ``missing()`` the names not loaded yet.
- Bad names or shapes raise ``ValueError`` naming the tensor and both shapes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch


class EngineWeights:
    """Stored tensors of one gen TP rank (see module docstring)."""

    def __init__(self, spec, tp_size: int = 1, blocks: int = 1, dtype=torch.float32,
                 device: str | torch.device = "cpu"):
        n = tp_size * blocks
        moe = (("moe_ffn_hidden_size", spec.moe_ffn_hidden_size),) if _experts(spec) else ()
        for field, value in (("num_attention_heads", spec.num_attention_heads),
                             ("num_kv_heads", spec.num_kv_heads),
                             ("ffn_hidden_size", spec.ffn_hidden_size), *moe):
            if value % n:
                raise ValueError(f"gen tp={tp_size} x blocks={blocks} does not divide "
                                 f"{field}={value}")
        if spec.vocab_chunk % blocks:
            raise ValueError(f"blocks={blocks} does not divide vocab_chunk={spec.vocab_chunk}")
        self.spec, self.tp_size, self.blocks = spec, tp_size, blocks
        self.dtype, self.device = dtype, torch.device(device)
        self.hq, self.hk = spec.num_attention_heads // tp_size, spec.num_kv_heads // tp_size
        self.parts: dict[str, list[torch.Tensor | None]] = {}
        self.aliased: set[str] = set()
        self.holes: dict[int, int] = {}  # end address of an arranged part -> spare elements after
        self.expected, self.split_dim = self._layout()

    def _layout(self):
        """(name -> whole stored shape, name -> dim its K parts split: 0, 1, 'gate_up' or None)."""
        s, hd = self.spec, self.spec.head_dim
        H, f = s.hidden_size, s.ffn_hidden_size // self.tp_size
        shapes = {"model.embed_tokens.weight": (s.vocab_chunk, H), "model.norm.weight": (H,),
                  "lm_head.weight": (s.vocab_chunk, H)}
        dims = {"model.embed_tokens.weight": 0, "model.norm.weight": None, "lm_head.weight": 0}
        for L in range(s.num_layers):
            p = f"model.layers.{L}."
            qkv_rows = (self.hq + 2 * self.hk) * hd
            for name, shape, dim in (("input_layernorm.weight", (H,), None),
                                     ("post_attention_layernorm.weight", (H,), None),
                                     ("self_attn.qkv_proj.weight", (qkv_rows, H), 0),
                                     ("self_attn.o_proj.weight", (H, self.hq * hd), 1),
                                     *self._mlp_layout(f)):
                shapes[p + name], dims[p + name] = shape, dim
            if s.qkv_bias:
                shapes[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
                dims[p + "self_attn.qkv_proj.bias"] = 0
            if getattr(s, "qk_norm", False):  # Qwen3: per-head norms, replicated
                for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                    shapes[p + name], dims[p + name] = (hd,), None
        return shapes, dims

    def _mlp_layout(self, f: int):
        """(suffix, stored shape, split dim) of a layer's feed-forward: the dense MLP, or a MoE
        layer's replicated router ``mlp.gate.weight`` [E, H] and every expert e's
        ``mlp.experts.e.gate_up_proj.weight`` [2·Fm/tp, H] / ``down_proj`` [H, Fm/tp] (each
        expert's F split over gen TP, like the dense MLP)."""
        s, H = self.spec, self.spec.hidden_size
        E = _experts(s)
        if not E:
            return (("mlp.gate_up_proj.weight", (2 * f, H), "gate_up"),
                    ("mlp.down_proj.weight", (H, f), 1))
        fm = s.moe_ffn_hidden_size // self.tp_size
        out = [("mlp.gate.weight", (E, H), None)]
        for e in range(E):
            out += [(f"mlp.experts.{e}.gate_up_proj.weight", (2 * fm, H), "gate_up"),
                    (f"mlp.experts.{e}.down_proj.weight", (H, fm), 1)]
        return out

    # ------------------------------------------------------------------------ shapes, labels
    def n_parts(self, name: str) -> int:
        return 1 if self.split_dim[name] is None else self.blocks

    def block_shape(self, name: str) -> tuple[int, ...]:
        shape, dim = list(self._known(name)), self.split_dim[name]
        if dim is not None:
            shape[0 if dim == "gate_up" else dim] //= self.blocks
        return tuple(shape)

    def label(self, name: str, block: int) -> str:
        return f"{name}#{block}" if self.n_parts(name) > 1 else name

    def _known(self, name: str) -> tuple[int, ...]:
        if name not in self.expected:
            raise ValueError(f"builtin engine: unknown weight {name!r}")
        return self.expected[name]

    def _block(self, name: str, shape, block: int | None) -> int:
        k = self.n_parts(name)
        if block is None:
            if k > 1:
                raise ValueError(f"builtin engine: {name} is kept as {k} parts; name the block")
            block = 0
        if not 0 <= block < k:
            raise ValueError(f"builtin engine: {name} has {k} parts, no block {block}")
        want = self.block_shape(name)
        if tuple(shape) != want:
            raise ValueError(f"builtin engine: {name} (part {block}) has shape {tuple(shape)}, "
                             f"expected {want} (gen tp={self.tp_size}, blocks={k})")
        return block

    # ------------------------------------------------------------------------ storage
    def buffer(self, name: str, shape, block: int | None = None) -> torch.Tensor:
        """The engine's own tensor for part ``block`` of ``name``, to be filled in place."""
        block = self._block(name, shape, block)
        parts = self.parts.setdefault(name, [None] * self.n_parts(name))
        label = self.label(name, block)
        if label in self.aliased or parts[block] is None:
            self.aliased.discard(label)
            parts[block] = torch.zeros(self.block_shape(name), dtype=self.dtype, device=self.device)
        return parts[block]

    def alias(self, name: str, tensor: torch.Tensor, block: int | None = None) -> None:
        """Make part ``block`` of ``name`` read ``tensor`` itself (stored layout, no copy)."""
        block = self._block(name, tensor.shape, block)
        if tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(f"builtin engine: cannot alias {name} ({tensor.dtype}, "
                             f"{tensor.device}); the engine runs {self.dtype} on {self.device}")
        parts = self.parts.setdefault(name, [None] * self.n_parts(name))
        if self.label(name, block) not in self.aliased:
            self._drop_hole(parts[block])
        parts[block] = tensor.detach()
        self.aliased.add(self.label(name, block))

    def _drop_hole(self, part: torch.Tensor | None) -> None:
        """A part leaves its arranged place: its scratch is nobody's to hand out any more."""
        if part is not None:
            self.holes.pop(part.data_ptr() + part.nbytes, None)

    def arrange(self, order: Iterable[tuple[str, int | None]], spare: Iterable[int] = ()) -> None:
        """Keep the listed parts in ONE new zeroed buffer, in this order, part i followed by
        ``spare[i]`` elements of scratch (default none: back to back), so that a reshard
        receives a run of them as one message (``hybridrl.reshard.coalesce``). Each listed
        part's previous tensor is dropped before the buffer is allocated (a sync refills it; an
        aliased one stops being aliased); parts not listed stay as they are."""
        labels: dict[tuple[str, int], int] = {}
        for (name, block), extra in itertools.zip_longest(order, spare, fillvalue=0):
            block = self._block(name, self.block_shape(name), block)
            labels.setdefault((name, block), extra)
        for name, block in labels:
            self.parts.setdefault(name, [None] * self.n_parts(name))[block] = None
            self.aliased.discard(self.label(name, block))
        shapes = [self.block_shape(name) for name, _ in labels]
        sizes = [n for shape, extra in zip(shapes, labels.values())
                 for n in (math.prod(shape), extra)]
        arena = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
        self.holes = {}
        for (name, block), shape, piece in zip(labels, shapes, arena.split(sizes)[::2]):
            self.parts[name][block] = piece.view(shape)
            if labels[(name, block)]:
                self.holes[piece.data_ptr() + piece.nbytes] = labels[(name, block)]

    def spare(self, view: torch.Tensor) -> int:
        """Elements of scratch right after ``view`` (a part ``arrange`` left room after)."""
        return self.holes.get(view.data_ptr() + view.nbytes, 0)

    def _grouped(self, qkv: torch.Tensor) -> torch.Tensor:
        """Engine-format [q; k; v] rows -> the stored layout [per KV head: its q heads; k; v]."""
        hd, rest = self.spec.head_dim, tuple(qkv.shape[1:])
        q, k, v = qkv.split([self.hq * hd, self.hk * hd, self.hk * hd])
        return torch.cat([q.reshape(self.hk, -1, *rest), k.reshape(self.hk, hd, *rest),
                          v.reshape(self.hk, hd, *rest)], dim=1).reshape(qkv.shape)

    def _split(self, name: str, whole: torch.Tensor) -> list[torch.Tensor]:
        dim, k = self.split_dim[name], self.n_parts(name)
        if k == 1:
            return [whole]
        if dim == "gate_up":  # [gate; up] -> K of [gate_k; up_k]
            pairs = whole.view(2, whole.shape[0] // 2, *whole.shape[1:]).chunk(k, dim=1)
            return [p.reshape(-1, *whole.shape[1:]) for p in pairs]
        return list(whole.chunk(k, dim=dim))

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load whole gen shards in the engine format (see the module docstring)."""
        for name, tensor in named_tensors:
            if tuple(tensor.shape) != self._known(name):
                raise ValueError(f"builtin engine: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {self.expected[name]} (gen tp={self.tp_size})")
            if ".qkv_proj." in name:
                tensor = self._grouped(tensor)
            with torch.no_grad():
                for block, part in enumerate(self._split(name, tensor)):
                    self.buffer(name, part.shape, block).copy_(part)

    def full(self, name: str) -> torch.Tensor:
        """The whole stored-layout shard of ``name``."""
        parts, dim = self.parts[name], self.split_dim[name]
        if len(parts) == 1:
            return parts[0]
        if dim == "gate_up":
            halves = [p.view(2, p.shape[0] // 2, *p.shape[1:]) for p in parts]
            return torch.cat(halves, dim=1).reshape(self.expected[name])
        return torch.cat(parts, dim=dim)

    def loaded(self, name: str) -> bool:
        return name in self.parts and all(p is not None for p in self.parts[name])

    def missing(self) -> list[str]:
        optional = {"lm_head.weight"} if self.spec.tie_word_embeddings else set()
        return sorted(n for n in self.expected if n not in optional and not self.loaded(n))


def _experts(spec) -> int:
    """Experts per layer of ``spec`` (0: dense)."""
    return int(getattr(spec, "num_experts", 0) or 0)
