"""llama-server's prompts in its own tokens, for `bench agents`.

The share a turn read from the cache is its cached tokens over the prefix its prompt shares with an earlier one.
Both must be counted in the tokens of the server that ran it: llama-server renders a request with its own
conversion of the API (Anthropic Messages and Responses become chat messages there), its own template engine and
its own tokenizer, so deltaserve's rendering of the same body is not its prompt (Codex CLI's requests, for one,
come out 2.3k tokens apart).

llama-server keeps each slot's last task and, when started with LLAMA_SERVER_SLOTS_DEBUG=1 (which makes `GET /slots`
say more, keeps a copy of the generated text and logs the tokens where a prompt leaves a slot's cache), reports its prompt there as text: its tokens
detokenized, special tokens included. A task's counts are reset when it ends, so they cannot name the task; the
metering proxy reads /slots as soon as a main request's answer has arrived, before the client can send its next
request, and turns the idle slots' prompts back into ids with `/tokenize` (special tokens parsed, none added: the
text already holds them), newest task first: the first that has the answer's prompt count is the request's (the
newest, where the answer gave no count). A task is claimed once. A request no slot matches is left unmeasured (`own_ids` None), never filled in with another
server's tokens.
"""
from __future__ import annotations

import threading

import httpx

from .report import is_main


ENV = {"LLAMA_SERVER_SLOTS_DEBUG": "1"}  # llama-server's environment for /slots to give each slot's prompt


class SlotWatch:
    """Reads a llama-server's last prompt per slot after each main request (`after` is the proxy's hook)."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")
        self._client = httpx.Client(timeout=httpx.Timeout(30.0, read=600.0))
        self._claimed: set[int] = set()
        self._lock = threading.Lock()

    def own_ids(self, usage: dict) -> tuple[list[int] | None, str]:
        """The ids of the prompt the server just ran for an answer of usage's prompt count, and how they were
        found (or why not)."""
        prompt = usage.get("prompt")  # None: the answer gave no count (llama-server's Messages stream can skip
        # its message_start), so the newest idle task is taken unchecked
        try:
            slots = self._client.get(self.base + "/slots").json()
        except (httpx.HTTPError, ValueError) as e:
            return None, f"GET /slots failed: {e}"
        if any("id_task" in s and "prompt" not in s for s in slots):
            return None, "/slots gives no prompt text (llama-server runs without LLAMA_SERVER_SLOTS_DEBUG=1)"
        with self._lock:
            idle = sorted((s for s in slots if not s.get("is_processing") and "prompt" in s
                           and s.get("id_task") is not None and s["id_task"] not in self._claimed),
                          key=lambda s: -s["id_task"])  # newest first: the one that just ended
            seen = []
            for slot in idle:
                try:
                    r = self._client.post(self.base + "/tokenize", json={"content": slot["prompt"],
                                                                         "add_special": False, "parse_special": True})
                    ids = [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    return None, f"POST /tokenize failed: {e}"
                if prompt is None or len(ids) == prompt:
                    self._claimed.add(slot["id_task"])
                    return ids, f"slot {slot.get('id')}, task {slot['id_task']}" + (
                        " (the newest: the answer gave no prompt count)" if prompt is None else "")
                seen.append(len(ids))
        return None, f"no idle slot's last prompt has the answer's {prompt} tokens (theirs: {seen})"

    def after(self, record: dict) -> dict:
        """The proxy's hook, on a request's record once its answer has arrived: for a main request that was
        answered, its prompt in llama-server's tokens (`own_ids`, None where none could be read; `own_how` says
        how they were found or why not)."""
        if not is_main(record) or record.get("status") != 200:
            return {}
        ids, how = self.own_ids(record.get("usage") or {})
        return {"own_ids": ids, "own_how": how}

    def close(self) -> None:
        self._client.close()
