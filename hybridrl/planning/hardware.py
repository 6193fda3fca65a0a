"""Hardware constants and efficiency factors of the step-time model (``hybridrl plan --time``).

Contract:
- ``GPUS``: one row per GPU kind (``h100``, ``h200``, ``a100``, ``b200``), each a ``Hardware``
  with the vendor datasheet's figures for the SXM part in an HGX/DGX node: dense BF16 tensor-core
  FLOP/s (without the 2:4 sparsity figure the datasheets print first), HBM bytes and bytes/s,
  NVLink bytes/s per GPU and direction, the node's InfiniBand bytes/s per GPU and direction, the
  host link (PCIe) bytes/s per direction, GPUs per node. Sources, one per row:
  - a100: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/
    Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 312 TFLOPS BF16
    dense, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (both directions), PCIe Gen4 64 GB/s (both
    directions); DGX A100 user guide: 8 x 200 Gb/s HDR InfiniBand (one per GPU).
  - h100: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/, SXM
    column): 1,979 TFLOPS BF16 with sparsity (989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink
    900 GB/s, PCIe Gen5 128 GB/s; DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 (NDR).
  - h200: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200/, SXM column): the H100's
    compute (989 TFLOPS BF16 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5
    128 GB/s; HGX H200 nodes carry the DGX H100 network (8 x 400 Gb/s).
  - b200: NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx/): FP16/BF16
    36 PFLOPS for 8 GPUs with sparsity, i.e. 2.25 PFLOPS dense per GPU; DGX B200 datasheet
    (nvidia.com/en-us/data-center/dgx-b200/): 1,440 GB HBM3e for 8 GPUs (180 GB each), 64 TB/s
    for 8 (8 TB/s each), fifth-generation NVLink 1.8 TB/s per GPU, PCIe Gen5 128 GB/s,
    8 x 400 Gb/s ConnectX-7.
  Datasheet "both directions" figures are halved here: a transfer uses one direction.
- ``EFFICIENCY``: the only tuned numbers of the model, four fractions of a peak, each with where
  it comes from (``EFFICIENCY_SOURCES``): ``matmul`` (achieved share of the dense peak in large
  bf16 GEMMs of training and prefill), ``hbm`` (share of the HBM peak a decode step streams),
  ``link`` (NCCL bus bandwidth over the link peak) and ``pcie`` (pinned host copies over the
  PCIe peak). ``cpu`` kinds come from ``hybridrl.planning.calibrate`` instead (measured, so
  their factors are 1.0).
- Per-call and per-token costs beyond the peaks (``Hardware`` fields): ``collective_latency_s``
  (one collective's fixed cost: 10 us for a small NCCL collective inside a node; CPU: a gloo
  all-reduce as a run meets it), ``kernel_latency_s`` (the fixed cost of one layer call per
  micro-batch: 0 on GPUs, whose kernel launches overlap the previous kernel's work; CPU:
  measured), ``train_calls``, ``optimizer_latency_s``, ``dp_step_latency_s`` (its extra at
  dp > 1), ``sample_latency_s``, ``act_passes`` and
  ``train_act_ratio`` (activation traffic per token beyond the GEMMs: 0 on GPUs, where fused
  kernels keep it inside the matmul efficiency; CPU: measured), ``cores`` (CPU: the cores the
  ranks share; 0: every rank has its own device).
- ``hardware(kind, gpu_gb=None, calibration=None)``: the row (``cpu``: from a calibration dict,
  see ``calibrate.py``); ``gpu_gb`` overrides the memory size. Unknown kinds: ValueError.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator in its node: peaks per GPU (bytes/s per direction) and latencies."""

    name: str
    flops: float  # dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bps: float
    nvlink_bps: float  # per GPU, one direction
    ib_bps: float  # per GPU, one direction (its own NIC)
    pcie_bps: float  # host <-> device, one direction
    gpus_per_node: int = 8
    collective_latency_s: float = 10e-6  # one small NCCL collective (ring, inside a node)
    kernel_latency_s: float = 0.0  # fixed cost per layer call (CPU: measured; GPU: graphs)
    train_calls: float = 3.0  # a training pass's layer-call cost over a forward's
    optimizer_latency_s: float = 0.0  # fixed cost of one optimizer step (CPU: measured)
    dp_step_latency_s: float = 0.0  # its extra fixed cost at dp > 1 (CPU: measured)
    sample_latency_s: float = 0.0  # per request per decode step (CPU engine: measured)
    # activation vectors a token reads or writes beyond the GEMMs, per layer (hidden-sized) and
    # for the head (vocab-sized), streamed at hbm_bps: unfused elementwise ops, norms, rotary,
    # softmax. CPU: measured; GPU: 0 (fused kernels, inside the matmul efficiency)
    act_passes: float = 0.0
    train_act_ratio: float = 3.0  # a training pass's activation traffic over a forward's
    cores: int = 0  # CPU: cores the ranks share (a rank past them waits its turn); 0: a device
    # per rank
    efficiency: tuple = ()  # ((name, fraction), ...); empty: EFFICIENCY

    def eff(self, name: str) -> float:
        return dict(self.efficiency or EFFICIENCY.items())[name]


GPUS = {
    "a100": Hardware("a100", flops=312 * TFLOPS, hbm_bytes=80 * GB, hbm_bps=2039 * GB,
                     nvlink_bps=300 * GB, ib_bps=200e9 / 8, pcie_bps=32 * GB),
    "h100": Hardware("h100", flops=989 * TFLOPS, hbm_bytes=80 * GB, hbm_bps=3350 * GB,
                     nvlink_bps=450 * GB, ib_bps=400e9 / 8, pcie_bps=64 * GB),
    "h200": Hardware("h200", flops=989 * TFLOPS, hbm_bytes=141 * GB, hbm_bps=4800 * GB,
                     nvlink_bps=450 * GB, ib_bps=400e9 / 8, pcie_bps=64 * GB),
    "b200": Hardware("b200", flops=2250 * TFLOPS, hbm_bytes=180 * GB, hbm_bps=8000 * GB,
                     nvlink_bps=900 * GB, ib_bps=400e9 / 8, pcie_bps=64 * GB),
}
KINDS = (*GPUS, "cpu")

EFFICIENCY = {"matmul": 0.5, "hbm": 0.7, "link": 0.8, "pcie": 0.8}
EFFICIENCY_SOURCES = {
    "matmul": "Megatron-LM (Narayanan et al., SC'21) sustains 44-52 % of the A100 peak end to "
              "end, Llama 3 (Meta, 2024) 38-43 % BF16 MFU on 16k H100s, both including "
              "communication and bubbles that this model counts apart: 0.5 for the GEMMs alone",
    "hbm": "decode attention/GEMV kernels (FlashInfer, vLLM/SGLang kernel benchmarks) stream "
           "70-80 % of the HBM peak at large batches: 0.7",
    "link": "nccl-tests on DGX H100 report about 360 of 450 GB/s bus bandwidth for large "
            "all-reduce/all-gather inside a node and ~80 % of NDR line rate across nodes: 0.8",
    "pcie": "pinned cudaMemcpyAsync reaches ~25 of 32 GB/s on Gen4 and ~50 of 64 GB/s on Gen5 "
            "(NVIDIA bandwidthTest): 0.8",
}


def hardware(kind: str, gpu_gb: float | None = None, calibration: dict | None = None) -> Hardware:
    """The ``Hardware`` of ``kind`` (see the module docstring)."""
    if kind == "cpu":
        if calibration is None:
            raise ValueError("--gpu cpu needs a calibration: run `hybridrl plan --calibrate` "
                             "on this machine first")
        c = calibration
        hw = Hardware("cpu", flops=c["flops"], hbm_bytes=c["memory_bytes"],
                      hbm_bps=c["memory_bps"], nvlink_bps=c["link_bps"], ib_bps=c["link_bps"],
                      pcie_bps=c["memory_bps"], gpus_per_node=c.get("ranks_per_node", 64),
                      collective_latency_s=c["collective_latency_s"],
                      kernel_latency_s=c["layer_latency_s"],
                      train_calls=c.get("train_calls_per_forward", 3.0),
                      optimizer_latency_s=c.get("optimizer_latency_s", 0.0),
                      dp_step_latency_s=c.get("dp_step_latency_s", 0.0),
                      sample_latency_s=c.get("sample_latency_s", 0.0),
                      act_passes=c.get("act_passes", 0.0),
                      train_act_ratio=c.get("train_act_ratio", 3.0),
                      cores=int(c.get("cores", 0)),
                      efficiency=(("matmul", 1.0), ("hbm", 1.0), ("link", 1.0), ("pcie", 1.0)))
    elif kind in GPUS:
        hw = GPUS[kind]
    else:
        raise ValueError(f"--gpu must be one of {', '.join(KINDS)}, got {kind!r}")
    if gpu_gb is not None:
        if not gpu_gb > 0:
            raise ValueError(f"--gpu-gb must be > 0, got {gpu_gb}")
        hw = dataclasses.replace(hw, hbm_bytes=gpu_gb * GB)
    return hw
