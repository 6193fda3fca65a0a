"""Data section: prompt datasets (parquet in verl's schema) or a synthetic task.

Contract: ``DataConfig`` names the parquet files and how prompts are read, truncated, batched and
shuffled. When ``train_files`` is empty the trainer generates ``synthetic.task`` instead (the CPU
demo's arithmetic task); a config with neither is rejected. ``train_batch_size`` counts prompts
per PPO step over all DP ranks (each prompt yields ``rollout.n`` responses).
"""

from dataclasses import dataclass

from hybridrl.config._fields import check_choice, check_positive, knob, section

TRUNCATIONS = ("error", "left", "drop")
SYNTHETIC_TASKS = ("none", "arithmetic")


@dataclass(frozen=True)
class SyntheticDataConfig:
    """A generated task, written as parquet in verl's schema (used when train_files is empty)."""

    task: str = knob("arithmetic", "none | arithmetic (multi-digit addition, answer after "
                     "'####').")
    max_digits: int = knob(2, "Arithmetic: operands are drawn from [0, 10**max_digits).")
    second_digits: int = knob(0, "Arithmetic: the second operand is drawn from "
                              "[0, 10**second_digits); 0 = max_digits.")
    train_size: int = knob(2048, "Number of generated training prompts.")
    val_size: int = knob(64, "Number of generated validation prompts.")
    dir: str = knob("outputs/data", "Folder the generated parquet files are written to.")

    def __post_init__(self) -> None:
        check_choice("data.synthetic.task", self.task, SYNTHETIC_TASKS)
        for name in ("max_digits", "train_size", "val_size"):
            check_positive(f"data.synthetic.{name}", getattr(self, name))
        if not 0 <= self.second_digits <= 9:
            raise ValueError(f"data.synthetic.second_digits must be in 0..9; got {self.second_digits!r}")


@dataclass(frozen=True)
class DataConfig:
    """Prompt datasets and their batching."""

    train_files: list[str] = knob([], "Training parquet files; empty = generate synthetic.task.")
    val_files: list[str] = knob([], "Validation parquet files; empty = the synthetic "
                                "task's validation prompts when train_files is empty too, else no "
                                "validation.")
    prompt_key: str = knob("prompt", "Column holding the chat-format prompt "
                           "(list of {role, content}).")
    max_prompt_length: int = knob(512, "Longest prompt in tokens (after the chat template).")
    truncation: str = knob("error", "Prompt longer than max_prompt_length: error (fail naming "
                           "the row) | left (keep its last tokens) | drop (skip it, counted).")
    train_batch_size: int = knob(64, "Prompts per PPO step, over all DP ranks.")
    val_batch_size: int = knob(64, "Prompts per validation generation batch.")
    shuffle: bool = knob(True, "Shuffle the training prompts every epoch.")
    seed: int = knob(1, "Seed of the shuffle (the position is saved with checkpoints).")
    synthetic: SyntheticDataConfig = section(SyntheticDataConfig, "Generated task used when "
                                             "train_files is empty.")

    def __post_init__(self) -> None:
        if not self.prompt_key:
            raise ValueError("data.prompt_key must name a parquet column; got ''")
        check_positive("data.max_prompt_length", self.max_prompt_length)
        check_choice("data.truncation", self.truncation, TRUNCATIONS)
        check_positive("data.train_batch_size", self.train_batch_size)
        check_positive("data.val_batch_size", self.val_batch_size)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
                -(2**63) <= self.seed < 2**63):  # the shuffle's torch generator is 64-bit
            raise ValueError(f"data.seed must be an integer in [-2**63, 2**63 - 1]; got "
                             f"{self.seed!r}")
        if not self.train_files and self.synthetic.task == "none":
            raise ValueError("data.train_files is empty and data.synthetic.task is 'none': set "
                             "data.train_files or data.synthetic.task=arithmetic")
