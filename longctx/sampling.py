"""Turning logits into tokens, batched on the logits' device: penalties, temperature, top-k,
top-p, min-p, greedy rows, per-request seeds, and the log-probabilities a request asks for.

Owns: the math of choosing a token for every row of a step's logits at once. Never: stopping
rules, request state, or which rows belong to whom (the engine says, per row).

One draw per row. A sampled row picks ``argmax(p / e)`` with ``e ~ Exp(1)`` drawn per token:
the "exponential race", an exact sample from ``p`` that needs no sort and no host sync, so a
batch of rows with different parameters is one pass of tensor ops. A row of a request with a
``seed`` draws its noise from a generator seeded with ``(seed, output position)``: the token
at output position ``i`` depends only on the seed, ``i`` and the row's distribution, so it
is the same whatever else is batched, and the same whether it was sampled by a plain decode
step or while verifying a lookahead draft (``longctx.lookahead.acceptance``).

Processing order (as HF's logits processors, then warpers): repetition penalty (prompt and
output tokens), presence and frequency penalties (output tokens), temperature, top-k, top-p,
min-p. A draft row's "output" includes the draft tokens on its path, so a verify step judges
each node against exactly the distribution plain decoding would have used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longctx.lookahead.tree import tree_depths
from longctx.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for output position ``position`` of a request seeded with ``seed``
    (splitmix64 of the pair, so neighbouring positions and seeds are unrelated)."""
    z = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


@dataclass
class PenaltyRows:
    """What the penalties need for each row, as device tensors built by ``penalty_rows``:
    ``counts`` [R, V] times each token occurs in the row's output (and draft path), ``seen``
    [R, V] whether it occurs in the prompt or there."""

    counts: torch.Tensor
    seen: torch.Tensor


@dataclass
class SamplingRows:
    """A step's sampling parameters, one entry per logits row (plain data, host side)."""

    params: list[SamplingParams]
    positions: list[int]  # output position of the token each row samples (seeds use it)
    penalties: PenaltyRows | None = None  # only when some row has a penalty
    num_logprobs: int = 0  # top log-probabilities to return per row (0: only if asked below)
    want_logprobs: bool = False

    @classmethod
    def of(cls, params: list[SamplingParams], positions: list[int] | None = None,
           penalties: PenaltyRows | None = None) -> "SamplingRows":
        positions = list(range(len(params))) if positions is None else list(positions)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(params, positions, penalties, max(asked, default=0), bool(asked))


@dataclass
class SampleResult:
    """Device tensors: ``tokens`` [R]; with logprobs, the chosen token's log-probability [R]
    and the top ``k`` ``top_ids``/``top_logprobs`` [R, k] (of the model's raw distribution,
    before penalties and temperature, as vLLM and OpenAI report them)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    host: dict = field(default_factory=dict)

    def to_host(self) -> "SampleResult":
        """The results as Python lists: one device-to-host copy per tensor present (one for a
        step without logprobs)."""
        self.host["tokens"] = self.tokens.tolist()
        if self.logprobs is not None:
            self.host["logprobs"] = self.logprobs.tolist()
            self.host["top_ids"] = self.top_ids.tolist()
            self.host["top_logprobs"] = self.top_logprobs.tolist()
        return self


def penalty_rows(prompt_ids: list[list[int]], output_ids: list[list[int]], vocab: int,
                 device: torch.device | str) -> PenaltyRows:
    """Per row: ``output_ids[r]`` counted, ``prompt_ids[r] + output_ids[r]`` marked seen.
    Built with one upload of the (row, token) pairs and two scatters."""
    rows = len(output_ids)
    counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    out_pairs = [(r, t) for r, ids in enumerate(output_ids) for t in ids]
    seen_pairs = [(r, t) for r, ids in enumerate(prompt_ids) for t in set(ids)]
    if out_pairs:
        idx = torch.tensor(out_pairs, dtype=torch.long).to(device, non_blocking=True)
        counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(out_pairs), dtype=torch.int32,
                                                             device=device), accumulate=True)
    if seen_pairs:
        idx = torch.tensor(seen_pairs, dtype=torch.long).to(device, non_blocking=True)
        seen[idx[:, 0], idx[:, 1]] = True
    seen |= counts > 0
    return PenaltyRows(counts, seen)


class ParamColumns:
    """The rows' parameters as one device tensor [R, 8], uploaded once per step (columns:
    temperature (1 for greedy rows), top-k (V when off), top-p, min-p, repetition, presence
    and frequency penalties, greedy flag); ``col(name)`` is a [R, 1] view."""

    NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "greedy")

    def __init__(self, params: list[SamplingParams], vocab: int, device: torch.device,
                 upload=None) -> None:
        host = torch.tensor([[p.temperature or 1.0, p.top_k if 0 < p.top_k < vocab else vocab,
                              p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                              p.frequency_penalty, float(p.greedy)] for p in params],
                            dtype=torch.float32)
        self.values = upload(host) if upload is not None else host.to(device, non_blocking=True)

    def col(self, name: str) -> torch.Tensor:
        i = self.NAMES.index(name)
        return self.values[:, i:i + 1]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], rows: PenaltyRows,
                    cols: ParamColumns | None = None) -> torch.Tensor:
    """Repetition penalty as HF's ``RepetitionPenaltyLogitsProcessor`` (over prompt and output:
    a seen token's logit is divided by the penalty if positive, multiplied if not), then
    presence and frequency penalties as OpenAI's (over the output: minus ``presence`` once,
    minus ``frequency`` per occurrence)."""
    cols = cols or ParamColumns(params, logits.shape[-1], logits.device)
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = cols.col("repetition_penalty")
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(rows.seen, penalised, logits)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        presence, frequency = cols.col("presence_penalty"), cols.col("frequency_penalty")
        counts = rows.counts.to(logits.dtype)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def warp(logits: torch.Tensor, params: list[SamplingParams], cols: ParamColumns | None = None) -> torch.Tensor:
    """Probabilities [R, V] (fp32) after temperature, top-k, top-p and min-p, row by row's own
    parameters. Greedy rows come out as temperature 1 (their probabilities are not used)."""
    vocab = logits.shape[-1]
    cols = cols or ParamColumns(params, vocab, logits.device)
    scaled = logits.float() / cols.col("temperature")
    if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        kth = sorted_logits.gather(1, cols.col("top_k").long() - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each token
        sorted_probs = sorted_probs.masked_fill(before >= cols.col("top_p"), 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    else:
        probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0 for p in params):
        floor = cols.col("min_p") * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] of one row after temperature, top-k, top-p and min-p (fp32)."""
    return warp(logits[None], [params])[0]


def exponential_noise(rows: SamplingRows, shape: tuple[int, int], device: torch.device,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) noise [R, V]: seeded rows from their (seed, position) generator, the others
    from ``generator`` (None: torch's default for the device) in one call."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.exponential_(generator=generator)
    for r, (p, pos) in enumerate(zip(rows.params, rows.positions)):
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=device).manual_seed(position_seed(p.seed, pos))
            noise[r].exponential_(generator=gen)
    return noise


class Sampler:
    """Samples a step's rows on the logits' device; the caller copies ``tokens`` to the host
    once (``SampleResult.to_host``)."""

    def __init__(self, generator: torch.Generator | None = None, upload=None) -> None:
        self.generator = generator  # for unseeded rows; None: torch's default generator
        self.upload = upload  # host -> device copy of the parameter columns (the runner counts it)

    def sample(self, logits: torch.Tensor, rows: SamplingRows) -> SampleResult:
        if logits.shape[0] != len(rows.params):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows.params)} sampling rows")
        params = rows.params
        raw = logits
        greedy = [p.greedy for p in params]
        if all(greedy) and rows.penalties is None:  # the common case: nothing to upload
            tokens = logits.argmax(dim=-1)
        else:
            cols = ParamColumns(params, logits.shape[-1], logits.device, self.upload)
            if rows.penalties is not None:
                logits = apply_penalties(logits.float(), params, rows.penalties, cols)
            if all(greedy):
                tokens = logits.argmax(dim=-1)
            else:
                probs = warp(logits, params, cols)
                noise = exponential_noise(rows, tuple(probs.shape), probs.device, self.generator)
                tokens = (probs / noise).argmax(dim=-1)
                if any(greedy):
                    tokens = torch.where(cols.col("greedy")[:, 0] > 0, logits.argmax(dim=-1), tokens)
        result = SampleResult(tokens)
        if rows.want_logprobs:
            logp = torch.log_softmax(raw.float(), dim=-1)
            top = torch.topk(logp, rows.num_logprobs, dim=-1)
            result.logprobs = logp.gather(1, tokens[:, None])[:, 0]
            result.top_ids, result.top_logprobs = top.indices, top.values
        return result


def sample(logits: torch.Tensor, params: list[SamplingParams],
           positions: list[int] | None = None) -> list[int]:
    """One token per row of ``logits`` [R, V] (row ``r`` at output position ``positions[r]``,
    default ``r``), as a list."""
    return Sampler().sample(logits, SamplingRows.of(params, positions)).tokens.tolist()


class PenaltyState:
    """Each penalised request's token statistics on the device, kept between steps so a step
    uploads only the tokens added since the last one: ``seen`` [V] (prompt or output) and
    ``counts`` [V] (output). Keyed by request id; ``forget`` when the request ends."""

    def __init__(self, vocab: int, device: torch.device | str) -> None:
        self.vocab, self.device = vocab, torch.device(device)
        self._state: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def _update(self, request_id: str, prompt_ids: list[int], output_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._state.get(request_id)
        if found is None or found[2] > len(output_ids):  # new (or restarted): from the prompt
            seen = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
            seen[_upload(sorted(set(prompt_ids)), self.device)] = True
            found = (seen, torch.zeros(self.vocab, dtype=torch.int32, device=self.device), 0)
        seen, counts, done = found
        new = output_ids[done:]
        if new:
            idx = _upload(new, self.device)
            counts.index_put_((idx,), torch.ones(len(new), dtype=torch.int32, device=self.device),
                              accumulate=True)
            seen[idx] = True
        self._state[request_id] = (seen, counts, len(output_ids))
        return seen, counts

    def rows(self, seqs: list["SeqSampling"]) -> PenaltyRows:
        """Rows for ``seqs`` in order (``1 + num_draft`` rows each): the request's statistics
        plus, for a draft node's row, the draft tokens on the path to that node."""
        bases = [self._update(s.request_id, s.prompt_ids, s.output_ids) for s in seqs]
        which = [i for i, s in enumerate(seqs) for _ in range(s.num_rows)]
        index = _upload(which, self.device)
        seen = torch.stack([b[0] for b in bases])[index]
        counts = torch.stack([b[1] for b in bases])[index]
        pairs = [(row, token) for row, path in enumerate(p for s in seqs for p in s.row_paths())
                 for token in path]
        if pairs:
            idx = _upload(pairs, self.device)
            counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(pairs), dtype=torch.int32,
                                                                 device=self.device), accumulate=True)
            seen[idx[:, 0], idx[:, 1]] = True
        return PenaltyRows(counts, seen)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


def _upload(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


@dataclass
class SeqSampling:
    """One sampling sequence of a step, as the engine hands it to the runner (no ``Request``):
    its parameters, the output position of its first sampled token, its draft (parents of
    the draft nodes, whose tokens are ``draft_ids``) and, for penalties, its token history."""

    request_id: str
    params: SamplingParams
    position: int
    draft_ids: tuple[int, ...] = ()
    draft_parents: tuple[int, ...] = ()
    prompt_ids: list[int] = field(default_factory=list)  # only read with penalties
    output_ids: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft_parents)

    def depths(self) -> list[int]:
        return tree_depths(self.draft_parents)

    def row_paths(self) -> list[list[int]]:
        """Per row, the draft tokens its context adds to the output (root: none)."""
        paths: list[list[int]] = [[]]
        for token, parent in zip(self.draft_ids, self.draft_parents):
            paths.append(paths[parent + 1] + [token])
        return paths


def sampling_rows(seqs: list[SeqSampling], penalties: PenaltyState | None) -> SamplingRows:
    """The per-row parameters of ``seqs`` (``1 + num_draft`` rows each, root first)."""
    params = [s.params for s in seqs for _ in range(s.num_rows)]
    positions = [s.position + d for s in seqs for d in s.depths()]
    pen = None
    if penalties is not None and any(s.params.has_penalties for s in seqs):
        pen = penalties.rows(seqs)
    return SamplingRows.of(params, positions, pen)
