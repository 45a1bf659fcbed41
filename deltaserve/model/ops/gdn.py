"""The gated delta rule (Gated DeltaNet's token mixer) in plain torch.

Semantics are transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule with
use_qk_l2norm_in_kernel=True: q and k are l2-normalised in fp32 (eps 1e-6), q is scaled by dk**-0.5, and
per token t and value head h (S the [dv, dk] state, fp32):

    S = S * exp(g_t);  S = S + beta_t * (v_t - S k_t) k_t^T;  o_t = S q_t

State layout: [H, dv, dk] (per sequence) or [B, H, dv, dk] (decode batch) float32, the transpose of
transformers' [.., dk, dv]: reductions over dk are contiguous. Grouped value heads: when q/k carry fewer
heads than v, each q/k head serves H_v / H_k consecutive value heads (repeat_interleave), as transformers.

Bit-exactness: the chunked form cuts the sequence on a 64-token grid anchored at ABSOLUTE positions
(multiples of 64 from token 0): a call starting at start_pos has a first chunk of 64 - start_pos % 64
tokens. Splitting a sequence at any multiple of 64 and carrying the state therefore gives bit-identical
outputs and states to processing it whole. Long inputs run in slices anchored at multiples of SLICE.

The compiled kernels' chunked rule (csrc/gdn_prefill.cpp, every x86 build; the op table takes it through
DecodeKernels.chunk_gated_delta_rule) has chunk_gated_delta_rule's contract and the same grid property, with
bits of its own; this module is its torch path.
"""
from __future__ import annotations

import torch

CHUNK = 64
SLICE = 1024  # a multiple of CHUNK; bounds the temporaries of one slice (docs/cpu.md: glibc mmap)
_INV_BLOCK = 8  # the blocked inverse solves 8x8 diagonal blocks by substitution, then merges
_EXP_MIN = -87.0  # exp(-87) = 1.6e-38 is still a normal float (see _chunk_slice)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm: x * rsqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool):
    """fp32, qk-normalised, q scaled, q/k heads repeated to the value heads. q, k [..., Hk, dk]; v [..., Hv, dv]."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    hk, hv = q.shape[-2], v.shape[-2]
    if hk != hv:
        if hv % hk:
            raise ValueError(f"value heads {hv} not a multiple of key heads {hk}")
        q = q.repeat_interleave(hv // hk, dim=-2)
        k = k.repeat_interleave(hv // hk, dim=-2)
    return q, k, v, g, beta


def _diag_blocks(x: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of x [..., C, C] cut into 2s x 2s diagonal blocks: their upper-left and lower-right s x s blocks
    and their lower-left one, each [..., C / 2s, s, s]."""
    n2 = x.shape[-1] // (2 * s)
    d = x.unflatten(-1, (n2, 2, s)).unflatten(-4, (n2, 2, s)).diagonal(dim1=-6, dim2=-3).movedim(-1, -5)
    return d[..., 0, :, 0, :], d[..., 1, :, 1, :], d[..., 1, :, 0, :]


def _unit_lower_inverse(a: torch.Tensor, block: int = _INV_BLOCK) -> torch.Tensor:
    """inv(I + tril(a, -1)) for a [..., C, C] (C = block * 2^m); only a's strictly lower part is read.

    The block x block diagonal blocks are inverted by row substitution (transformers' formulation), then
    written into a zero C x C result and merged in place, level by level:
    inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]. Each matrix of the batch is independent.
    """
    C = a.shape[-1]
    n = C // block
    m = a.unflatten(-2, (n, block)).unflatten(-1, (n, block)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    m = m.tril(-1).neg_()  # [..., n, b, b]: minus the strictly lower diagonal blocks (a new tensor)
    for i in range(1, block):
        row = m[..., i:i + 1, :i]  # [..., n, 1, i]
        row += row @ m[..., :i, :i]
    m.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    t = a.new_zeros(a.shape)
    t.unflatten(-2, (n, block)).unflatten(-1, (n, block)).diagonal(dim1=-4, dim2=-2).copy_(m.movedim(-3, -1))
    s = block
    while s < C:
        t11, t22, t21 = _diag_blocks(t, s)
        t21.copy_(torch.matmul(t22, torch.matmul(_diag_blocks(a, s)[2], t11)).neg_())
        s *= 2
    return t


def _runs(lead: int, n: int) -> list[tuple[int, int, int, int, int, int]]:
    """A slice of n tokens whose first token sits at row `lead` of its chunk, as at most three boxes of the
    chunk grid: (token start, token end, chunk start, chunk end, row start, row end)."""
    out, p = [], 0
    if lead:
        p = min(CHUNK - lead, n)
        out.append((0, p, 0, 1, lead, lead + p))
    full = (n - p) // CHUNK
    if full:
        c = (lead + p) // CHUNK
        out.append((p, p + full * CHUNK, c, c + full, 0, CHUNK))
        p += full * CHUNK
    if p < n:
        c = (lead + p) // CHUNK
        out.append((p, n, c, c + 1, 0, n - p))
    return out


def _to_chunks(dst: torch.Tensor, src: torch.Tensor, lead: int, scale: torch.Tensor | None = None,
               rep: int = 1) -> None:
    """dst [N, H, C, *f] fp32 chunk-major <- src [n, H / rep, *f] token-major (any dtype and strides; dst head h
    reads src head h // rep), times scale [n, H / rep, 1] when given: one pass, converting as it copies.
    Rows of dst outside the slice (before `lead`, after the last token) are zeroed."""
    n = src.shape[0]
    tok = dst.transpose(1, 2)  # [N, C, H, *f] view
    if lead:
        tok[0, :lead].zero_()
    end = (lead + n) % CHUNK
    if end:
        tok[-1, end:].zero_()
    if rep > 1:
        tok = tok.unflatten(2, (-1, rep))  # [N, C, Hk, rep, *f]
        src = src.unsqueeze(2).expand(*src.shape[:2], rep, *src.shape[2:])
        if scale is not None:
            scale = scale.unsqueeze(2).expand(*scale.shape[:2], rep, 1)
    for s0, s1, c0, c1, r0, r1 in _runs(lead, n):
        d, x = tok[c0:c1, r0:r1], src[s0:s1].unflatten(0, (c1 - c0, r1 - r0))
        if scale is None:
            d.copy_(x)
        else:
            torch.mul(x, scale[s0:s1].unflatten(0, (c1 - c0, r1 - r0)), out=d)


def _from_chunks(dst: torch.Tensor, src: torch.Tensor, lead: int) -> None:
    """dst [n, H, *f] token-major <- the slice's rows of src [N, H, C, *f] chunk-major (converting)."""
    tok = src.transpose(1, 2)
    for s0, s1, c0, c1, r0, r1 in _runs(lead, dst.shape[0]):
        dst[s0:s1].unflatten(0, (c1 - c0, r1 - r0)).copy_(tok[c0:c1, r0:r1])


def _qk_scale(x: torch.Tensor, mult: float, use_qk_l2norm: bool) -> torch.Tensor:
    """[n, Hk, d] (any float dtype) -> [n, Hk, 1] fp32 row factors: mult * rsqrt(|x|^2 + 1e-6), or mult."""
    if not use_qk_l2norm:
        return torch.full((1, 1, 1), mult, dtype=torch.float32, device=x.device).expand(*x.shape[:2], 1)
    nrm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # one pass over x
    r = nrm.mul_(nrm).add_(1e-6).rsqrt_()
    return r.mul_(mult) if mult != 1.0 else r


def _chunk_slice(q, k, v, g, beta, state, lead: int, dst, use_qk_l2norm: bool,
                 grab: dict[int, list] | None = None) -> None:
    """One slice of one sequence. q, k [n, Hk, dk]; v [n, H, dv]; g, beta [n, H] (any float dtypes, any
    strides); state [H, dv, dk] fp32, updated in place; lead: the in-chunk offset of the first token (its
    absolute position % CHUNK); dst [n, H, dv] receives the output (converted to its dtype). grab: chunk
    index i -> a list that receives a copy of the state [H, dv, dk] after chunk i (the state a call starting
    at that chunk boundary would begin from, bit for bit).

    Per chunk (c = cumulative log decay from the chunk start, D_ij = exp(c_i - c_j) for j <= i, else 0):
      A = diag(beta) (K K^T * D), strictly lower;  T = (I + A)^-1
      U = T diag(beta) V;  W = T diag(beta exp(c)) K           (the UT / WY form)
      then in order over chunks, S the [dv, dk] state entering the chunk (kept transposed, contiguous):
      V' = U - W S^T;  O = (diag(exp(c)) Q) S^T + (Q K^T * D) V';  S^T = exp(c_last) S^T + K'^T V'
      with K' = diag(exp(c_last - c)) K
    Everything but the state recurrence runs for all chunks of the slice at once (one op each); q, k, v are
    converted, normalised and laid out chunk-major in one pass each, K and Q side by side so one product
    gives K K^T and Q K^T; the loop is five ops per chunk, all on contiguous operands. Zero padding rows
    (k = v = beta = g = 0) leave the state and real rows untouched.
    A chunk's arithmetic depends only on its own rows and the state entering it.
    """
    n, hk, dk = q.shape
    H, dv = v.shape[1:]
    rep, C = H // hk, CHUNK
    N = -(-(lead + n) // C)
    f32, dev = torch.float32, q.device
    kq = torch.empty(N, H, 2 * C, dk, dtype=f32, device=dev)  # per chunk and head: [K; Q], one product for both
    kc, qc = kq[:, :, :C], kq[:, :, C:]
    _to_chunks(qc, q, lead, _qk_scale(q, dk ** -0.5, use_qk_l2norm), rep)
    _to_chunks(kc, k, lead, _qk_scale(k, 1.0, use_qk_l2norm) if use_qk_l2norm else None, rep)
    vc = torch.empty(N, H, C, dv, dtype=f32, device=dev)
    bc = torch.empty(N, H, C, dtype=f32, device=dev)
    gc = torch.empty(N, H, C, dtype=f32, device=dev)
    for d, x in ((vc, v), (bc, beta), (gc, g)):
        _to_chunks(d, x, lead)
    cum = gc.cumsum(-1)  # [N, H, C] log-decay from the chunk start, inclusive
    # Every exp below takes arguments <= 0 clamped at _EXP_MIN: exp under/overflow (|x| > ~87) takes a slow
    # path here (~80x), and real decays reach -100s within a chunk. The clamp changes nothing where exp(x) is
    # a normal float; below it, 0 or a denormal becomes 1.6e-38. Above the diagonal x >= 0: clamped to 0, zeroed.
    cexp = cum.clamp_min(_EXP_MIN).exp_()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).clamp_(_EXP_MIN, 0.0).exp_().tril_()  # exp(c_i - c_j), j <= i
    NH = N * H
    k3 = kc.reshape(NH, C, dk)  # views: the chunk-major buffer merges N and H
    s = torch.bmm(kq.view(NH, 2 * C, dk), k3.transpose(1, 2)).view(N, H, 2 * C, C)
    a = s[:, :, :C].mul_(decay).mul_(bc.unsqueeze(-1))  # diag(beta) (K K^T * D)
    attn = s[:, :, C:].mul_(decay)  # Q K^T * D (causal: D is 0 above the diagonal)
    tinv = _unit_lower_inverse(a)
    u = torch.bmm((tinv * bc.unsqueeze(-2)).view(NH, C, C), vc.view(NH, C, dv)).view(N, H, C, dv)
    w = torch.bmm(tinv.mul_((bc * cexp).unsqueeze(-2)).view(NH, C, C), k3).view(N, H, C, dk)
    kdt = torch.mul(kc.transpose(-1, -2), (cum[..., -1:] - cum).clamp_(min=_EXP_MIN).exp_().unsqueeze(-2),
                    out=torch.empty(N, H, dk, C, dtype=f32, device=dev))  # (diag(exp(c_last - c)) K)^T
    qc.mul_(cexp.unsqueeze(-1))  # diag(exp(c)) Q
    cd = cexp[..., -1, None, None]  # [N, H, 1, 1]
    st = state.transpose(-1, -2).contiguous()  # S^T [H, dk, dv]: every product below reads it as is
    out = torch.empty(N, H, C, dv, dtype=f32, device=dev)
    for i in range(N):
        v_new = torch.baddbmm(u[i], w[i], st, alpha=-1.0)  # V' = U - W S^T
        torch.bmm(qc[i], st, out=out[i]).baddbmm_(attn[i], v_new)  # O
        st.mul_(cd[i]).baddbmm_(kdt[i], v_new)  # S^T = exp(c_last) S^T + K'^T V'
        if grab and i in grab:
            grab[i].append(st.transpose(-1, -2).contiguous())
    state.copy_(st.transpose(-1, -2))
    _from_chunks(dst, out, lead)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, start_pos: int = 0,
                           use_qk_l2norm: bool = True, out: torch.Tensor | None = None,
                           states_at: tuple[int, ...] = (), states: list | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of ONE sequence, chunked (WY/UT form) on the absolute 64-token grid.

    q, k [L, Hk, dk]; v [L, H, dv]; g (log decay, <= 0) and beta [L, H]; Hk divides H (grouped heads).
    initial_state [H, dv, dk] (any float dtype; not modified) or None (zeros). start_pos: the absolute
    position of q[0], which fixes the chunk grid. Returns (out [L, H, dv] in q's dtype, final state
    [H, dv, dk] float32). out: an [L, H, dv] tensor to write the output into (then returned) instead.
    states_at: absolute positions p (multiples of 64, start_pos < p <= start_pos + L) whose state, after
    exactly token p - 1, is appended to `states` in that order ([H, dv, dk] float32 each): the checkpoints
    inside a prefill chunk, identical to the state a call that stopped at p would return.
    """
    L, H, dv = v.shape
    dk = q.shape[-1]
    wanted = check_call(q, v, start_pos, states_at, states)
    state = start_state(initial_state, H, dv, dk, q.device)  # updated in place below
    if out is None:
        out = torch.empty(L, H, dv, dtype=q.dtype, device=q.device)
    found: list = []
    s = 0
    while s < L:
        a = start_pos + s
        e = min((a // SLICE + 1) * SLICE - start_pos, L)
        first = a - a % CHUNK  # absolute start of the slice's first chunk
        grab = {(p - first) // CHUNK - 1: found for p in wanted if a < p <= start_pos + e}
        _chunk_slice(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state, a % CHUNK, out[s:e], use_qk_l2norm, grab)
        s = e
    if wanted:
        states.extend(found)
    return out, state


def check_call(q: torch.Tensor, v: torch.Tensor, start_pos: int, states_at: tuple[int, ...],
               states: list | None) -> list[int]:
    """chunk_gated_delta_rule's checks (its compiled form's too): grouped heads, and states_at positions that are
    chunk boundaries inside the call with a list to receive them. Returns states_at sorted."""
    L, H = v.shape[:2]
    if H % q.shape[-2]:
        raise ValueError(f"value heads {H} not a multiple of key heads {q.shape[-2]}")
    wanted = sorted(states_at)
    bad = [p for p in wanted if p % CHUNK or not start_pos < p <= start_pos + L]
    if bad:
        raise ValueError(f"states_at {bad}: not chunk boundaries inside positions {start_pos}..{start_pos + L}")
    if wanted and states is None:
        raise ValueError("states_at needs a `states` list to append to")
    return wanted


def start_state(initial_state: torch.Tensor | None, H: int, dv: int, dk: int, device) -> torch.Tensor:
    """The state a call starts from and updates: a contiguous fp32 copy of initial_state [H, dv, dk], or zeros."""
    if initial_state is None:
        return torch.zeros(H, dv, dk, dtype=torch.float32, device=device)
    return initial_state.to(torch.float32, copy=True).contiguous()


def recurrent_gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, state: torch.Tensor,
                                    use_qk_l2norm: bool = True) -> torch.Tensor:
    """One decode token for each of B sequences. q, k [B, Hk, dk]; v [B, H, dv]; g, beta [B, H];
    state [B, H, dv, dk] float32 contiguous, updated in place. Returns out [B, H, dv] in q's dtype.

    Three passes over the state: one batched mat-vec reads S k and S q from the old state, then
    S = e S + delta k^T (e = exp(g), delta = beta (v - e S k)), and o = e S q + delta (k . q).
    Batched mat-vecs, short row sums and elementwise ops only: a sequence's result does not depend on B.
    """
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    B, H, dv, dk = state.shape
    s3 = state.view(B * H, dv, dk)
    k2, q2 = k.reshape(B * H, dk), q.reshape(B * H, dk)
    skq = torch.bmm(s3, torch.stack([k2, q2], dim=-1))  # [BH, dv, 2]: S k, S q
    e = g.exp().reshape(B * H, 1)
    delta = (v.reshape(B * H, dv) - skq[..., 0] * e) * beta.reshape(B * H, 1)
    out = skq[..., 1] * e + delta * (k2 * q2).sum(-1, keepdim=True)
    s3.mul_(e.unsqueeze(-1)).baddbmm_(delta.unsqueeze(-1), k2.unsqueeze(1))
    return out.view(B, H, dv).to(dtype)


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
                               compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The token loop, written as transformers' torch_recurrent_gated_delta_rule (state [H, dk, dv] inside).

    Same arguments as chunk_gated_delta_rule (no grid); returns (out [L, H, dv], final state [H, dv, dk]),
    both in compute_dtype. compute_dtype=float64 makes it an oracle.
    """
    L, H, dv = v.shape
    dk = q.shape[-1]
    q, k, v, g, beta = (t.to(compute_dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q / (dk ** 0.5)
    if q.shape[1] != H:
        q = q.repeat_interleave(H // q.shape[1], dim=1)
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    s = (torch.zeros(H, dk, dv, dtype=compute_dtype, device=v.device) if initial_state is None
         else initial_state.to(compute_dtype).transpose(-1, -2).clone())
    out = torch.zeros(L, H, dv, dtype=compute_dtype, device=v.device)
    for t in range(L):
        s = s * g[t].exp()[:, None, None]
        kv_mem = (s * k[t].unsqueeze(-1)).sum(-2)
        delta = (v[t] - kv_mem) * beta[t].unsqueeze(-1)
        s = s + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = (s * q[t].unsqueeze(-1)).sum(-2)
    return out, s.transpose(-1, -2).contiguous()
