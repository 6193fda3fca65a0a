"""Turn formats of multi-turn rollouts: how a model's turn ends, how its tool calls are written,
how tool output goes back into the sequence, and the loss mask read back from the token ids.

Contract:
- A ``TurnFormat`` holds ``stop_ids`` (the ids that end a model turn: end of turn, eos, the
  plain format's call marker), ``resume_ids`` (the tokens every inserted segment ends with, that
  hand the turn back to the model: the chat template's generation prompt), ``parse_calls(text)``
  -> a list of ``ToolCall`` (empty: the turn is an answer) and ``segment_ids(texts)`` -> the ids
  inserted after a turn for its tool outputs (template tokens, the outputs, ``resume_ids``).
  Tool output is cleaned first (``clean``): the template's special/added token strings and the
  plain format's resume text are removed, so no inserted segment contains ``resume_ids``
  before its end and a tool cannot speak as the model.
- ``loss_mask(fmt, ids, mask)`` ([N, R] -> [N, R]): 1 on the model's own tokens of each
  response tail, found from the ids alone: the tail starts in a model turn; a stop id (kept:
  the model sampled it) ends the turn; the next model turn starts after the next complete
  ``resume_ids``. This holds for every tail ``hybridrl.rollout.multi_turn.loop`` builds (a turn
  cut by a budget ends the sequence), so the mask needs no transport of its own: any rank that
  holds a row's ids derives it (tests: a property test against the loop's own record).
- Formats (``build_format(name, tokenizer, tools)``; ``auto``: ``plain`` for the builtin
  character tokenizer, else from the chat template: ``hermes`` when it mentions ``<tool_call>``,
  ``llama3_json`` when it mentions ``ipython``):
  - ``plain`` (any tokenizer; the demo's): a call is ``<NAME ARG>``, ``>`` the stop id; ARG is
    the text of the tool's only required string argument, or a JSON object of arguments; the
    output comes back as ``"\\ntool: <output>\\nassistant: "``. ARG cannot contain ``>``.
  - ``hermes`` (Qwen2.5 / Qwen3): ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
    blocks in a turn that ends with the template's end of turn; outputs rendered by the
    tokenizer's own template as ``role: tool`` messages (``<tool_response>`` blocks).
  - ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the turn's text is one JSON object
    ``{"name": .., "parameters": {..}}`` (after an optional ``<|python_tag|>``); outputs
    rendered by the template as ``ipython`` messages.
"""

from __future__ import annotations

import dataclasses
import json
import re

import torch

FORMATS = ("auto", "plain", "hermes", "llama3_json")
PLAIN_RESUME = "\nassistant: "
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: object  # a dict when it parsed; else the problem as a string (an error result)
    problem: str | None = None


class TurnFormat:
    """Base: ``stop_ids``, ``resume_ids``, ``parse_calls``, ``segment_ids`` (module docstring)."""

    name = "base"

    def __init__(self, tokenizer, stop_ids, resume_ids, specials=()):
        self.tokenizer = tokenizer
        self.stop_ids = tuple(int(t) for t in stop_ids)
        self.resume_ids = tuple(int(t) for t in resume_ids)
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)
        if not self.resume_ids:
            raise ValueError(f"multi-turn format {self.name}: empty resume tokens")

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def clean(self, text: str) -> str:
        for s in self._specials:
            text = text.replace(s, "")
        return text

    def parse_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def segment_ids(self, outputs: list[str]) -> list[int]:
        raise NotImplementedError


class PlainFormat(TurnFormat):
    """``<NAME ARG>`` calls, ``\\ntool: ..\\nassistant: `` outputs (module docstring)."""

    name = "plain"

    def __init__(self, tokenizer, tools: dict):
        self.tools = tools  # name -> JSON schema of its parameters
        close = tokenizer.encode(">", add_special_tokens=False)
        if len(close) != 1:
            raise ValueError("multi-turn format plain: the tokenizer must encode '>' as one token")
        eos = getattr(tokenizer, "eos_token_id", None)
        super().__init__(tokenizer, close + ([eos] if eos is not None else []),
                         tokenizer.encode(PLAIN_RESUME, add_special_tokens=False),
                         specials=("assistant:",))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def parse_calls(self, text: str) -> list[ToolCall]:
        if not text.endswith(">"):
            return []
        start = text.rfind("<")
        if start < 0:
            return [ToolCall("", None, "a call is <NAME ARG>")]
        name, _, arg = text[start + 1:-1].strip().partition(" ")
        params = self.tools.get(name)
        if params is None:
            return [ToolCall(name, None, f"no tool named {name[:40]!r}; tools: "
                                         f"{', '.join(sorted(self.tools))}")]
        arg = arg.strip()
        if arg.startswith("{"):
            try:
                return [ToolCall(name, json.loads(arg))]
            except ValueError as err:
                return [ToolCall(name, None, f"arguments are not JSON ({err})")]
        required = params.get("required", [])
        if len(required) != 1:
            return [ToolCall(name, None, "this tool takes a JSON object of arguments")]
        return [ToolCall(name, {required[0]: arg})]

    def segment_ids(self, outputs: list[str]) -> list[int]:
        body = " | ".join(self.clean(o).strip() for o in outputs)
        enc = self.tokenizer.encode
        return enc("\ntool: " + body, add_special_tokens=False) + list(self.resume_ids)


class TemplateFormat(TurnFormat):
    """A tokenizer's chat template with tool messages (``hermes`` / ``llama3_json``)."""

    def __init__(self, tokenizer, tools: list[dict], name: str):
        self.name, self.tool_schemas = name, tools
        enc = tokenizer.encode
        probe = "Zq7"
        user = [{"role": "user", "content": "u"}]
        turn = self._render(tokenizer, [*user, {"role": "assistant", "content": probe}], False)
        head = self._render(tokenizer, user, False)
        gen = self._render(tokenizer, user, True)
        if not gen.startswith(head) or probe not in turn:
            raise ValueError(f"multi-turn format {name}: the chat template does not render a "
                             "generation prompt as an append")
        self.resume_text = gen[len(head):]
        after = enc(turn[turn.index(probe) + len(probe):], add_special_tokens=False)
        if not after:
            raise ValueError(f"multi-turn format {name}: the template ends no assistant turn")
        self.end_text = tokenizer.decode(after[:1], skip_special_tokens=False)
        stops = [after[0]] + [t for t in (getattr(tokenizer, "eos_token_id", None),)
                              if t is not None]
        eom = tokenizer.convert_tokens_to_ids("<|eom_id|>") if name == "llama3_json" else None
        if isinstance(eom, int) and eom != getattr(tokenizer, "unk_token_id", None):
            stops.append(eom)
        self._turn = turn[:turn.index(probe) + len(probe)] + self.end_text
        specials = list(getattr(tokenizer, "all_special_tokens", []))
        specials += [str(t) for t in getattr(tokenizer, "get_added_vocab", dict)()]
        super().__init__(tokenizer, dict.fromkeys(stops),
                         enc(self.resume_text, add_special_tokens=False), specials)
        self._base = [*user, {"role": "assistant", "content": probe}]

    def _render(self, tokenizer, messages, gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=self.tool_schemas or None,
                                             add_generation_prompt=gen, tokenize=False)

    def parse_calls(self, text: str) -> list[ToolCall]:
        if self.name == "hermes":
            return [_json_call(body, "arguments") for body in _HERMES.findall(text)]
        body = text.replace("<|python_tag|>", "").strip()
        for end in (self.end_text, "<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        return [_json_call(body, "parameters")] if body.startswith("{") else []

    def segment_ids(self, outputs: list[str]) -> list[int]:
        msgs = [{"role": "tool", "content": self.clean(o)} for o in outputs]
        full = self._render(self.tokenizer, [*self._base, *msgs], True)
        if not full.startswith(self._turn) or not full.endswith(self.resume_text):
            raise ValueError(f"multi-turn format {self.name}: the chat template does not render "
                             "tool messages as an append after the assistant turn")
        middle = full[len(self._turn):len(full) - len(self.resume_text)]
        return self.tokenizer.encode(middle, add_special_tokens=False) + list(self.resume_ids)


def _json_call(body: str, key: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as err:
        return ToolCall("", None, f"the tool call is not JSON ({err})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", None, 'a tool call is {"name": .., "' + key + '": {..}}')
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(obj["name"], None, "arguments are not JSON")
    return ToolCall(obj["name"], args)


def build_format(name: str, tokenizer, tool_schemas: list[dict]) -> TurnFormat:
    """The format ``name`` for this tokenizer and these tools (module docstring)."""
    if name not in FORMATS:
        raise ValueError(f"rollout.multi_turn.format={name!r}; allowed: {', '.join(FORMATS)}")
    template = getattr(tokenizer, "chat_template", None)
    hf = isinstance(template, str) and template not in ("", "simple")
    if name == "auto":
        name = "plain" if not hf else ("hermes" if "<tool_call>" in template
                                       else "llama3_json" if "ipython" in template else "")
        if not name:
            raise ValueError("rollout.multi_turn.format=auto: the tokenizer's chat template has "
                             "no tool format hybridrl knows (hermes, llama3_json); set plain")
    if name == "plain":
        return PlainFormat(tokenizer, {t["function"]["name"]: t["function"]["parameters"]
                                       for t in tool_schemas})
    if not hf:
        raise ValueError(f"rollout.multi_turn.format={name} needs a tokenizer with a chat "
                         "template; the builtin character tokenizer uses plain")
    return TemplateFormat(tokenizer, tool_schemas, name)


def loss_mask(fmt: TurnFormat, ids_NR: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    """The model's tokens of each tail, from the ids (module docstring). [N, R] int64.

    Vectorized: the stop positions and the positions where ``resume_ids`` end are found for
    all rows at once; each row then alternates between them (a few events per row)."""
    N, R = ids_NR.shape
    out = torch.zeros(N, R, dtype=torch.long)
    if R == 0:
        return out
    lens = mask_NR.sum(-1).tolist()
    is_stop = torch.isin(ids_NR, torch.tensor(fmt.stop_ids, dtype=ids_NR.dtype))  # [N, R]
    k = len(fmt.resume_ids)
    ends = torch.zeros(N, R, dtype=torch.bool)  # a complete resume sequence ends here
    if R >= k:
        windows = ids_NR.unfold(1, k, 1)  # [N, R - k + 1, k]
        ends[:, k - 1:] = (windows == torch.tensor(fmt.resume_ids, dtype=ids_NR.dtype)).all(-1)
    for i in range(N):
        n = int(lens[i])
        stops = torch.nonzero(is_stop[i, :n]).flatten().tolist()
        resumes = torch.nonzero(ends[i, :n]).flatten().tolist()
        pos, si, ri = 0, 0, 0
        while pos < n:
            while si < len(stops) and stops[si] < pos:
                si += 1
            stop = stops[si] if si < len(stops) else n - 1
            out[i, pos:stop + 1] = 1  # a model turn, its stop included
            while ri < len(resumes) and resumes[ri] < stop + k:  # the resume must follow it
                ri += 1
            if ri >= len(resumes):
                break
            pos = resumes[ri] + 1
    return out
