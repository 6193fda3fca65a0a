"""The one model + tokenizer folder both sides of benchmarks/trl_compare.py load.

Contract:
- ``SHAPES``: the model sizes a cell may use: ``demo`` (the CPU demo's llama: 4 layers, hidden
  64, GQA 4/2, ~0.2M parameters) and ``12m`` (8 layers, hidden 384, FFN 1024, GQA 6/2, ~12.6M
  parameters: the realistic cell's).
- ``make_folder(path, shape="demo", eos_p=None)`` writes an HF llama (random weights from a
  fixed seed) and an HF tokenizer whose ids and chat template are those of hybridrl's character
  tokenizer (vocab 100, eos id 2), so both sides see the same token ids. With ``eos_p`` the
  weights are set so that a sampled token (temperature 1) is eos with probability ``eos_p`` at
  every position, whatever the context: the residual stream stays at the embedding (attention
  and MLP outputs scaled by 1e-3, every token's embedding the same vector), so the final hidden
  state is the same at every position and the eos row of the output layer gives eos the logit
  that makes its probability ``eos_p``. Response lengths are then geometric with mean ~1/eos_p,
  capped at the cell's max new tokens: the same law on both sides, as a policy's EOS-driven
  lengths spread in a real run (the compute per token is that of the full-size model: only the
  values are shaped). Returns the measured eos probability (None without ``eos_p``).
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
SHAPES = {
    "demo": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=4),
    "12m": dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                num_key_value_heads=2, num_hidden_layers=8),
}
EOS_ID = 2


def _tokenizer(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridrl.data.tokenizer import CharTokenizer

    char = CharTokenizer()
    vocab = {char.decode([i], skip_special_tokens=False) if i >= 4 else tok: i
             for i, tok in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"] + [None] * 96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                 eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = TEMPLATE
    text = "user: 3+4=\nassistant: "
    assert hf.encode(text, add_special_tokens=False) == char.encode(text), "tokenizer ids differ"
    hf.save_pretrained(path)


def _shape_eos(model, eos_p: float) -> float:
    """Set the weights so that eos has probability ``eos_p`` everywhere (module docstring)."""
    import torch

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb[5].expand_as(emb).clone())  # one vector for every token
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
        ids = torch.randint(4, 100, (8, 48), generator=torch.Generator().manual_seed(1))
        h = model.model(ids).last_hidden_state  # [8, 48, H]: ~one vector
        head = model.lm_head.weight
        head[EOS_ID] = 0.0
        others = torch.logsumexp(model.lm_head(h).float(), -1)  # eos logit 0 -> exp(0) = 1
        rest = torch.log(torch.exp(others) - 1.0).mean()  # logsumexp over the non-eos ids
        want = rest + torch.log(torch.tensor(eos_p / (1.0 - eos_p)))
        head[EOS_ID] = h.reshape(-1, h.shape[-1]).mean(0) * (want / h.pow(2).sum(-1).mean())
        p = torch.softmax(model.lm_head(h).float(), -1)[..., EOS_ID]
    return float(p.mean())


def make_folder(path: Path, shape: str = "demo", eos_p: float | None = None) -> float | None:
    """Write the shared folder (see the module docstring); the measured eos probability."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" would land in the tables
    _tokenizer(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], vocab_size=100, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=EOS_ID)
    model = LlamaForCausalLM(cfg)
    measured = None if eos_p is None else _shape_eos(model, eos_p)
    model.save_pretrained(path)
    return measured
