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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
SLICE = 1024  # a multiple of CHUNK; bounds the temporaries of one slice (see CPU-NOTES: glibc mmap)
_INV_BLOCK = 16  # the blocked inverse solves 16x16 diagonal blocks by substitution, then merges


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


def _unit_lower_inverse(a: torch.Tensor, block: int = _INV_BLOCK) -> torch.Tensor:
    """inv(I + tril(a, -1)) for a [..., C, C] (C = block * 2^m): blocked forward substitution.

    The 16x16 diagonal blocks are inverted by row substitution (transformers' formulation), then pairs of
    blocks are merged: inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1, D^-1]].
    """
    C = a.shape[-1]
    lead = a.shape[:-2]
    a = a.tril(-1)
    n = C // block
    a4 = a.unflatten(-2, (n, block)).unflatten(-1, (n, block))  # [..., n, b, n, b]
    m = -torch.stack([a4[..., i, :, i, :] for i in range(n)], dim=-3)  # [..., n, b, b], strictly lower
    for i in range(1, block):
        row = m[..., i:i + 1, :i]  # [..., n, 1, i]
        m[..., i:i + 1, :i] = row + row @ m[..., :i, :i]
    t = m + torch.eye(block, dtype=a.dtype, device=a.device)
    size = block
    while size < C:
        n = C // size
        a4 = a.unflatten(-2, (n, size)).unflatten(-1, (n, size))  # [..., n, s, n, s]
        a21 = torch.stack([a4[..., 2 * p + 1, :, 2 * p, :] for p in range(n // 2)], dim=-3)  # [..., n/2, s, s]
        t11, t22 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        merged = a.new_zeros(*lead, n // 2, 2 * size, 2 * size)
        merged[..., :size, :size] = t11
        merged[..., size:, size:] = t22
        merged[..., size:, :size] = -(t22 @ (a21 @ t11))
        t, size = merged, 2 * size
    return t[..., 0, :, :]


def _pad_chunks(x: torch.Tensor, lead: int, tail: int) -> torch.Tensor:
    """[n, H, ...] -> [N, H, CHUNK, ...] contiguous: chunk-major, zero rows before (lead) and after (tail)."""
    if lead or tail:
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (lead, tail))
    x = x.unflatten(0, (-1, CHUNK))  # [N, C, H, ...]
    return x.transpose(1, 2).contiguous()


def _chunk_slice(q, k, v, g, beta, state, lead: int):
    """One slice of one sequence, all fp32 and prepared. q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H];
    state [H, dv, dk] (updated in place); lead: the in-chunk offset of the first token (its absolute
    position % CHUNK).

    Per chunk (c = cumulative log decay from the chunk start, D_ij = exp(c_i - c_j) for j <= i, else 0):
      A = diag(beta) (K K^T * D), strictly lower;  T = (I + A)^-1
      U = T diag(beta) V;  W = T diag(beta exp(c)) K           (the UT / WY form)
      then in order over chunks, S the [dv, dk] state entering the chunk:
      V' = U - W S^T;  O = diag(exp(c)) Q S^T + (Q K^T * D) V';  S = exp(c_last) S + V'^T diag(exp(c_last - c)) K
    The per-row scalings are applied to the C x C matrices or inside the loop, never to whole [.., C, d]
    copies of q / k / v. Zero padding rows (k = v = beta = g = 0) leave the state and the real rows untouched.
    Returns out [n, H, dv] fp32.
    """
    n = q.shape[0]
    total = lead + n
    tail = -total % CHUNK
    qc, kc, vc = (_pad_chunks(x, lead, tail) for x in (q, k, v))  # [N, H, C, d]
    bc, gc = (_pad_chunks(x, lead, tail) for x in (beta, g))  # [N, H, C]
    N, H = qc.shape[:2]
    dk, dv = kc.shape[-1], vc.shape[-1]
    cum = gc.cumsum(-1)  # [N, H, C] log-decay from the chunk start, inclusive
    cexp = cum.exp()
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [N, H, C, C]
    q3, k3, v3 = qc.view(-1, CHUNK, dk), kc.view(-1, CHUNK, dk), vc.view(-1, CHUNK, dv)
    kkt = torch.bmm(k3, k3.transpose(1, 2)).view(N, H, CHUNK, CHUNK)
    tinv = _unit_lower_inverse(kkt * decay * bc.unsqueeze(-1))
    u = torch.bmm((tinv * bc.unsqueeze(-2)).view(-1, CHUNK, CHUNK), v3).view(N, H, CHUNK, dv)
    w = torch.bmm((tinv * (bc * cexp).unsqueeze(-2)).view(-1, CHUNK, CHUNK), k3).view(N, H, CHUNK, dk)
    attn = torch.bmm(q3, k3.transpose(1, 2)).view(N, H, CHUNK, CHUNK) * decay  # causal: decay is 0 above the diagonal
    kdec = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # [N, H, C, 1]
    qdec = cexp.unsqueeze(-1)
    cd = cexp[..., -1, None, None]  # [N, H, 1, 1]
    out = torch.empty(N, H, CHUNK, dv, dtype=torch.float32, device=q.device)
    for i in range(N):
        st = state.transpose(-1, -2)  # [H, dk, dv]
        v_new = torch.baddbmm(u[i], w[i], st, alpha=-1.0)  # [H, C, dv]
        o = torch.bmm(qc[i], st, out=out[i])
        o.mul_(qdec[i]).baddbmm_(attn[i], v_new)
        state.mul_(cd[i]).baddbmm_((v_new * kdec[i]).transpose(-1, -2), kc[i])  # [H, dv, dk]
    out = out.transpose(1, 2).reshape(N * CHUNK, H, dv)
    return out[lead:lead + n]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, start_pos: int = 0,
                           use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of ONE sequence, chunked (WY/UT form) on the absolute 64-token grid.

    q, k [L, Hk, dk]; v [L, H, dv]; g (log decay, <= 0) and beta [L, H]; Hk divides H (grouped heads).
    initial_state [H, dv, dk] (any float dtype; not modified) or None (zeros). start_pos: the absolute
    position of q[0], which fixes the chunk grid. Returns (out [L, H, dv] in q's dtype, final state
    [H, dv, dk] float32).
    """
    L, H, dv = v.shape
    dk = q.shape[-1]
    if initial_state is None:
        state = torch.zeros(H, dv, dk, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32, copy=True)  # updated in place below
    out = torch.empty(L, H, dv, dtype=q.dtype, device=q.device)
    s = 0
    while s < L:
        a = start_pos + s
        e = min((a // SLICE + 1) * SLICE - start_pos, L)
        qs, ks, vs, gs, bs = _prepare(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], use_qk_l2norm)
        out[s:e] = _chunk_slice(qs, ks, vs, gs, bs, state, lead=a % CHUNK)
        s = e
    return out, state


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
