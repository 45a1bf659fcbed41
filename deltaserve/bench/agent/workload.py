"""The agent-replay workload: sessions that share a system prompt and re-send the whole conversation each
turn, and the per-turn result every driver returns."""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    new_tokens: list[int]  # appended to the conversation (user message / tool result) before this turn
    output_tokens: int
    answer_tokens: list[int] = field(default_factory=list)  # appended after this turn (the answer as re-sent)


def make_sessions(num_sessions: int, target_context: int, output_tokens: int, seed: int = 0,
                  vocab: int = 3000, new_frac: float = 0.05, start_frac: float = 0.125) -> tuple[list[int], list[list[Turn]]]:
    """(shared prefix, per-session turns). Turn 0's new tokens follow the shared prefix."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    start = max(2, int(target_context * start_frac))
    shared = ids(max(1, int(start * 0.6)))
    step = max(1, int(target_context * new_frac))
    sessions = []
    for s in range(num_sessions):
        turns, ctx, t = [Turn(s, 0, ids(start - len(shared)), output_tokens, ids(output_tokens))], start, 1
        while ctx + output_tokens + step + output_tokens <= target_context:
            ctx += output_tokens + step
            turns.append(Turn(s, t, ids(step), output_tokens, ids(output_tokens)))
            t += 1
        sessions.append(turns)
    return shared, sessions


def prompts_of(shared: list[int], turns: list[Turn]) -> list[list[int]]:
    """The prompt of every turn of one session."""
    out, convo = [], list(shared)
    for t in turns:
        convo += t.new_tokens
        out.append(list(convo))
        convo += t.answer_tokens
    return out


@dataclass
class TurnResult:
    arm: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    output_tokens: int
    sent_s: float = 0.0  # send time, from the arm's start
    ideal_s: float | None = None  # fresh prefill of `uncached` tokens alone
    ideal_wave_s: float | None = None  # ... together with the other hit turns waiting at the same time
    ideal_ctx_s: float | None = None  # cold TTFT of the prompt - cold TTFT of its cached prefix (sampled turns)

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.cached_tokens


