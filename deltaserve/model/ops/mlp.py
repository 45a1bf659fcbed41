"""SwiGLU MLP and the sparse MoE block with a shared expert (qwen3_5_moe / qwen3_next).

Weights are held fused: gate_up [2I, H] = cat(gate_proj, up_proj) (one GEMM), experts stacked as
transformers 5.x holds them: experts_gate_up [E, 2I, H], experts_down [E, H, I].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import linear
from .pointwise import sigmoid, silu_mul


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act=silu_mul) -> torch.Tensor:
    """x [T, H]; gate_up [2I, H]; down [H, I] -> down(silu(gate(x)) * up(x)) [T, H]. act: the [T, 2I] -> [T, I]
    activation (the op table passes the compiled one where the kernels are loaded)."""
    return linear(act(linear(x, gate_up)), down)


def swiglu_reference(x, gate_proj, up_proj, down_proj):
    """transformers' Qwen3_5MLP with separate projections."""
    return F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: softmax over experts in fp32, top-k, optional renormalisation. Returns (weights [T, k] in x's
    dtype, expert ids [T, k])."""
    logits = linear(x, router)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def moe(x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor,
        top_k: int, norm_topk_prob: bool, shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse MoE block. x [T, H]; router [E, H]; experts_gate_up [E, 2I, H]; experts_down [E, H, I];
    the shared expert (gate_up [2Is, H], down [H, Is]) is scaled by sigmoid(shared_gate [1, H] . x).

    Experts run in ascending id order over the tokens routed to them and accumulate with index_add_, as
    transformers' eager experts do.
    """
    top_w, top_i = route(x, router, top_k, norm_topk_prob)
    out = torch.zeros_like(x)
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.where(top_i == e)
        h = swiglu(x[tok], experts_gate_up[e], experts_down[e]) * top_w[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    if shared_gate_up is not None:
        shared = swiglu(x, shared_gate_up, shared_down)
        if shared_gate is not None:
            shared = sigmoid(linear(x, shared_gate)) * shared
        out = out + shared
    return out


def moe_reference(x, router, experts_gate_up, experts_down, top_k, norm_topk_prob,
                  shared_gate_up=None, shared_down=None, shared_gate=None):
    """Dense evaluation: every expert on every token, weighted by its (masked) routing weight."""
    top_w, top_i = route(x, router, top_k, norm_topk_prob)
    E = router.shape[0]
    dense_w = torch.zeros(x.shape[0], E, dtype=top_w.dtype, device=x.device).scatter(1, top_i, top_w)
    out = torch.zeros_like(x)
    for e in range(E):
        out = out + swiglu(x, experts_gate_up[e], experts_down[e]) * dense_w[:, e:e + 1]
    if shared_gate_up is not None:
        shared = swiglu(x, shared_gate_up, shared_down)
        if shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, shared_gate)) * shared
        out = out + shared
    return out
