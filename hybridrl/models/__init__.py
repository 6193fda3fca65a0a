"""megatron-core actor, critic and reference for llama-family models (and Qwen3-MoE with expert
parallelism), sharded over hybridrl groups.

Public surface (each module's docstring states its contract):
- spec: ``LlamaSpec``, ``read_hf_spec``, ``check_layout``, ``padded_vocab_size``,
  ``to_transformer_config`` (model config -> megatron TransformerConfig).
- build: ``build_model`` / ``build_actor`` / ``build_critic`` / ``build_reference`` -> ``ShardedModel``.
- naming: ``named_local_parameters`` (canonical name with global layer and expert index, local
  tensor) for the reshard and checkpoints; ``expert_index``.
- vocab_parallel: per-token log-probs and entropy without gathering the vocabulary.
- forward: ``run_microbatches`` (megatron pipeline schedule, loss callback), ``model_outputs``.
- train_step: ``OptimConfig``, ``lr_at``, ``ModelOptimizer``, ``train_step``.
- hf_io: ``build_from_config`` (ModelConfig -> model), ``build_from_hf``, ``load_hf_weights``,
  ``export_hf``.
- cpu_compat: the only place that knows megatron-core's CUDA assumptions (CPU runs).
Importing this package does not import megatron-core; the functions do.
"""

from hybridrl.models.spec import (
    LlamaSpec,
    check_layout,
    padded_vocab_size,
    read_hf_spec,
    to_transformer_config,
)

__all__ = [
    "LlamaSpec",
    "check_layout",
    "padded_vocab_size",
    "read_hf_spec",
    "to_transformer_config",
]
