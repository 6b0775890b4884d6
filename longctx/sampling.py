"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Owns: the math of choosing a token. Never: stopping rules or request state.

A request with a seed owns a ``torch.Generator`` seeded once, so its tokens are reproducible
whatever else is in the batch.
"""

from __future__ import annotations

import torch

from longctx.sampling_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (fp32)."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [N, V]."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    tokens = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            tokens.append(int(row.argmax()))
        else:
            probs = filtered_probs(row, p)
            tokens.append(int(torch.multinomial(probs.cpu(), 1, generator=gen)))
    return tokens
