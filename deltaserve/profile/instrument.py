"""Instrument: the model's own forward, timed kernel by kernel (what the profiler's forward runs and
`deltaserve bench prefill` read)."""
from __future__ import annotations


def _kernel_maps(model) -> tuple[dict[int, str], dict[int, str], dict[object, tuple[str, str | None]]]:
    """(weight -> kernel: which projection a linear is, norm weight -> kernel, module -> (kernel, frame)): the
    names the instrumented forward gives what the layers call. Frames in layer order (hooks register in it)."""
    wmap: dict[int, str] = {}
    nmap: dict[int, str] = {id(model.norm): "final_norm"}
    frames: dict[object, tuple[str, str | None]] = {}
    for layer in model.layers:
        frames[layer] = ("layer", None)
        for n in ("input_layernorm", "post_attention_layernorm"):
            nmap[id(getattr(layer, n))] = "layer_norms"
        if layer.is_gdn:
            mx = layer.linear_attn
            frames[mx] = ("gdn_mixer", "gdn")
            wmap[id(mx.in_proj)] = "gdn_in_proj"
            wmap[id(mx.out_proj)] = "gdn_out_proj"
        else:
            am = layer.self_attn
            frames[am] = ("attn_mixer", "attn")
            wmap[id(am.qkv_proj)] = "attn_qkv_proj"
            wmap[id(am.o_proj)] = "attn_o_proj"
            nmap[id(am.q_norm)] = "attn_qk_norm_rope"
            nmap[id(am.k_norm)] = "attn_qk_norm_rope"
    return wmap, nmap, frames


class Instrument:
    """Times the model's own forward kernel by kernel, without touching the model: forward() runs it on a timed
    copy of its op table (model/ops/table.py: every op the layers call), and torch forward hooks on the mixers
    and layers (registered for the `with` block, removed after) time what runs between the ops.

    Every op and frame records its self time (inclusive time minus timed callees), so the self times of one
    forward add up to the forward's total; a frame's self time is its glue. Each op of the table has its kernel
    name in _rules; a table with an op missing there is refused, so a new or renamed op cannot hide its time
    in its caller's. Events are (kernel, key, microseconds).
    """

    def __init__(self, model, timer):
        if model.ops is None:
            model.select_decode_kernels()
        self.model, self.timer = model, timer
        self.stack: list[list] = []  # [frame, time of timed callees]
        self.events: list[tuple[str, object, float]] = []
        self._pending_gather = 0.0
        self.wmap, self.nmap, self.frames = _kernel_maps(model)
        missing = set(model.ops.names()) - set(self._rules())
        if missing:
            raise RuntimeError(f"the profiler has no kernel name for op(s) {sorted(missing)}: add them to "
                               f"Instrument._rules")
        self.ops = model.ops.wrapped(self._timed)
        self._hooks: list = []

    def _rules(self) -> dict[str, tuple]:
        """op name -> (kernel or kernel_of(args), key_of(args) or None, after or None)."""
        shape0 = lambda a: int(a[0].shape[0])  # noqa: E731

        def gather_after(us):  # a gather belongs to the attention call that reads it
            self._pending_gather += us
            return 0.0

        def attn_after(us):
            us, self._pending_gather = us + self._pending_gather, 0.0
            return us

        return {
            "linear": (lambda a: self.wmap.get(id(a[1]), "linear_other"), None, None),
            "rms_norm": (lambda a: self.nmap.get(id(a[1]), "layer_norms"), None, None),
            "add_rms_norm": (lambda a: self.nmap.get(id(a[2]), "layer_norms"), None, None),
            "rms_norm_gated": ("gdn_norm", None, None),
            "gdn_gates": ("gdn_glue", None, None),
            "gate_output": ("attn_gate", None, None),
            "swiglu": ("mlp", None, None),
            "moe": ("mlp", None, None),
            "qk_norm_rope": ("attn_qk_norm_rope", None, None),
            "kv_write": ("attn_kv_write", None, None),
            "kv_gather": ("attn_gather", None, gather_after),
            "prefill_attention": ("attn_prefill", lambda a: (int(a[0].shape[0]), int(a[3]) + int(a[0].shape[0])),
                                  attn_after),
            "decode_attention": ("attn_decode", lambda a: int(a[1].shape[0]), attn_after),
            "causal_conv1d_prefill": ("gdn_conv_prefill", shape0, None),
            "chunk_gated_delta_rule": ("gdn_prefill", shape0, None),
            "causal_conv1d_step": ("gdn_conv_decode", shape0, None),
            "recurrent_gated_delta_rule_step": ("gdn_decode", shape0, None),
            # the compiled decode kernels (ops/cpu_kernels.py): one call per layer for all decode sequences
            "paged_decode_attention": ("attn_decode", shape0, attn_after),
            "conv1d_decode_step": ("gdn_conv_decode", lambda a: int(a[1].shape[0]), None),
            "gdn_decode_step": ("gdn_decode", shape0, None),
        }

    def _timed(self, name: str, fn):
        kernel_of, key_of, after = self._rules()[name]
        timer, stack = self.timer, self.stack

        def op(*a, **k):
            t0 = timer()
            stack.append([None, 0.0])
            try:
                return fn(*a, **k)
            finally:
                incl = timer() - t0
                fr = stack.pop()
                if stack:
                    stack[-1][1] += incl
                us = (incl - fr[1]) * 1e6
                if after is not None:
                    us = after(us)
                kern = kernel_of(a) if callable(kernel_of) else kernel_of
                self.events.append((kern, key_of(a) if key_of else None, us))
        return op

    # ---- frames: the model, its layers and mixers
    def _enter(self, frame: str | None) -> None:
        self.stack.append([frame, 0.0, self.timer()])

    def _leave(self, kernel: str) -> None:
        fr = self.stack.pop()
        incl = self.timer() - fr[2]
        if self.stack:
            self.stack[-1][1] += incl
        self.events.append((kernel, None, (incl - fr[1]) * 1e6))

    def forward(self, batch, caches):
        """The model's forward on the timed op table, inside the "model" frame (embedding + step context)."""
        self._enter(None)
        try:
            return self.model.forward(batch, caches, ops=self.ops)
        finally:
            self._leave("model")

    def __enter__(self):
        for module, (kernel, frame) in self.frames.items():
            self._hooks.append(module.register_forward_pre_hook(lambda m, args, f=frame: self._enter(f)))
            self._hooks.append(module.register_forward_hook(lambda m, args, out, k=kernel: self._leave(k)))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.stack.clear()
        return False

    def take(self) -> list[tuple[str, object, float]]:
        ev, self.events = self.events, []
        return ev
