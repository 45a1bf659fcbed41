"""decode@B's one definition, measured the same way for every engine from what its client sees.

B streams are started together. The decode phase begins at the first moment every stream holds its first token
(each stream's prefill is behind it) and ends when the last token arrives; its tokens are those that arrive after
it began, summed over the streams. An arm records arrivals as (time, stream, tokens the stream holds so far): the
in-process deltaserve arm after each engine step, the llama-server arm as each streamed event reaches the client.
An engine's own server-side counters (llama-server's `predicted_ms`) are not used: the longest stream's own
first-to-last time can include other streams' prefill, which this definition leaves out for every engine alike.
"""
from __future__ import annotations

from collections.abc import Iterable


def decode_phase(arrivals: Iterable[tuple[float, object, int]], streams: int) -> tuple[float, int]:
    """(seconds, tokens) of the decode phase of `streams` concurrent streams, from their arrivals (any order).

    A stream's count never goes down; a stream that never holds a token, or arrivals that end the moment the
    phase begins, leave no phase to measure (ValueError)."""
    events = sorted(arrivals, key=lambda a: a[0])
    held: dict[object, int] = {}
    start = at_start = None
    for t, stream, n in events:
        if n < held.get(stream, 0):
            raise ValueError(f"stream {stream!r} went from {held[stream]} tokens to {n}")
        held[stream] = n
        if start is None and len(held) == streams and all(v >= 1 for v in held.values()):
            start, at_start = t, sum(held.values())
    if len(held) > streams:
        raise ValueError(f"arrivals name {len(held)} streams, expected {streams}")
    if start is None:
        raise ValueError(f"not every one of the {streams} streams got a first token")
    end, total = events[-1][0], sum(held.values())
    if end <= start or total <= at_start:
        raise ValueError("no token arrived after every stream held its first one")
    return end - start, total - at_start
