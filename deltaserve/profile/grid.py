"""The shapes the profiler times: one list per phase, capped by the engine's limits. No torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Grid:
    tokens: list[int]  # prefill runs: one span of T tokens (dense kernels, GDN prefill, attention at prior 0)
    rows: list[int]  # sampled rows (lm head, sampler)
    gdn_decode: list[int]  # decode runs: D sequences ...
    decode_ctx: list[int]  # ... at these contexts (GDN decode kernels, decode attention)
    attn_q: list[int]  # prefill attention alone: q tokens ...
    attn_prior: list[int]  # ... after this much context
    copies: list[int]
    seqs: list[int]  # scheduler overhead
    mixed: list[tuple[int, int]]  # (prefill tokens, decodes) through one forward: additivity check
    repeats: int
    encoder_sides: tuple[int, ...] = ()  # vision encoder: square images this many merged tokens on a side

    def num_shapes(self) -> int:
        """The shapes the phases visit (an attention shape past the pool counts too): the progress bar's total."""
        return (len(self.tokens) + len(self.gdn_decode) * len(self.decode_ctx) + len(self.mixed) + len(self.rows)
                + len(self.attn_q) * len(self.attn_prior) + len(self.copies) + len(self.seqs))


def make_grid(quick: bool, max_tokens: int, max_seqs: int, max_context: int, repeats: int | None) -> Grid:
    cap = lambda xs, m: sorted({x for x in xs if x <= m} | {m})  # noqa: E731
    if quick:
        tokens = [1, 4, 16, 64, 256, 512, 1024, 2048]
        rows = [1, 4, 16, 64]
        gd = [1, 4, 16, 64]
        dctx = [128, 1024, 4096]
        prior = [0, 1024, 4096]
        copies = [1, 4, 16]
        seqs = [1, 4, 16, 64]
        mixed = [(256, 4)]
        sides = (8, 14, 28)
        reps = repeats or 3
    else:
        tokens = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536,
                  2048, 3072, 4096, 8192]
        rows = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256]
        gd = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256]
        dctx = [64, 256, 1024, 2048, 4096, 8192, 16384, 32768]
        prior = [0, 256, 1024, 2048, 4096, 8192, 16384]
        copies = [1, 2, 4, 8, 16, 32, 64]
        seqs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        mixed = [(64, 1), (256, 4), (512, 8), (1024, 16)]
        sides = (8, 14, 20, 28, 40)  # 64 to 1,600 tokens an image (256x256 .. 1280x1280 pixels at Qwen3.5's 32)
        reps = repeats or 5
    toks = cap(tokens, max_tokens)
    aq = [t for t in toks if t in (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192) or t == max_tokens]
    dctx = [c for c in dctx if c <= max_context] or [max_context]
    return Grid(tokens=toks, rows=cap(rows, max(1, max_seqs)), gdn_decode=cap(gd, max_seqs), decode_ctx=dctx,
                attn_q=aq, attn_prior=[p for p in prior if p < max_context], copies=cap(copies, max_seqs),
                seqs=cap(seqs, max_seqs),
                mixed=[(p, d) for p, d in mixed if p <= max_tokens and d <= max_seqs] or [(min(64, max_tokens), 1)],
                repeats=reps, encoder_sides=sides)
