"""Plain-torch ops of the hybrid models, each with a reference implementation beside it.

gdn.py        gated delta rule: chunked prefill (64-token chunks on the absolute grid), recurrent decode step
conv.py       causal depthwise conv1d + SiLU: prefill with a [K-1, C] state, one-step batched decode update
norm.py       the RMSNorm variants (zero-centred (1 + w), gated norm(x) * silu(z))
attention.py  rotary, paged KV write / gather, tiled prefill attention, per-sequence decode attention
mlp.py        SwiGLU MLP and the sparse MoE block with a shared expert
"""
