"""Lookahead decoding: draft continuations from text already seen, verify them in one pass.

    drafter.py     (no torch)  n-gram index per request, shared pool per document -> DraftTree
    tree.py        (no torch)  DraftTree: tokens, parents, depths, branches, tree-mask words
    acceptance.py  (torch)     greedy and lossless sampled acceptance on verify logits
    stats.py       (no torch)  drafted / accepted counters per request and overall

Importing this package never imports torch (the scheduler may use the drafter);
``accept_draft`` and ``Acceptance`` are loaded on first use. See docs/lookahead.md.
"""

from longctx.lookahead.drafter import Drafter, DrafterConfig, SharedDraftPool
from longctx.lookahead.stats import LookaheadStats, LookaheadStatsTracker
from longctx.lookahead.tree import DraftTree

__all__ = ["Acceptance", "DraftTree", "Drafter", "DrafterConfig", "LookaheadStats",
           "LookaheadStatsTracker", "SharedDraftPool", "accept_draft"]


def __getattr__(name: str):
    if name in ("Acceptance", "accept_draft"):
        from longctx.lookahead import acceptance

        return getattr(acceptance, name)
    raise AttributeError(f"module 'longctx.lookahead' has no attribute {name!r}")
