"""Builtin char tokenizer and HF tokenizers loaded from a local folder (built here, no hub)."""

import pytest

from hybridrl.data.tokenizer import (
    CHARSET,
    CharTokenizer,
    encode_prompt,
    load_tokenizer,
    render_prompt,
    vocab_size,
)


def test_char_tokenizer_ids_and_round_trip():
    tok = CharTokenizer()
    # 4 specials (pad 0, bos 1, eos 2, unk 3), then CHARSET in order: digits first
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert vocab_size(tok) == 4 + len(CHARSET)
    assert tok.encode("10+2") == [4 + 1, 4 + 0, 4 + CHARSET.index("+"), 4 + 2]
    assert tok.encode("a", add_special_tokens=True) == [1, 4 + CHARSET.index("a")]
    text = "What is 12 + 30?\n#### 42"
    assert tok.decode(tok.encode(text)) == text
    # specials are skipped unless asked for; unknown characters map to unk (3)
    assert tok.decode([1, 4 + 7, 2, 0]) == "7"
    assert tok.decode([4 + 7, 2], skip_special_tokens=False) == "7<eos>"
    assert tok.encode("é") == [3]
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([vocab_size(tok)])


def test_char_chat_template():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1"}]
    assert render_prompt(tok, msgs) == "system: add\nuser: 1+1\nassistant: "
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "system: add\nuser: 1+1\n"
    assert encode_prompt(tok, msgs) == tok.encode("system: add\nuser: 1+1\nassistant: ")


def _save_hf_tokenizer(folder, chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<user>", "<assistant>", "what", "is", "1", "+", "2", "?"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    if chat_template:
        hf.chat_template = chat_template
    hf.save_pretrained(str(folder))
    return str(folder)


def test_hf_tokenizer_from_local_folder_uses_its_chat_template(tmp_path):
    template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    tok = load_tokenizer(_save_hf_tokenizer(tmp_path / "tok", template))
    assert tok.pad_token_id == tok.eos_token_id == 1  # no pad token -> eos, as verl does
    msgs = [{"role": "user", "content": "what is 1 + 2 ?"}]
    # "<user> what is 1 + 2 ? <assistant> " -> word ids in the vocab order above
    assert encode_prompt(tok, msgs) == [2, 4, 5, 6, 7, 8, 9, 3]


def test_hf_tokenizer_without_template_joins_contents(tmp_path):
    tok = load_tokenizer(_save_hf_tokenizer(tmp_path / "plain", None))
    msgs = [{"role": "user", "content": "what is"}, {"role": "user", "content": "2 ?"}]
    assert render_prompt(tok, msgs) == "what is\n2 ?"
    assert encode_prompt(tok, msgs) == [4, 5, 8, 9]


def test_load_tokenizer_rejects_non_folder(tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    with pytest.raises(ValueError, match="not a local folder"):
        load_tokenizer(str(tmp_path / "nope"))
