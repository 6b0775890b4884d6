"""The engine's side of lookahead decoding: one drafter per request and how much it may draft.

Owns: per-request drafters (fed every committed token), the shared pool of finished outputs
per document, the adaptive draft size and the stats. Never: torch, logits or KV (the engine
verifies and compacts; ``acceptance`` judges).

Adaptive size. A request starts drafting ``lookahead_max_tokens``. A step whose draft is
accepted in part sets the size to twice what was accepted (at least 2, at most the maximum);
a step with nothing accepted halves it. After ``MISSES_BEFORE_PAUSE`` fruitless steps in a
row the request stops drafting for a pause that doubles each time (up to ``MAX_PAUSE`` steps),
then probes again with a small draft. Text with nothing to copy therefore runs almost entirely
as plain decoding, and a copied span is picked up within a few steps of its start.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from longctx.config import LookaheadConfig
from longctx.lookahead.drafter import Drafter, DrafterConfig, SharedDraftPool
from longctx.lookahead.stats import LookaheadStats, LookaheadStatsTracker
from longctx.lookahead.tree import DraftTree

MISSES_BEFORE_PAUSE = 3
MAX_PAUSE = 64
PROBE_SIZE = 2
DOCUMENT_KEY_TOKENS = 1024  # requests whose prompts share this many first tokens share a pool


@dataclass
class _Draftee:
    drafter: Drafter
    size: int
    misses: int = 0
    pause: int = 0  # steps left without drafting
    next_pause: int = 4


class LookaheadController:
    def __init__(self, config: LookaheadConfig, drafter_config: DrafterConfig | None = None) -> None:
        self.config = config
        self.drafter_config = drafter_config or DrafterConfig()
        self.pool = SharedDraftPool(self.drafter_config)
        self.stats = LookaheadStatsTracker()
        self._requests: dict[str, _Draftee] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], shared: bool = True) -> None:
        """Start drafting for a request. ``shared``: also draft from other requests' outputs
        on the same document. Seeded sampling turns it off: its draws then depend only on the
        request's own tokens, so a seed reproduces whatever else ran before."""
        if shared:
            key: Hashable = hash(tuple(prompt_token_ids[:DOCUMENT_KEY_TOKENS]))
            drafter = Drafter(self.drafter_config, list(prompt_token_ids), self.pool, key)
        else:
            drafter = Drafter(self.drafter_config, list(prompt_token_ids))
        self._requests[request_id] = _Draftee(drafter, self.config.lookahead_max_tokens)

    def propose(self, request_id: str, max_tokens: int) -> DraftTree:
        """The draft for the request's next step (empty while it pauses or has no match)."""
        state = self._requests.get(request_id)
        if state is None or max_tokens <= 0:
            return DraftTree.empty()
        if state.pause:
            state.pause -= 1
            return DraftTree.empty()
        return state.drafter.propose(min(state.size, max_tokens), self.config.lookahead_max_branches)

    def commit(self, request_id: str, tokens: list[int], num_drafted: int, num_accepted: int) -> None:
        """The request committed ``tokens`` this step, ``num_accepted`` of them from a draft of
        ``num_drafted`` (0 for a plain step)."""
        state = self._requests.get(request_id)
        if state is None:
            return
        state.drafter.extend(tokens)
        if num_drafted:
            self.stats.record(request_id, num_drafted, num_accepted)
            self._adapt(state, num_accepted)

    def _adapt(self, state: _Draftee, num_accepted: int) -> None:
        top = self.config.lookahead_max_tokens
        if num_accepted:
            state.size = min(top, max(PROBE_SIZE, 2 * num_accepted))
            state.misses, state.next_pause = 0, 4
            return
        state.size = max(1, state.size // 2)
        state.misses += 1
        if state.misses >= MISSES_BEFORE_PAUSE:
            state.pause, state.misses = state.next_pause, 0
            state.next_pause = min(MAX_PAUSE, 2 * state.next_pause)
            state.size = PROBE_SIZE

    def finish(self, request_id: str) -> LookaheadStats | None:
        """Forget the request (publishing its output to the pool); its stats, if it drafted."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        if state.drafter.pool is not None:
            state.drafter.publish()
        return self.stats.finish(request_id)

    def request_stats(self, request_id: str) -> LookaheadStats:
        return self.stats.of(request_id)
