"""The offline API, shaped like vLLM's: LLM(model=DIR, **engine_args).generate(prompts, params)."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm import tqdm

from ..config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class LLM:
    """LLM(model=None, **engine_args): model is a model directory (None = the embedded default).

    engine_args are EngineConfig fields (vLLM's names); unknown ones are errors.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def close(self) -> None:
        """Shut the engine down: the disk tier (--cache-disk) gets every cached block, its worker stops."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a dict with 'prompt' or 'prompt_token_ids' (and an optional
        'cache_salt'), or a list of those. One RequestOutput per prompt, in order; n > 1 gives n outputs each."""
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # fan out n into engine requests: (prompt index, sample index) -> request id
        owners: dict[str, tuple[int, int]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                for k in range(p.n):
                    q = p.clone()
                    q.n = 1
                    if p.seed is not None:
                        q.seed = p.seed + k
                    rid = f"llm-{next(self._ids)}"
                    self.engine.add_request(rid, prompt, q)
                    owners[rid] = (i, k)
        except Exception:
            for rid in owners:
                self.engine.abort_request(rid)
            raise
        return self._run(owners, prompts, params, use_tqdm)

    def _run(self, owners, prompts, params, use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(owners), desc="generate", unit="req", disable=not use_tqdm or len(owners) < 2)
        while len(done) < len(owners):
            for out in self.engine.step():
                if out.finished and out.request_id in owners:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        while self.engine.has_background_work():  # what a server does while idle: the outputs' prefill jobs
            self.engine.step()
        results: list[RequestOutput | None] = [None] * len(prompts)
        for rid, (i, k) in sorted(owners.items(), key=lambda kv: kv[1]):
            out = done[rid]
            out.outputs[0].index = k
            if results[i] is None:
                out.request_id = str(i)
                results[i] = out
            else:
                results[i].outputs.append(out.outputs[0])
        return results  # type: ignore[return-value]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None):
        """messages: one conversation (a list of {role, content}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c, tools=tools, add_generation_prompt=True,
                                                                          **(chat_template_kwargs or {})))}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
