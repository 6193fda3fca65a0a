"""A fake ``sglang.Engine`` with the pinned release's signatures, for CPU tests of the adapter.

Contract: ``FakeEngine(**server_args)`` records every call in ``calls`` (method names in order)
and keeps, per TP rank of its engine, the tensors its "scheduler" loaded: the request's
``serialized_named_tensors[tp_rank]`` deserialized and copied by name, as SGLang's direct
loader does (``loaded[tp_rank][name]``); a name the model lacks makes the load fail. Methods
the adapter calls have exactly the signatures of ``TEST_PIN``'s ``Engine`` (checked by
tests/unit/test_sglang_contract.py); ``generate`` answers ``output_ids`` / ``meta_info
.output_token_logprobs`` derived from each request's ``sampling_seed``. ``fake_backend()``
bundles it with a pickling serializer and a request class with SGLang's field names.
``FailingEngine`` raises in ``__init__`` (a start failure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

from hybridrl.rollout.sglang.adapter import SGLangBackend
from hybridrl.rollout.sglang.compat import TEST_PIN


@dataclasses.dataclass
class FakeUpdateWeightsFromTensorReqInput:
    """Same fields as SGLang's ``UpdateWeightsFromTensorReqInput`` (the ones hybridrl sets)."""

    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True


class _FakeTokenizerManager:
    def __init__(self, engine):
        self.engine = engine

    async def flush_cache(self, timeout_s=None):
        self.engine.calls.append("flush_cache")
        self.engine.flush_timeouts.append(timeout_s)
        return self.engine.flush_answer

    async def update_weights_from_tensor(self, obj, request=None):
        eng = self.engine
        eng.calls.append("update_weights_from_tensor")
        if obj.load_format != "direct" or len(obj.serialized_named_tensors) != eng.tp_size:
            return False, f"bad request: load_format={obj.load_format!r}"
        for tp_rank, payload in enumerate(obj.serialized_named_tensors):
            for name, tensor in pickle.loads(payload):
                eng.loaded[tp_rank][name] = tensor.clone()
                eng.pushed_names.append((tp_rank, name))
        return True, "Success"


class FakeEngine:
    """See the module docstring."""

    def __init__(self, **kwargs):
        self.server_args = kwargs
        self.tp_size = kwargs["tp_size"]
        self.calls: list[str] = []
        self.loaded: list[dict] = [{} for _ in range(self.tp_size)]
        self.pushed_names: list = []
        self.requests: list = []
        self.flush_timeouts: list = []
        self.flush_answer = (True, "")  # what tokenizer_manager.flush_cache answers
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _FakeTokenizerManager(self)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                 audio_data=None, video_data=None, mm_hashes=None, mm_content_hashes=None,
                 return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                 token_ids_logprob=None, lora_path=None, custom_logit_processor=None,
                 require_reasoning=False, return_hidden_states=False,
                 return_routed_experts=False, routed_experts_start_len=0, stream=False,
                 bootstrap_host=None, bootstrap_port=None, bootstrap_room=None,
                 routed_dp_rank=None, disagg_prefill_dp_rank=None, kv_hints=None,
                 data_parallel_rank=None, external_trace_header=None, rid=None,
                 session_params=None, priority=None, session_id=None, *, cache_salt=None):
        self.calls.append("generate")
        self.requests.append((input_ids, sampling_params, return_logprob))
        outs = []
        for sp in sampling_params:
            seed = sp["sampling_seed"]
            ids = [seed % 97, seed % 89 + 1][: sp["max_new_tokens"]]
            outs.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [(-0.5 * (k + 1), t, None) for k, t in enumerate(ids)]}})
        return outs

    def flush_cache(self):
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append("begin_weight_update")
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end_weight_update")
        return True, "Success"

    def release_memory_occupation(self, tags=None):
        self.calls.append("release_memory_occupation")

    def resume_memory_occupation(self, tags=None):
        self.calls.append(f"resume_memory_occupation:{','.join(tags or ['all'])}")


class FailingEngine(FakeEngine):
    def __init__(self, **kwargs):
        raise RuntimeError("CUDA out of memory while capturing graphs\nsecond line")


def fake_backend(engine_cls=FakeEngine, version: str = TEST_PIN) -> SGLangBackend:
    return SGLangBackend(engine_cls, FakeUpdateWeightsFromTensorReqInput,
                         lambda named: pickle.dumps([(n, t.detach().cpu()) for n, t in named]),
                         version)
