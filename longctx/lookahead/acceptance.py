"""Acceptance for lookahead decoding: which drafted tokens one verify pass confirms, and the
token that follows them.

Owns: the greedy rule and the lossless sampled rule, applied to one request's verify logits.
Never: drafting, KV bookkeeping, stop rules or batching (the engine hands each request its own
rows, and cuts the committed tokens at a stop token or ``max_tokens``).

Rows. The verify pass feeds the root (the last committed token, query 0) and then the draft
nodes (node ``i`` is query ``i + 1``), so ``logits`` is ``[n + 1, V]``: row 0 is the
next-token distribution after the committed sequence, row ``i + 1`` the distribution after the
committed sequence followed by the tokens of the path root .. node ``i``.

Greedy (temperature 0). From the root, follow the child whose token is the row's argmax; stop
at a node with no such child, whose argmax is the bonus token. Every committed token is the
argmax after the tokens before it: exactly what plain greedy decoding emits.

Sampled (temperature > 0). ``p`` is a row's processed distribution (``filtered_probs``:
temperature, top-k, top-p, as plain sampling uses). The draft is deterministic (one token per
child, q = one-hot), so speculative sampling's rule "accept x with probability
min(1, p(x) / q(x)), else sample from norm(max(p - q, 0))" becomes, for children
``x1 .. xm`` tried in order with a residual ``r`` that starts as ``p``::

    accept x_j with probability r(x_j) / sum(r)        (one uniform u_j: u_j * sum(r) < r(x_j))
    on rejection set r(x_j) = 0                          (renormalising is implicit)
    all rejected: the bonus token is sampled from r      (p without the rejected tokens)

Then P(emit x_1) = p(x_1); P(emit x_2) = (1 - p(x_1)) * p(x_2) / (1 - p(x_1)) = p(x_2); and
any other token y is emitted with probability (1 - sum p(x_j)) * p(y) / (1 - sum p(x_j)) =
p(y). An accepted child continues the walk with its own row, the target's conditional
distribution, so by induction every committed token is distributed exactly as in plain
sampling. A token with p = 0 (filtered out) is never accepted. Random draws, in order: one
uniform per child tried (stopping at the first accepted), one multinomial draw for the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.lookahead.tree import ROOT, DraftTree
from longctx.sampling import filtered_probs
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


def accept_draft(logits: torch.Tensor, tree: DraftTree, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Acceptance:
    """Judge ``tree`` against its verify ``logits`` [len(tree) + 1, V] (rows as the module
    docstring says). Greedy params ignore ``generator``; sampled params draw from it (None:
    torch's global generator, as ``sample`` does)."""
    _check_verify_logits(logits, tree)
    if params.greedy:
        return _accept_greedy(logits, tree)
    return _accept_sampled(logits, tree, params, generator)


def _check_verify_logits(logits: torch.Tensor, tree: DraftTree) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"verify logits must be [len(tree) + 1, V] = [{len(tree) + 1}, V], "
                         f"got {list(logits.shape)}")
    if tree.token_ids and max(tree.token_ids) >= logits.shape[1]:
        raise ValueError(f"draft token {max(tree.token_ids)} is outside the vocabulary of "
                         f"{logits.shape[1]} logits")


def _accept_greedy(logits: torch.Tensor, tree: DraftTree) -> Acceptance:
    argmax = logits.argmax(dim=-1).tolist()  # per row, first maximum on ties (as ``sample``)
    node, accepted = ROOT, []
    while True:
        target = argmax[node + 1]
        matching = [c for c in tree.children(node) if tree.token_ids[c] == target]
        if not matching:
            return _acceptance(tree, accepted, target)
        node = matching[0]
        accepted.append(node)


def _accept_sampled(logits: torch.Tensor, tree: DraftTree, params: SamplingParams,
                    generator: torch.Generator | None) -> Acceptance:
    node, accepted = ROOT, []
    while True:
        probs = filtered_probs(logits[node + 1], params).to("cpu", torch.float64)
        children = tree.children(node)
        chosen, residual = try_children(probs, [tree.token_ids[c] for c in children], generator)
        if chosen is None:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return _acceptance(tree, accepted, bonus)
        node = children[chosen]
        accepted.append(node)


def try_children(probs: torch.Tensor, child_tokens: list[int],
                 generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
    """Speculative sampling at one node for deterministic drafts ``child_tokens`` (distinct).

    ``probs`` [V] is the target distribution (float64). Returns the index of the accepted
    child, or None with the residual (``probs`` without the rejected tokens, unnormalised)
    that the bonus token must be sampled from.
    """
    residual = probs.clone()
    for i, token in enumerate(child_tokens):
        uniform = torch.rand((), dtype=torch.float64, generator=generator)
        if uniform * residual.sum() < residual[token]:
            return i, residual
        residual[token] = 0.0
    return None, residual


def _acceptance(tree: DraftTree, accepted: list[int], bonus: int) -> Acceptance:
    return Acceptance(accepted, [tree.token_ids[n] for n in accepted] + [bonus])
