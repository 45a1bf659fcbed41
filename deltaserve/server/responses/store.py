"""Stored responses (store: true), so a client can continue a conversation by `previous_response_id`.

In memory, bounded by count: the oldest response is evicted first. What a response keeps is the conversation
up to and including its output, as template messages, plus the response object for GET /v1/responses/{id}.
The server only re-renders that conversation with the new input appended; it is the prefix cache that makes
the continuation cheap (the rendered prefix is the one the previous turn ran, so its pages and GDN
checkpoints are hits). An id that was evicted is remembered (a bounded list of ids) so the 400 can say it
was evicted rather than never existed.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import bad_request

DEFAULT_MAX_STORED = 1024


@dataclass
class StoredResponse:
    response: dict  # the response object as returned
    conversation: list[dict]  # template messages: its input (after the chain it continued) and its output


class ResponseStore:
    def __init__(self, max_items: int = DEFAULT_MAX_STORED):
        if max_items < 0:
            raise ValueError("the response store size must be >= 0")
        self.max_items = max_items
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[rid] = stored
            self._items.move_to_end(rid)
            while len(self._items) > self.max_items:
                old, _ = self._items.popitem(last=False)
                self._evicted[old] = None
                while len(self._evicted) > 4 * max(self.max_items, 256):
                    self._evicted.popitem(last=False)

    def get(self, rid: str, param: str = "previous_response_id") -> StoredResponse:
        """The stored response, or a 400 (param: the field that named it) saying why it is not there."""
        with self._lock:
            s = self._items.get(rid)
            evicted = rid in self._evicted
        if s is not None:
            return s
        if evicted:
            msg = (f"Response '{rid}' is no longer stored: this server keeps the last {self.max_items} stored "
                   "responses in memory and it was evicted. Send the whole conversation as input instead.")
        else:
            msg = (f"Previous response with id '{rid}' not found (never stored here -- store: false, another "
                   "server, or a restart; responses are kept in memory only).")
        raise bad_request(msg, param, "previous_response_not_found")

    def lookup(self, rid: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None
