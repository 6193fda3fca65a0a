"""SFT section: supervised warm start of the actor (``torchrun -m hybridrl.sft``).

Contract: ``SFTConfig`` holds what the SFT loop needs beyond ``model``, ``parallel`` and ``data``
(which it shares with the RL run, so both train the same network on the same layout). Pairs
come from parquet files in verl's SFT layout (``prompt_key``: a string or a chat list,
``response_key``: a string); with ``train_files`` empty and ``data.synthetic.task`` set, the
synthetic task's pairs are written to ``data.synthetic.dir``. The loss is the token mean of the
response tokens' negative log-likelihood over each global batch of ``train_batch_size``
sequences. ``output_dir`` receives the HF export of the trained actor (``<output_dir>/hf``: the
folder an RL run names in ``model.path``), ``metrics.jsonl`` and the saved config.
Batch sizes that cannot split over DP are checked by ``check_dp`` once the DP size is known.
"""

from dataclasses import dataclass

from hybridrl.config._fields import check_freq, check_non_negative, check_positive, knob


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning of the actor on (prompt, response) pairs."""

    train_files: list[str] = knob([], "SFT parquet files (verl's SFT layout); empty = the "
                                  "synthetic task's (prompt, response) pairs.")
    prompt_key: str = knob("prompt", "Column holding the prompt: a string (sent as one user "
                           "message) or a chat list of {role, content}.")
    response_key: str = knob("response", "Column holding the target response string.")
    synthetic_size: int = knob(0, "Synthetic pairs to write (the first of the task's training "
                               "prompts); 0 = all of data.synthetic.train_size.")
    synthetic_format_fraction: float = knob(1.0, "Synthetic pairs: share of responses written "
                                            "'#### <sum>' as the prompt asks; the others "
                                            "answer '<sum>' alone.")
    max_length: int = knob(128, "Longest prompt + response (+ EOS) in tokens; longer pairs fail "
                           "naming the row.")
    train_batch_size: int = knob(32, "Sequences per optimizer step, over all DP ranks.")
    micro_batch_size_per_gpu: int = knob(8, "Sequences per forward/backward on one DP rank.")
    total_steps: int = knob(50, "Optimizer steps.")
    lr: float = knob(1e-3, "AdamW learning rate (constant after warmup_steps).")
    warmup_steps: int = knob(0, "Linear warmup steps (0 = none).")
    weight_decay: float = knob(0.0, "AdamW decoupled weight decay.")
    grad_clip: float = knob(1.0, "Global gradient-norm clip (0 = none).")
    test_freq: int = knob(-1, "Greedy validation every this many steps and after the last "
                          "(-1 = only after the last).")
    output_dir: str = knob("outputs/sft", "Folder of the HF export (<output_dir>/hf), "
                           "metrics.jsonl and config.yaml.")

    def __post_init__(self) -> None:
        for name in ("max_length", "train_batch_size", "micro_batch_size_per_gpu",
                     "total_steps", "lr"):
            check_positive(f"sft.{name}", getattr(self, name))
        for name in ("synthetic_size", "warmup_steps", "weight_decay", "grad_clip"):
            check_non_negative(f"sft.{name}", getattr(self, name))
        check_freq("sft.test_freq", self.test_freq)
        if not 0.0 <= self.synthetic_format_fraction <= 1.0:
            raise ValueError("sft.synthetic_format_fraction must be in [0, 1]; got "
                             f"{self.synthetic_format_fraction!r}")
        for name in ("prompt_key", "response_key", "output_dir"):
            if not getattr(self, name):
                raise ValueError(f"sft.{name} must not be empty; got ''")

    def check_dp(self, dp: int) -> None:
        """Every DP rank takes the same number of whole micro-batches of each global batch."""
        if self.train_batch_size % dp:
            raise ValueError(f"sft.train_batch_size ({self.train_batch_size}) must be divisible "
                             f"by the DP size {dp}")
        per_rank = self.train_batch_size // dp
        if per_rank % self.micro_batch_size_per_gpu:
            raise ValueError(f"sft.micro_batch_size_per_gpu ({self.micro_batch_size_per_gpu}) "
                             f"must divide sft.train_batch_size/dp = {self.train_batch_size}/{dp}"
                             f" = {per_rank}")
