"""HybridModel: Qwen3.5 dense (qwen3_5_text), Qwen3.5-MoE (qwen3_5_moe_text) and Qwen3-Next (qwen3_next).

The layer pattern comes from config.layer_types: "linear_attention" layers are Gated DeltaNet,
"full_attention" layers are gated full attention over the paged KV pool. Build one with loader.load_model
(from a model directory) or HybridModel(cfg, dtype) + load_state_dict(..., assign=True).

forward(batch, caches) -> hidden [T, hidden] (final norm applied); compute_logits(hidden [N, hidden]) ->
[N, vocab] float32. Caches: caches.kv[a] for the a-th attention layer, caches.conv[l] / caches.ssm[l] for
the l-th GDN layer (see batch.Caches).
"""
from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from . import fused, quant
from .batch import Caches, ForwardBatch
from .layers import DecoderLayer, StepContext, empty_param, prepack
from .mrope import mrope_cos_sin
from .mtp import MTPHead
from .ops.attention import RotaryTable, rotary_inv_freq
from .ops.cpu_kernels import DecodeKernels, select_decode_kernels
from .ops.fp8 import Fp8Weight, embedding_fp8, fp8_kernel, path_for, quantize_fp8_packed
from .ops.int4 import Int4Weight, embedding_int4, int4_path_for, quantize_int4_packed
from .ops.linear import linear
from .ops.packed import PackedWeight, can_prepack, embedding_packed, pack_bf16_rows
from .ops.table import Ops

log = logging.getLogger("deltaserve")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return TORCH_DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; use one of {', '.join(TORCH_DTYPES)}") from None


# --quantize: the int4 group size of each choice (ops/int4.py; 0: the weights stay as the checkpoint holds them)
INT4_GROUPS = {"none": 0, "int4": 128, "int4-g32": 32}


class Packing(NamedTuple):
    """How a model's weights are packed (HybridModel.packing): the compiled bf16 linear's module (None:
    oneDNN's layout), the compiled quantized linears' (fp8 and int4; None: no quantized weights), the fp8 path,
    and the int4 group size the bf16 projections are quantized to at load (0: they stay bf16)."""

    ext: object
    fp8_ext: object
    fp8_path: str
    int4_group: int = 0
    int4_path: str = "int4"  # linear_int4's path (ops/int4.py int4_path_for)


def _consecutive(xs: list[int]) -> tuple[int, int] | None:
    """(xs[0], xs[-1] + 1) when xs is a, a+1, a+2, ...; else None."""
    if xs and all(b == a + 1 for a, b in itertools.pairwise(xs)):
        return xs[0], xs[-1] + 1
    return None


class HybridModel(nn.Module):
    """Parameters (state_dict names): embed_tokens [V, H] (None once a tied head is packed for the compiled
    linear_bf16 or quantized, the head then serving the lookups: embed()); layers.{i}.*; norm [H]; lm_head [V, H]
    unless tied.

    dtype: the weight / activation / KV / conv-state dtype. The GDN recurrent state is always float32.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | str = torch.float32, mtp: bool = False):
        super().__init__()
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        dtype = torch_dtype(dtype)
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = empty_param(cfg.hidden_size, dtype=dtype)
        self.tied = cfg.tie_word_embeddings
        if not self.tied:
            self.lm_head = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        # the multi-token-prediction layers (model/mtp.py), loaded for speculative decoding only: parameters mtp.*
        self.mtp = MTPHead(cfg, dtype) if mtp else None
        # cos, sin per position (plain attributes: not weights)
        self.rotary = RotaryTable(rotary_inv_freq(cfg.rotary_dim, cfg.rope_theta), dtype)
        self.visual = None  # the vision encoder (vision.py) of a multimodal checkpoint, set by attach_vision

    mrope_section: tuple[int, ...] = ()

    def attach_vision(self, visual) -> None:
        """Make this a multimodal model: `visual` (vision.VisionModel) encodes images, whose placeholder rows
        then rotate by M-RoPE positions (mrope.py) in the config's mrope_section."""
        if visual.config.out_hidden_size != self.config.hidden_size:
            raise ConfigError(f"vision out_hidden_size {visual.config.out_hidden_size} != text hidden_size "
                              f"{self.config.hidden_size}")
        self.visual = visual
        self.mrope_section = visual.config.mrope_section

    # ---- what the runner allocates -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.norm.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ids: from embed_tokens, or, once a tied head is packed (pack_head), from the head
        as it is held: the compiled linear_bf16's packing (ops/packed.py embedding_packed: the same bits), or a head
        quantized with --quantize-head (embedding_fp8 / embedding_int4: the quantized rows, dequantized to bf16, as
        llama.cpp reads a quantized token_embd). Either way the [V, H] weight is held once."""
        if self.embed_tokens is None:
            head = self.packed_head
            if isinstance(head, Int4Weight):
                return embedding_int4(ids, head)
            if isinstance(head, Fp8Weight):
                return embedding_fp8(ids, head)
            return embedding_packed(ids, head)
        return F.embedding(ids, self.embed_tokens)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def conv_dtype(self) -> torch.dtype:
        return self.dtype

    ssm_dtype = torch.float32

    def cache_shapes(self, num_slots: int, num_pages: int, block_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-layer shapes and dtypes of Caches' tensors: kv (per attention layer), conv and ssm (per GDN layer)."""
        c = self.config
        return {
            "kv": ((num_pages, 2, block_size, c.num_key_value_heads, c.head_dim), self.kv_dtype),
            "conv": ((num_slots, c.linear_conv_kernel_dim - 1, c.conv_dim), self.conv_dtype),
            "ssm": ((num_slots, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim), self.ssm_dtype),
        }

    # ---- forward -------------------------------------------------------------------------------------
    def _context(self, batch: ForwardBatch, caches: Caches, ops: Ops | None) -> StepContext:
        dev = self.device
        if batch.mrope is not None:
            cos, sin = mrope_cos_sin(self.rotary, batch.mrope.to(dev), self.mrope_section)
        else:
            end = batch.rope_end or max((s.pos + s.length for s in batch.spans), default=0)
            cos, sin = self.rotary(batch.positions.to(dev), end)
        bs = caches.block_size
        pages, rows = [], []
        dec_rows, dec_slots, dec_pos, dec_span = [], [], [], []
        batch.check(bs)
        longest = 1  # the longest decode span (> 1: verify spans, stepped in waves)
        for s in batch.spans:
            if s.is_decode:  # its K/V rows: one gather for all decode spans, through their page table below
                longest = max(longest, s.length)
                dec_rows.extend(range(s.start, s.start + s.length))
                dec_slots.extend([s.slot] * s.length)
                dec_pos.extend(range(s.pos, s.pos + s.length))
                dec_span.extend([len(dec_span) and dec_span[-1] + 1] * s.length)
                continue
            p = torch.arange(s.pos, s.pos + s.length, device=dev)
            pages.append(s.page_ids.to(dev)[p // bs])
            rows.append(p % bs)
        as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev) if xs else None
        empty = torch.empty(0, dtype=torch.long, device=dev)
        kernels = self.decode_kernels or self.select_decode_kernels()
        ops = ops or self.ops
        table = lengths = None
        waves = None
        if longest > 1:  # wave j: the j-th token of every decode span that long (distinct slots, as in a decode step)
            dspans = [s for s in batch.spans if s.is_decode]
            waves = []
            for j in range(longest):
                part = [s for s in dspans if s.length > j]
                slots_j = [s.slot for s in part]
                waves.append((as_index([s.start + j for s in part]), as_index(slots_j), _consecutive(slots_j)))
        if dec_rows:
            table = batch.decode_page_table().to(dev)  # [B, max pages]
            if longest > 1:  # a row per decode token: each verify token reads its span's table
                table = table.index_select(0, as_index(dec_span))
            dpos = as_index(dec_pos)
            pages.append(table[torch.arange(len(dec_pos), device=dev), dpos // bs])
            rows.append(dpos % bs)
            lengths = dpos + 1
        decode_all = bool(dec_rows) and dec_rows == list(range(sum(s.length for s in batch.spans)))
        return StepContext(batch=batch, cos=cos, sin=sin,
                           kv_pages=torch.cat(pages) if pages else empty, kv_rows=torch.cat(rows) if rows else empty,
                           decode_rows=as_index(dec_rows), decode_slots=as_index(dec_slots),
                           decode_slot_range=_consecutive(dec_slots), kernels=kernels, ops=ops,
                           save_state=caches.save_state,
                           decode_page_table=table if kernels.compiled else None,
                           decode_lengths=lengths if kernels.compiled else None,
                           decode_all=decode_all, decode_waves=waves, log_state=caches.log_state)

    def forward(self, batch: ForwardBatch, caches: Caches, ops: Ops | None = None) -> torch.Tensor:
        """Runs every span of the step; writes K/V pages and GDN slots. Returns hidden [T, hidden] (final norm).
        ops: the op table to call (default the model's own, self.ops; the profiler passes a timed copy)."""
        if ops is None or ops is self.ops:
            hidden = fused.decode_step(self, batch, caches)  # a decode-only step in one compiled call
            if hidden is not None:
                return hidden
        ctx = self._context(batch, caches, ops)
        x = self.embed(batch.input_ids.to(self.device))
        if batch.embed_rows is not None:  # image placeholders take the vision encoder's output
            x = x.index_copy(0, batch.embed_rows.to(self.device), batch.embeds.to(self.device, x.dtype))
        gi = ai = 0
        for layer in self.layers:
            if layer.is_gdn:
                x = layer(x, ctx, (caches.conv[gi], caches.ssm[gi]))
                gi += 1
            else:
                x = layer(x, ctx, (caches.kv[ai],))
                ai += 1
        return ctx.ops.rms_norm(x, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def replay_gdn(self, l: int, ssm_cache: torch.Tensor, slot: int, x: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> None:
        """GDN layer l's recurrent state in `slot` stepped through logged tokens (CacheStore.rollback's replay)."""
        mixers = self.__dict__.get("_gdn_mixers")  # found once: a verify step replays every GDN layer
        if mixers is None:
            mixers = self._gdn_mixers = [layer.linear_attn for layer in self.layers if layer.is_gdn]
        kernels = self.decode_kernels or self.select_decode_kernels()
        mixers[l].replay(kernels, self.ops, ssm_cache, slot, x, g, beta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        w = self.packed_head if self.packed_head is not None else (self.embed_tokens if self.tied else self.lm_head)
        return linear(hidden, w).float()

    def held_weight_bytes(self) -> dict[str, int]:
        """Bytes of weights the model holds as it runs them (packed, fp8 codes and scales; a tied head packed for
        the compiled linear once, as the embedding too): {"text": ..., "head": the packed head, "vision": ..., "mtp": ...,
        "total": their sum}. What the start-up screen reports and tests hold `deltaserve plan`'s figure to."""
        from .ops.fp8 import weight_nbytes

        def held(root: nn.Module | None) -> int:
            if root is None:
                return 0
            total = 0
            for module in root.modules():
                total += sum(p.numel() * p.element_size() for p in module._parameters.values() if p is not None)
                for name in getattr(module, "PACKABLE", ()):
                    w = module.__dict__.get(name)  # packed or quantized: off the parameters
                    for x in (w if isinstance(w, list) else [w] if w is not None else []):
                        total += weight_nbytes(x)
            return total

        vision, mtp = held(self.visual), held(self.mtp)
        head = weight_nbytes(self.packed_head) if self.packed_head is not None else 0
        text = held(self) - vision - mtp
        return {"text": text, "head": head, "vision": vision, "mtp": mtp, "total": text + head + vision + mtp}

    packed_head: PackedWeight | Fp8Weight | Int4Weight | None = None  # the head as compute_logits multiplies it
    linear_kind: str | None = None  # "cpp" | "onednn" once prepack_linears packed, else None (F.linear)
    decode_kernels: DecodeKernels | None = None  # chosen once, on first use or by select_decode_kernels()
    ops: Ops | None = None  # the op table over those kernels (ops/table.py)

    def select_decode_kernels(self, mode: str | None = None, isa: str | None = None) -> DecodeKernels:
        """Choose (and log) the decode ops for this model's device and dtype: the compiled CPU kernels or the
        plain-torch ones (mode: auto | cpp | torch, default $DELTASERVE_DECODE_KERNELS; isa: the kernels'
        instruction set, default $DELTASERVE_CPU_ISA or the CPU's best; ops/cpu_kernels.py).
        The loader calls it at start-up; a model built by hand chooses on its first forward."""
        self.decode_kernels = select_decode_kernels(self.device, self.dtype, mode, isa)
        self.ops = Ops.for_kernels(self.decode_kernels)
        return self.decode_kernels

    def prepack_linears(self, quantize_head: str = "none", quantize: str = "none") -> bool:
        """Where it helps (bf16 weights on a CPU): pack every projection and the head once, for the compiled
        linear_bf16 where the decode kernels are compiled (any instruction set: batch-invariant, fastest here),
        else into oneDNN's layout (F.linear's bits). The packed weights replace the parameters (they leave
        state_dict; the embedding stays for lookups). Returns whether it packed; call once, after loading,
        before serving. self.linear_kind says which packing ("cpp", "onednn" or None).
        quantize_head "fp8": the head is quantized to block-FP8 (ops/fp8.py quantize_fp8, the rule a -FP8
        model's linears were made by) and multiplied by the compiled linear_fp8; a tied one is the embedding too
        (embed() reads its rows dequantized). ConfigError where there is no compiled fp8 kernel.
        quantize "int4" / "int4-g32": every projection of the text model (and the MTP layer) quantized to int4 at
        load (ops/int4.py, groups of 128 / 32 k with a zero point), multiplied by the compiled linear_int4;
        quantize_head "int4" does the same to the head."""
        packing = self.packing(quantize_head, quantize=quantize)
        if packing is None:
            if quantize != "none":
                raise ConfigError(f"--quantize {quantize} needs bf16 weights on the CPU and the compiled kernels")
            return False
        vision = {id(m) for m in self.visual.modules()} if self.visual is not None else set()
        for module in self.modules():  # the vision encoder's projections stay bf16 (--quantize is the text model's)
            self.pack_module(module, packing._replace(int4_group=0) if id(module) in vision else packing)
        self.pack_head(packing, quantize_head)
        return True

    def packing(self, quantize_head: str = "none", quantized: bool | None = None,
                quantize: str = "none") -> Packing | None:
        """How prepack_linears packs this model (the kernels' modules and the fp8 path), or None where packing
        does not apply (not bf16 on a CPU, the head packed already, no packed linear on this machine).
        quantized: whether the model holds block-FP8 weights (None: look at the weights it holds now; the
        streaming loader says so before any are placed). ConfigError as prepack_linears."""
        if self.packed_head is not None or self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return None
        kernels = self.decode_kernels or self.select_decode_kernels()
        ext = kernels.ext if kernels.compiled and kernels.ext.bf16_linear_available() else None
        if ext is None and not can_prepack(self.dtype, self.device) and not INT4_GROUPS[quantize]:
            if quantize_head != "none":
                raise ConfigError(f"--quantize-head {quantize_head}: no compiled linear on this machine")
            return None  # neither the compiled linear (any instruction set) nor oneDNN's bf16 (int4 needs neither)
        if quantized is None:
            quantized = bool(quant.quantized_bytes(self))
        int4_group = INT4_GROUPS[quantize]
        # quantized weights the loader kept or made: the build of the decode kernels' instruction set
        fp8_ext = fp8_kernel(kernels.isa) if quantized or quantize_head != "none" or int4_group else None
        if quantize_head != "none" and fp8_ext is None:
            raise ConfigError(f"--quantize-head {quantize_head}: this machine has no compiled quantized linear (see "
                              "the warning above)")
        if int4_group and fp8_ext is None:
            raise ConfigError(f"--quantize {quantize}: this machine has no compiled int4 linear (see the warning above)")
        fp8_path = path_for(fp8_ext, kernels.isa) if fp8_ext is not None else ""  # amx: AMX tiles for fp8 too
        if fp8_ext is not None:
            log.info("fp8 linear: path %s; int4 linear: path %s", fp8_path or fp8_ext.fp8_paths()[0],
                     int4_path_for(fp8_ext, kernels.isa))
        int4_path = int4_path_for(fp8_ext, kernels.isa) if fp8_ext is not None else "int4"
        return Packing(ext, fp8_ext, fp8_path, int4_group, int4_path)

    @staticmethod
    def pack_module(module: nn.Module, packing: Packing) -> None:
        """Pack module's own PACKABLE weights (not its children's) as `packing` says; the unpacked weights are
        dropped. Idempotent: what is packed already stays as it is."""
        names = tuple(n for n in getattr(module, "PACKABLE", ()) if n in module._parameters)
        if names and packing.int4_group:  # --quantize int4: the bf16 projections become int4 (asymmetric groups)
            for name in names:
                w = module._parameters.pop(name).detach()
                q = [Int4Weight.quantize(x, packing.int4_group, sym=False) for x in w] if w.dim() == 3 else \
                    Int4Weight.quantize(w, packing.int4_group, sym=False)
                setattr(module, name, q)
            names = ()
        if names:
            prepack(module, names, packing.ext)
        if packing.fp8_ext is not None:
            quant.pack(module, packing.fp8_ext, packing.ext, packing.fp8_path, packing.int4_path)

    def pack_head(self, packing: Packing, quantize_head: str = "none", rows=None) -> None:
        """Pack the head (an untied lm_head leaves the parameters; a tied one packed for the compiled
        linear_bf16 becomes the embedding too, embed_tokens None, and stays the embedding beside any other copy),
        or quantize it to block-FP8 / int4 (quantize_head "fp8" / "int4"; a tied one is then the embedding too:
        the lookups read its rows dequantized, embed()). Packed or quantized a band of rows at a time.
        rows(r0, r1) -> the head's rows r0..r1 in bf16: a tied head the loader streams from the checkpoint (never
        held whole beside its packing; only where it is packed "cpp" or quantized); None: the model's own tensor."""
        ext, fp8_ext, fp8_path, _, int4_path = packing
        shape = (self.config.vocab_size, self.config.hidden_size)
        if rows is None:
            head = (self.embed_tokens if self.tied else self._parameters.pop("lm_head")).detach()
            rows = lambda r0, r1: head[r0:r1]  # noqa: E731
        else:
            assert self.tied and (quantize_head != "none" or (ext is not None and shape[1] % 2 == 0))
            head = None
        bf16_mb = f"{shape[0] * shape[1] * 2 / 1e6:,.1f}"
        if quantize_head == "none":
            if ext is not None and shape[1] % 2 == 0:  # the compiled linear_bf16's packing, band by band
                self.packed_head = pack_bf16_rows(rows, shape, ext)
            else:
                self.packed_head = PackedWeight(head, ext)  # oneDNN's reordering (or F.linear's) of the whole
            self.linear_kind = self.packed_head.kind
        elif quantize_head == "int4":  # groups of 128 k with a zero point, the --quantize int4 rule
            self.linear_kind = "cpp" if ext is not None else "onednn"
            self.packed_head = quantize_int4_packed(rows, shape, 128, False, fp8_ext, int4_path)
            log.info("LM head quantized to int4 (%s MB, was %s MB in bf16)", f"{self.packed_head.nbytes / 1e6:,.1f}",
                     bf16_mb)
        else:  # the projections' packing names linear_kind; the head is not packed in bf16 at all
            self.linear_kind = "cpp" if ext is not None else "onednn"
            self.packed_head = quantize_fp8_packed(rows, shape, fp8_ext, fp8_path)
            log.info("LM head quantized to block-FP8 (%s MB, was %s MB in bf16)",
                     f"{self.packed_head.nbytes / 1e6:,.1f}", bf16_mb)
        if self.tied and (quantize_head != "none" or self.packed_head.kind == "cpp"):  # the head is the embedding
            self.embed_tokens = None  # too, held once (embed() reads its rows)
