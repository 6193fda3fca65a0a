"""hybridrl: KL-regularized PPO/GRPO for LLMs on a Megatron-style 3D-parallel layout.

The package is import-light: importing ``hybridrl`` pulls in neither torch.distributed groups nor
megatron-core nor any GPU extra; each subpackage imports what it needs.
"""

__version__ = "0.1.0"
