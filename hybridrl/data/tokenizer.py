"""Tokenizers: a builtin character-level tokenizer and HF tokenizers loaded from a local folder.

Contract. Everything the data path needs from a tokenizer is the subset of the HF API below, which
:class:`CharTokenizer` implements and ``transformers`` tokenizers already have:

    encode(text, add_special_tokens=False) -> list[int]
    decode(ids, skip_special_tokens=True) -> str
    apply_chat_template(messages, add_generation_prompt=True, tokenize=False) -> str
    chat_template (None when the tokenizer has none), pad_token_id, eos_token_id, bos_token_id,
    vocab_size (``len(tokenizer)`` for HF, which counts added tokens)

``load_tokenizer(name_or_path)`` returns the builtin tokenizer for ``"char"`` (or ``"builtin:char"``)
and otherwise ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`` (transformers
imported only then); a tokenizer without a pad token gets ``pad = eos`` as in verl.
``encode_prompt(tokenizer, messages)`` renders chat messages through the tokenizer's chat template
when it has one (with the generation prompt appended) and tokenizes the text without adding
special tokens; without a template the message contents are joined by newlines.
"""

from __future__ import annotations

import os
import string
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"


class CharTokenizer:
    """One id per character of :data:`CHARSET`, after four specials (pad 0, bos 1, eos 2, unk 3).

    Chat template (the ``"simple"`` template): every message renders as ``"{role}: {content}\\n"``;
    the generation prompt is ``"assistant: "``. Unknown characters encode to ``unk``.
    """

    chat_template = "simple"

    def __init__(self) -> None:
        self._id_to_token = list(SPECIAL_TOKENS) + list(CHARSET)
        self._token_to_id = {c: i for i, c in enumerate(self._id_to_token)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = SPECIAL_TOKENS

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self._token_to_id.get(c, self.unk_token_id) for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range; allowed: 0..{self.vocab_size - 1}")
            if skip_special_tokens and i < len(SPECIAL_TOKENS):
                continue
            out.append(self._id_to_token[i])
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **_: Any,
    ):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text


def load_tokenizer(name_or_path: str):
    """The builtin tokenizer for "char"/"builtin:char", else an HF tokenizer from a local folder."""
    if name_or_path in ("char", "builtin:char"):
        return CharTokenizer()
    if not os.path.isdir(name_or_path):
        raise ValueError(
            f"tokenizer '{name_or_path}': not a local folder; allowed: 'char' (builtin) "
            "or a folder holding an HF tokenizer (tokenizer.json / tokenizer_config.json)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is in the test extra
        raise ImportError(
            "loading an HF tokenizer needs `transformers` (pip install transformers)"
        ) from exc
    tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer '{name_or_path}': has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text the policy sees: chat template + generation prompt, or joined contents."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of :func:`render_prompt` (no special tokens added: the template has them)."""
    return list(tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False))


def vocab_size(tokenizer) -> int:
    """Number of ids the tokenizer can emit (HF: ``len(tok)`` includes added tokens)."""
    return len(tokenizer)
