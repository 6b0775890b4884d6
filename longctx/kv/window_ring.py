"""Sliding-window layers' KV freed as the window moves: a ring of pages per running sequence.

A layer with a sliding window of W tokens (Mistral, Gemma 2/3, Phi-3) never reads a key more
than W - 1 positions behind its query, so with ``CacheConfig.window_kv="free"`` those layers do
not keep a sequence's whole context: each running sequence gets a ring of ``pages_per_seq``
pages in the windowed layers' own caches, and the token at position p lives in ring page
``(p // BS) % pages_per_seq`` of its sequence's ring (the ring of its ``tail_slot``: one per
running request, ``max_num_seqs`` in all). A page is overwritten when the ring comes round to
it, by which time no query can see it: the kernels start each sequence at its window's first
key (``reference.py``'s window convention) and never read a page below it.

How many pages: a step's new tokens of one sequence (at most ``chunk`` of them, which the
scheduler holds to) see keys from W - 1 before the first of them to the last, so ``ceil((W - 1 +
chunk) / BS) + 1`` pages (the +1: a span that starts mid-page) cover every key any step reads.
For W = 1,024, a 1,024-token chunk and 16-token pages that is 129 pages, 2,064 tokens per
sequence, against the whole context in every global layer.

The global layers keep the shared pool's pages as before. Prefix caching needs every layer's
pages for the prefix it serves, which the ring does not keep; the engine therefore keeps the
windowed layers in the shared pool when prefix caching is on (``window_kv="auto"``) and refuses
``window_kv="free"`` with it.

Owns: the ring's geometry (``WindowRing``) and a step's ring block table and slots. Never: the
bytes (``DeviceKVPool`` allocates them) or which request holds which slot (the scheduler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_RING_CHUNK = 256  # a ring's chunk is at least this (or the step budget, if smaller)


@dataclass(frozen=True)
class WindowRing:
    """The geometry of the windowed layers' rings: ``layers`` (their indices), ``window``
    (the largest of their windows), ``chunk`` (the most new tokens of one sequence per step)
    and ``pages_per_seq``; ``num_slots`` rings."""

    layers: tuple[int, ...]
    window: int
    chunk: int
    block_size: int
    num_slots: int

    @classmethod
    def for_model(cls, model, block_size: int, num_slots: int, max_step_tokens: int) -> "WindowRing | None":
        """The ring for ``model`` (a ModelConfig), or None when no layer has a window."""
        layers = tuple(i for i in range(model.num_hidden_layers) if model.layer_window(i) is not None)
        if not layers:
            return None
        window = max(model.layer_window(i) for i in layers)
        chunk = min(max_step_tokens, max(window, MIN_RING_CHUNK))
        return cls(layers, window, chunk, block_size, num_slots)

    @property
    def pages_per_seq(self) -> int:
        return math.ceil((self.window - 1 + self.chunk) / self.block_size) + 1

    @property
    def num_pages(self) -> int:
        return self.num_slots * self.pages_per_seq

    def page(self, slot: int, block: int) -> int:
        """The ring page of a sequence's logical block ``block`` (its tokens ``block * BS`` on)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"window ring slot {slot} is outside [0, {self.num_slots})")
        return slot * self.pages_per_seq + block % self.pages_per_seq

    def table_row(self, slot: int, num_blocks: int, first_key: int = 0) -> list[int]:
        """A block-table row over the ring for ``num_blocks`` logical blocks. Blocks below the
        one holding ``first_key`` (the first key the step's queries see) are not read by any
        kernel: they point at the ring's first page, so a row costs the window, not the context."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"window ring slot {slot} is outside [0, {self.num_slots})")
        base, per = slot * self.pages_per_seq, self.pages_per_seq
        first = min(max(0, first_key) // self.block_size, num_blocks)
        return [base] * first + [base + b % per for b in range(first, num_blocks)]

    def first_key(self, start_pos: int) -> int:
        """The first key a step whose first new token is at ``start_pos`` reads in any windowed
        layer (its window's start; a draft node sits at or past it)."""
        return max(0, start_pos - self.window + 1)

    def slots(self, slot: int, positions: range | list[int]) -> list[int]:
        """KV slots (page * BS + offset) of ``positions`` in ``slot``'s ring."""
        bs = self.block_size
        return [self.page(slot, p // bs) * bs + p % bs for p in positions]
