"""Acceptance for lookahead decoding: which drafted tokens one verify pass confirms, and the
token that follows them.

Owns: the greedy rule and the lossless sampled rule, applied to one request's verify logits.
Never: drafting, KV bookkeeping, stop rules or batching (the engine hands each request its own
rows, and cuts the committed tokens at a stop token or ``max_tokens``).

Rows. The verify pass feeds the root (the last committed token, query 0) and then the draft
nodes (node ``i`` is query ``i + 1``), so ``logits`` is ``[n + 1, V]``: row 0 is the
next-token distribution after the committed sequence, row ``i + 1`` the distribution after the
committed sequence followed by the tokens of the path root .. node ``i``.

One token per row. The sampler (``longctx.sampling``) picks a token for every row exactly as
plain decoding would at that position (greedy: the argmax; sampled: one draw from the row's
processed distribution ``p``, seeded by the request's seed and the output position). From the
root, follow the child whose token is the row's pick; stop at a node with no such child: its
pick is the bonus token. So the rows are sampled in one batched pass on the device, and the
walk needs only the picked tokens on the host.

Why this is lossless. Every committed token is the pick of the row after exactly the tokens
before it, a draw from that row's distribution: what plain sampling emits at that position.
A draft child is accepted with probability ``p(child)`` (the pick equals it), siblings
together with ``sum p(children)``, the same as speculative sampling's rule for deterministic
drafts (accept ``x`` with ``min(1, p(x)/q(x))``, ``q`` one-hot, and on rejection sample from
the residual ``p`` without ``x``); the bonus after a rejection is a draw from ``p`` given it
is none of the children, which is that residual. With a seed the committed tokens are even
the same tokens plain sampling draws, whether or not lookahead runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.lookahead.tree import ROOT, DraftTree
from longctx.sampling import sample
from longctx.sampling_params import SamplingParams


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: list[int]  # draft node indices, a path from a child of the root down
    tokens: list[int]  # committed this step: the accepted nodes' tokens, then the bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def bonus_token(self) -> int:
        return self.tokens[-1]

    @property
    def kept_queries(self) -> list[int]:
        """Verify queries whose KV stays valid: the root and the accepted nodes, in order."""
        return [0] + [node + 1 for node in self.accepted_nodes]


def accept_tokens(tree: DraftTree, row_tokens: list[int]) -> Acceptance:
    """Walk ``tree`` with the token picked for each verify row (``[len(tree) + 1]``: root,
    then node ``i`` at ``i + 1``)."""
    if len(row_tokens) != len(tree) + 1:
        raise ValueError(f"need one picked token per verify row ({len(tree) + 1}), got {len(row_tokens)}")
    node, accepted = ROOT, []
    while True:
        pick = row_tokens[node + 1]
        matching = [c for c in tree.children(node) if tree.token_ids[c] == pick]
        if not matching:
            return Acceptance(accepted, [tree.token_ids[n] for n in accepted] + [pick])
        node = matching[0]
        accepted.append(node)


def accept_draft(logits: torch.Tensor, tree: DraftTree, params: SamplingParams,
                 position: int = 0) -> Acceptance:
    """Judge ``tree`` against its verify ``logits`` [len(tree) + 1, V] (rows as the module
    docstring says); the root's token is output position ``position``."""
    _check_verify_logits(logits, tree)
    positions = [position + d for d in [0, *tree.depths()]]
    picks = sample(logits, [params] * logits.shape[0], positions)
    return accept_tokens(tree, picks)


def _check_verify_logits(logits: torch.Tensor, tree: DraftTree) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"verify logits must be [len(tree) + 1, V] = [{len(tree) + 1}, V], "
                         f"got {list(logits.shape)}")
    if tree.token_ids and max(tree.token_ids) >= logits.shape[1]:
        raise ValueError(f"draft token {max(tree.token_ids)} is outside the vocabulary of "
                         f"{logits.shape[1]} logits")

