"""The plain data that crosses one engine step, in the order it flows::

    scheduler.schedule() -> SchedulerOutput          what runs, new requests, finished ids,
                                                     KV orders (draft compaction, tiers, disk)
    runner.execute(SchedulerOutput) -> RunnerOutput  sampled tokens, accepted drafts, logprobs,
                                                     disk reads that completed
    scheduler.update(SchedulerOutput, RunnerOutput) -> list[RequestUpdate]
                                                     tokens committed, finish reasons
    OutputProcessor.process(...) -> list[StepUpdate] text, stop strings, metrics (engine.py)

Owns: only these types. Never: torch, tensors or behaviour; every field is ints, strings,
lists or the sampling parameters, so a ``SchedulerOutput`` pickles to sequence-parallel ranks
as it is and the scheduler's side is tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from longctx.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step, as plain data for the runner."""

    request_id: str
    token_ids: list[int]  # tokens to compute now
    start_pos: int  # their first position (= tokens already cached)
    block_ids: list[int]  # the request's pages, covering start_pos + len(token_ids)
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    draft_parents: tuple[int, ...] = ()  # token_ids[1:] are draft nodes with these parents
    # prompt_logprobs: the prompt tokens that tokens start_pos, start_pos + 1, ... predict
    logprob_targets: tuple[int, ...] = ()
    tail_slot: int = -1  # where its newest exact K/V rows are kept (int8 pages), -1: nowhere
    # its first step on that slot past its first page (a prefix hit): the first page's tokens,
    # whose exact K/V the runner recomputes (``exact_tail.fill_first_pages``)
    sink_token_ids: tuple[int, ...] = ()
    rope_long: bool = False  # LongRoPE (Phi-3): its tokens turn by the long table

    @property
    def num_draft(self) -> int:
        return len(self.draft_parents)


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen: sent once, with its first scheduled step. The runner
    keeps what sampling needs (parameters, prompt, its own sampled tokens) until the request's
    id comes back in ``finished_ids``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class DraftMove:
    """An accepted draft branch to compact: the KV of node ``accepted[j]`` (position
    ``start_pos + 1 + accepted[j]``) moves to position ``start_pos + 1 + j``, in the request's
    pages ``block_ids`` and its exact-tail slot."""

    block_ids: list[int]
    start_pos: int
    accepted: list[int]
    tail_slot: int = -1


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's orders, run by the runner in this order: forget ``finished_ids``, take
    ``new_requests``, compact ``draft_moves`` (accepted in the step before), run the prefix
    store's ``kv_orders`` (tier copies), start ``disk_loads``, compute ``seqs``."""

    seqs: list[ScheduledSeq]
    preempted: list[str] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the last output, aborts too
    draft_moves: list[DraftMove] = field(default_factory=list)
    kv_orders: list = field(default_factory=list)  # tier copies to run before the forward, in order
    disk_loads: list = field(default_factory=list)  # disk reads to start (requests now LOADING)
    wait_for_disk: bool = False  # nothing to compute but requests wait for disk reads

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampledSeq:
    """What a step sampled for one sequence: the accepted draft tokens, then the token that
    follows them (a plain step: that one token); the draft's size and the nodes kept, in order;
    per token, when the request asked, ``{token id: logprob}`` with its own and the top ones."""

    token_ids: list[int]
    num_drafted: int = 0
    accepted_nodes: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledSeq] = field(default_factory=dict)
    # prompt_logprobs: per request, (position of the first prompt token they are for, entries)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    finished_loads: list[Any] = field(default_factory=list)  # disk reads done and written


@dataclass
class RequestUpdate:
    """What ``scheduler.update`` committed for one request of the step: its new tokens (cut at
    a stop token, ``max_tokens`` or the window) and, if it ended, why."""

    request_id: str
    new_token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    logprobs: list[dict[int, float]] | None = None  # per new token, when asked
