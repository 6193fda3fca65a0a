"""The one place that makes megatron-core 0.16 run on CPU (gloo); nothing else knows about it.

Contract:
- ``install()`` is idempotent and does nothing when CUDA is available. On a CPU-only torch it
  applies the three workarounds below, each limited to the megatron modules that need it, and
  returns True. Call it before building a model or running a schedule (hybridrl.models does).
- ``cpu_model_construction()`` is a context manager used around GPTModel construction on CPU.
- ``seed_cpu_rng_tracker(seed, tp_rank)`` plays ``model_parallel_cuda_manual_seed`` on CPU.
- ``cuda_type_names()`` is a context manager used around megatron optimizer construction/steps.

What megatron-core assumes and what is patched (see docs/models.md):
1. ``torch.cuda.current_device()`` / ``device="cuda"`` to place small tensors: RoPE frequencies,
   the default causal mask, the GlobalMemoryBuffer, the pipeline schedules' token counter, the
   p2p shape/receive buffers, DDP's gradient buffers and the optimizers' flag/norm tensors. Each affected megatron module gets a *module-local* ``torch`` proxy
   (``_CpuTorch``) that maps the CUDA device to CPU and turns ``synchronize`` into a no-op; every
   other attribute is the real torch. The global ``torch`` is untouched.
2. The CUDA RNG tracker (dropout inside TP regions forks "model-parallel-rng"): replaced by a
   tracker with the same interface over CPU generator states; activation recompute's save and
   restore of the CUDA generator state (``_get/_set_cuda_rng_state``) become no-ops (megatron
   saves and restores the CPU generator state beside them).
3. ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied output weight to CUDA
   (``weight.data.cuda()``) before the first/last-stage all-reduce: during construction
   ``Tensor.cuda`` is the identity on CPU-only torch.
4. megatron's optimizers accept only parameters whose ``type()`` is 'torch.cuda.*Tensor' (and
   clip_grads asserts it): inside ``cuda_type_names()`` a CPU tensor reports its CUDA twin's name.
6. MoE (megatron's router, experts, moe_utils and alltoall token dispatcher): the same proxy,
   whose ``torch.cuda`` also hands out a program-order stream (``Stream()``,
   ``current_stream()``, ``stream(s)``, ``record_event().synchronize()``: the dispatcher's
   device-to-host copies of its split sizes run on a side stream on GPU; on CPU the sizes are
   already host tensors). gloo runs the dispatcher's ``all_to_all_single`` with uneven splits,
   given as lists: megatron's ``maybe_move_tensor_to_cpu`` turns split sizes into numpy only
   when they were on the GPU, so the dispatcher's copy of it (``_host_splits``) also does it
   for host tensors asked ``as_numpy``. With tp > 1 (sequence parallel) the dispatcher gathers
   and reduce-scatters routed tokens in uneven pieces over TP: the proxy's
   ``torch.distributed`` (``_CpuDistributed``) pads them to equal pieces for gloo.
   ``moe_utils`` binds its transformer-engine functions only when TE imports, yet the router's
   gating linear reads ``te_general_gemm`` unconditionally: without TE the missing names are
   bound to None (megatron's own "not available" value), so the torch path runs.
5. Sequence parallelism: megatron's tensor-parallel layers and mappings gather / reduce-scatter
   along the sequence (first) dim with ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` into
   [s, b, h] buffers placed on ``torch.cuda.current_device()``; gloo takes 1-D tensors only. Both
   modules get the CPU proxy and flattening wrappers of the two collectives (``_flat``: a
   contiguous tensor gathered or scattered along dim 0 is the same bytes as its flat view). The
   block's final norm (``transformer_block.LayerNormImpl``, megatron's torch norm on CPU, which
   refuses sequence parallelism) becomes ``local_fused.SequenceParallelNorm``: the same torch
   norm, its weight marked ``sequence_parallel`` when the config says so.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

# megatron modules whose global ``torch`` is replaced by the CPU proxy
PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
)
SP_COLLECTIVES = ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers")
_TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                  "fused_permute_with_probs", "fused_sort_chunks_by_index",
                  "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                  "fused_unpermute", "te_general_gemm")
_CPU = torch.device("cpu")
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand")


def _cpu_device(device):
    """Map any CUDA device spec to the CPU; leave everything else alone."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return _CPU
    return device


class _CpuEvent:
    """A recorded CUDA event on CPU: everything already happened."""

    def synchronize(self):
        return None

    def wait(self, *args, **kwargs):
        return None


class _CpuStream:
    """A CUDA stream on CPU (the MoE alltoall dispatcher's device-to-host side stream): work
    runs in program order, so waiting and recording are no-ops."""

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return _CpuEvent()

    def synchronize(self):
        return None


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """``torch.cuda`` as megatron's modules see it on CPU: the current device is the CPU,
    streams and events are program order."""

    def current_device(self):
        return _CPU

    def synchronize(self, *args, **kwargs):
        return None

    def Stream(self, *args, **kwargs):  # noqa: N802 (torch's name)
        return _CPU_STREAM

    def current_stream(self, *args, **kwargs):
        return _CPU_STREAM

    def stream(self, stream):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuDistributed:
    """``torch.distributed`` as megatron's modules see it on CPU: gloo's ``all_gather`` and
    ``reduce_scatter`` of tensor lists need equal sizes, which the MoE dispatcher's sequence-
    parallel gather/scatter of routed tokens (megatron's ``_gather_along_first_dim`` /
    ``_reduce_scatter_along_first_dim`` with split sizes) does not have: uneven lists go
    through equal, zero-padded pieces. Everything else is the real ``torch.distributed``."""

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        dist = torch.distributed
        if all(t.shape == tensor.shape for t in tensor_list):
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        dist.all_gather(pieces, padded, group=group)
        for out, piece in zip(tensor_list, pieces):
            out.copy_(piece[: out.shape[0]])
        return None

    @staticmethod
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        dist = torch.distributed
        op = dist.ReduceOp.SUM if op is None else op
        if all(t.shape == output.shape for t in input_list):
            return dist.reduce_scatter(output, input_list, op=op, group=group,
                                       async_op=async_op)
        rows = max(t.shape[0] for t in input_list)
        padded = output.new_zeros((len(input_list), rows, *output.shape[1:]))
        for i, t in enumerate(input_list):
            padded[i, : t.shape[0]] = t
        dist.all_reduce(padded, op=op, group=group)
        output.copy_(padded[dist.get_rank(group), : output.shape[0]])
        return None

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class _CpuTorch:
    """Module-local stand-in for ``torch``: factory functions place "cuda" tensors on the CPU."""

    def __init__(self):
        self.cuda = _CpuCuda()
        self.distributed = _CpuDistributed()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def wrapped(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return wrapped

    def __getattr__(self, name):
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """Same interface as megatron's CudaRNGStatesTracker, over CPU generator states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng tracker: seed {seed} or state {name!r} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} was never added to the tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)  # the CPU state is saved beside it by megatron


def _ignore_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _install_rng_tracker() -> CpuRNGStatesTracker:
    from megatron.core.tensor_parallel import random as mrandom

    # activation recompute (CheckpointFunction) saves/restores the CUDA generator's state
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _ignore_cuda_rng_state

    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return mrandom._CUDA_RNG_STATE_TRACKER


def seed_cpu_rng_tracker(seed: int, tp_rank: int, ep_rank: int = 0,
                         etp_rank: int | None = None) -> None:
    """CPU twin of megatron's ``model_parallel_cuda_manual_seed`` (same seed offsets)."""
    tracker = _install_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)  # megatron's TP offset
    etp_rank = tp_rank if etp_rank is None else etp_rank
    tracker.add("expert-parallel-rng", seed + 1024 + 100 * ep_rank + etp_rank)


def install() -> bool:
    """Apply the CPU workarounds once per process; False (nothing done) when CUDA is available."""
    if torch.cuda.is_available():
        return False
    proxy = None
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            proxy = proxy or _CpuTorch()
            module.torch = proxy
    for name in SP_COLLECTIVES:  # gloo: 1-D all_gather_into_tensor / reduce_scatter_tensor
        module = importlib.import_module(name)
        if not getattr(module.dist_all_gather_func, "flat", False):
            module.dist_all_gather_func = _flat(torch.distributed.all_gather_into_tensor)
            module.dist_reduce_scatter_func = _flat(torch.distributed.reduce_scatter_tensor)
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if token_dispatcher.maybe_move_tensor_to_cpu is not _host_splits:
        token_dispatcher.maybe_move_tensor_to_cpu = _host_splits
    for name in _TE_MOE_NAMES:  # unbound without transformer-engine (see 6.)
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    from megatron.core.transformer import transformer_block

    from hybridrl.models.local_fused import SequenceParallelNorm

    transformer_block.LayerNormImpl = SequenceParallelNorm
    _install_rng_tracker()
    return True


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` for host tensors: ``as_numpy`` split sizes
    become numpy arrays, which ``all_to_all_single`` takes as its split lists."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _flat(collective):
    """``collective(output, input)`` along dim 0 on the flat views (gloo takes 1-D only)."""
    def call(output, input_, group=None, async_op=False, **kwargs):
        return collective(output.view(-1), input_.contiguous().view(-1), group=group,
                          async_op=async_op, **kwargs)

    call.flat = True
    return call


def _tensor_stays_put(self, *args, **kwargs):
    return self


@contextlib.contextmanager
def cpu_model_construction():
    """While building a model on CPU-only torch, ``Tensor.cuda`` returns the tensor itself."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = _tensor_stays_put
    try:
        yield
    finally:
        torch.Tensor.cuda = original


_REAL_TYPE = torch.Tensor.type


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _REAL_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _REAL_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def cuda_type_names():
    """While megatron's optimizer is built or stepped on CPU-only torch, ``Tensor.type()`` names
    a CPU tensor as its CUDA twin ('torch.cuda.FloatTensor'), which megatron's dtype checks want."""
    if torch.cuda.is_available():
        yield
        return
    torch.Tensor.type = _cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.type = _REAL_TYPE
