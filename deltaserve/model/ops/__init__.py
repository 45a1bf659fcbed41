"""Plain-torch ops of the hybrid models, each with a reference implementation beside it.

gdn.py        gated delta rule: chunked prefill (64-token chunks on the absolute grid), recurrent decode step
conv.py       causal depthwise conv1d + SiLU: prefill with a [K-1, C] state, one-step batched decode update
norm.py       the RMSNorm variants (zero-centred (1 + w), gated norm(x) * silu(z))
attention.py  rotary, paged KV write / gather, tiled prefill attention, per-sequence decode attention
mlp.py        SwiGLU MLP and the sparse MoE block with a shared expert
cpu_kernels.py  compiled C++ decode kernels (csrc/decode_kernels.cpp: paged attention through the page tables,
              GDN step and conv step through the slot ids), chosen once per model; the torch ops above are
              their references and the fallback
"""
