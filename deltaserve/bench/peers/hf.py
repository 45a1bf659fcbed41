"""transformers peer: AutoModelForCausalLM from the same checkpoint directory, bf16, with whatever
kernels transformers finds (on this CPU: its pure-torch fallbacks for the gated delta rule and the
causal conv1d), greedy `generate` over a static batch of equal-length prompts (no padding)."""
from __future__ import annotations

import time

from . import PeerUnavailable


class TransformersPeer:
    name = "transformers"

    def __init__(self, model_dir: str, dtype: str = "bfloat16"):
        try:
            import torch
            import transformers
            from transformers import AutoModelForCausalLM
        except Exception as e:
            raise PeerUnavailable(f"transformers not importable: {e}") from e
        import logging

        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        except Exception as e:
            raise PeerUnavailable(f"transformers {transformers.__version__} cannot load the checkpoint: "
                                  f"{type(e).__name__}: {e}"[:300]) from e
        self.torch = torch
        self.info = {"transformers": transformers.__version__}

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, stamps: list[float] | None = None):
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)

        class _Stamp:  # a LogitsProcessor: called once per generated token, after that token's forward
            def __call__(self, input_ids, scores):
                if stamps is not None:
                    stamps.append(time.perf_counter())
                return scores

        from transformers import LogitsProcessorList  # transformers: only the transformers arm pays its import

        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                      logits_processor=LogitsProcessorList([_Stamp()]), pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + max_new_tokens, out.shape
        return out

    def prefill(self, prompts: list[list[int]]) -> tuple[float, int]:
        t = time.perf_counter()
        self._generate(prompts, 1)
        return time.perf_counter() - t, sum(len(p) for p in prompts)

    def decode(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("transformers peer: a static batch needs equal-length prompts")
        stamps: list[float] = []
        self._generate(prompts, max_tokens, stamps)
        # stamps[0]: after the prefill forward (first token); stamps[-1]: after the last decode forward
        return stamps[-1] - stamps[0], len(prompts) * (len(stamps) - 1)

    def timed(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float, int]:
        """One static-batch `generate` of equal-length prompts: (seconds to the first token, i.e. the prefill
        forward + its sampling; seconds to the end; tokens generated per prompt)."""
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("transformers peer: a static batch needs equal-length prompts")
        stamps: list[float] = []
        t = time.perf_counter()
        self._generate(prompts, max_new_tokens, stamps)
        end = time.perf_counter()
        return stamps[0] - t, end - t, len(stamps)

    def close(self) -> None:
        self.model = None
