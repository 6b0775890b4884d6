"""The scheduler: which requests run this step, how many tokens each computes, which pages.

Owns: the waiting and running queues, the token budget, page allocation through the
``BlockPool``, preemption. Never: torch, tensors, or sampling.

One accounting rule covers everything: a request has ``num_tokens`` (prompt + output so far)
and ``num_computed_tokens`` (those whose KV is in the cache). Each step a request computes
``min(num_tokens - num_computed_tokens, budget left)`` tokens. A prefill chunk and a decode
step are the same subtraction; a request whose step reaches ``num_tokens`` samples a token.

Step order, each part only while budget, pages and ``max_num_seqs`` allow:
  1. running requests whose pending tokens all fit (decodes, last chunks), fewest first;
  2. waiting requests, in arrival order, whose whole prompt fits what is left (a short question
     gets its first token in this step instead of waiting out a long document's prefill);
  3. the other running requests (the next chunk of a long prefill);
  4. waiting requests in arrival order, as chunks.
A document's prefill therefore never stalls running streams or short newcomers, and gets
every token of budget they leave, up to ``busy_prefill_chunk`` tokens while the step also gives
other requests a token (and a newcomer counts as short only if its prompt fits that): a step's
time is set by its longest chunk, so a big chunk beside a decode or a short prompt would delay
their token by seconds on a CPU. Alone, a prefill takes whole ``max_num_batched_tokens``
chunks.

Latency mode (``prefill_step_cost`` > 0, for serving on slow devices). A step's time is set
by its prefill work, so that work is bounded: every prefill chunk, alone or not, is cut so the
step's prefill tokens cost at most ``prefill_step_cost``, where a token computed after ``c``
others costs ``1 + c / context_cost`` (its linear layers plus its attention; ``context_cost``
comes from the model's shape). Deep into a long document the chunks get short, so a request
arriving meanwhile waits at most one such step. A step that gives a newcomer its first token
runs no other prefill chunk, and only decodes go before newcomers. Decodes are never capped.
The price is the long prefill's own speed: more, smaller steps.

Lookahead drafts. With a ``drafter`` (``longctx.lookahead.LookaheadController``) each
``schedule`` first asks it for a draft tree for every decoding request. Its step then computes
the request's last token plus the draft nodes (their KV goes to the next slots in node order),
and they count against the token budget; a draft that does not fit is cut to a prefix of its
nodes (still a tree). A step that also runs a prefill chunk longer than ``MAX_VERIFY_TOKENS``
drops its drafts, since tree masks cover at most that many new tokens per sequence. The
runner judges the draft; ``update`` counts the accepted nodes computed and orders their KV
compacted next to the last token (a ``DraftMove`` in the next ``SchedulerOutput``).

When pages run out, cached prefix pages nobody uses are evicted first (see
``longctx.kv.prefix_cache``); then the most recently admitted running request that has not been
scheduled this step is preempted: its pages are freed, ``num_computed_tokens`` drops to 0, and
it goes back to the front of the waiting queue to be recomputed (prompt and output so far)
later.

With a prefix cache, a request's computed full pages are indexed as they complete (so a
request arriving later shares them even while the first is still prefilling), and again when
it finishes or is preempted. At admission its longest cached prefix counts as computed. The
waiting queue is then served longest cached prefix first among its first ``ORDER_WINDOW``
requests; a preempted request, or one passed over ``MAX_SKIPS`` times, goes first, so no one
starves.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice
from typing import Any

from longctx.cache.block_pool import BlockPool
from longctx.config import SchedulerConfig
from longctx.engine.outputs import (DraftMove, NewRequest, RequestUpdate, RunnerOutput, SampledSeq, ScheduledSeq,
                             SchedulerOutput)
from longctx.sampling_params import SamplingParams

MAX_VERIFY_TOKENS = 63  # new tokens per sequence a tree-masked step may have (kernels' limit)
ORDER_WINDOW = 16  # waiting requests compared for cache-aware ordering
MAX_SKIPS = 4  # admissions that may overtake a waiting request before it goes first


class RequestStatus(Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted with a prefix on disk: waits for its pages to be read
    RUNNING = "running"
    FINISHED = "finished"


class RequestTooLongError(ValueError):
    """A request that could never be served with this model and cache."""


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None  # requests with different salts never share KV
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    cache_node: Any = None  # the prefix cache's lock for this request
    num_indexed_pages: int = 0  # full pages handed to the prefix cache so far
    num_skips: int = 0  # times a later request was admitted first
    draft_token_ids: list[int] = field(default_factory=list)  # lookahead draft for the next step
    draft_parents: list[int] = field(default_factory=list)  # -1: the last token; else a draft node
    disk_load: Any = None  # while LOADING: the prefix store's ``DiskLoad`` of its pages
    disk_tried: bool = False  # its disk pages were read once: the disk is not probed again
    tail_slot: int = -1  # while it has pages: its exact-tail slot (``longctx.kv.exact_tail``)
    stop_token_ids: frozenset[int] = frozenset()  # sampling one of these ends the request
    announced: bool = False  # the runner has its ``NewRequest``
    rope_long: bool = False  # LongRoPE: past the original window, every token on the long table

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


def chunk_cost(num_new: int, start: int, context_cost: float) -> float:
    """The work of computing tokens ``start .. start + num_new`` in tokens at zero context:
    each token's linear layers count 1, and its attention to ``c`` earlier tokens counts
    ``c / context_cost`` (0: attention not counted)."""
    if not context_cost:
        return float(num_new)
    return num_new * (1.0 + (start + (num_new - 1) / 2.0) / context_cost)


def tokens_for_cost(cost: float, start: int, context_cost: float) -> int:
    """The most tokens from ``start`` whose ``chunk_cost`` is at most ``cost`` (at least 1)."""
    if not context_cost:
        return max(1, int(cost))
    # n (1 + (start - 1/2) / E) + n^2 / (2E) <= cost, solved for n
    lin = 1.0 + (start - 0.5) / context_cost
    n = context_cost * (math.sqrt(lin * lin + 2.0 * cost / context_cost) - lin)
    return max(1, int(n + 1e-9))


@dataclass
class _Step:
    """What one ``schedule()`` call has handed out so far."""

    budget: int
    busy_chunk: int = 0  # most tokens a partial prefill chunk may take once ``busy`` (0: no cap)
    busy: bool = False  # some seq of this step samples a token
    cost_left: float | None = None  # latency mode: prefill work (not decodes) this step may still take
    context_cost: float = 0.0  # see ``chunk_cost``
    seq_cap: int = 0  # most new tokens of one sequence (a window ring's chunk; 0: no cap)
    prefilling: bool = False  # latency mode: some prefill chunk is in this step
    scheduled: dict[str, ScheduledSeq] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)

    def take(self, seq: ScheduledSeq) -> None:
        self.scheduled[seq.request_id] = seq
        self.budget -= len(seq.token_ids)
        self.busy = self.busy or seq.sample
        num_new = len(seq.token_ids) - seq.num_draft
        if self.cost_left is not None and num_new > 1:  # prefill work (decodes are not capped)
            self.cost_left -= chunk_cost(num_new, seq.start_pos, self.context_cost)
            self.prefilling = True

    def chunk(self, num_pending: int, start: int = 0) -> int:
        """Tokens a request with ``num_pending`` (computed so far: ``start``) may compute now:
        beside other requests' tokens, a prefill chunk is capped; in latency mode every
        prefill chunk is also cut to the step's work left (0 when none is left)."""
        num_new = min(num_pending, self.budget)
        if self.seq_cap:
            num_new = min(num_new, self.seq_cap)
        if self.busy and self.busy_chunk:
            num_new = min(num_new, self.busy_chunk)
        if self.cost_left is not None and num_pending > 1:
            if self.prefilling and self.cost_left < chunk_cost(1, start, self.context_cost):
                return 0  # (the first prefill of a step always gets a token, so none starves)
            num_new = min(num_new, tokens_for_cost(self.cost_left, start, self.context_cost))
        return num_new


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int,
                 max_model_len: int, prefix_cache: Any = None, context_cost: float = 0.0,
                 drafter: Any = None, long_rope_after: int | None = None, seq_chunk: int | None = None) -> None:
        """``prefix_cache``: a ``longctx.kv.prefix_cache.PrefixCache`` over the same ``pool``,
        or None for no prefix caching. ``context_cost``: the context length at which a token's
        attention costs as much as its linear layers (``context_cost_tokens`` of the model
        config; used by ``prefill_step_cost``). ``drafter``: a lookahead controller (``add``,
        ``propose``, ``commit``, ``finish``), or None for no drafts. ``long_rope_after``: a
        LongRoPE model's original window (``original_max_position_embeddings``), else None.

        LongRoPE, as HF's generate runs Phi-3: a sequence longer than that window turns every
        token by the long table, so a request whose prompt is longer starts so, and one that
        grows past it during decoding is recomputed from its first token on the long table (HF
        drops its cache at that token); a verification step keeps its drafts inside the window
        while the request is short. Long requests' pages carry their own salt in the prefix
        store, apart from short ones'. ``seq_chunk``: the most new tokens one sequence may
        compute per step (windowed layers' rings are sized for it), or None."""
        self.long_rope_after, self.seq_chunk = long_rope_after, seq_chunk
        self.config = config
        self.drafter = drafter
        self.context_cost = context_cost
        self.pool = pool
        self.cache = prefix_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.window_name = "the model's context window"  # (the engine's, when the KV pool caps it)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.loading: dict[str, Request] = {}  # waiting for prefix pages from disk
        self.num_reserved_blocks = 0  # taken from the pool for good (the CUDA graphs' scratch page)
        # exact-tail slots (one per running request: ``max_num_seqs``), lowest first
        self._free_tail_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._new_loads: list = []
        self._finished_ids: list[str] = []  # for the next output: the runner forgets them
        self._draft_moves: list[DraftMove] = []  # accepted drafts to compact, for the next output
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of every added request
        self.num_computed_prompt_tokens = 0  # prompt tokens the model computed (cache misses)

    # ------------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        self.check_fits(len(request.prompt_token_ids), request.params.max_tokens)
        if self._passes_rope_window(request):
            self._set_long_rope(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_order = next(self._arrivals)
        self.num_prompt_tokens += len(request.prompt_token_ids)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.drafter is not None:
            self.drafter.add(request.request_id, request.prompt_token_ids, shared=request.params.greedy)

    def reserve_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` pages out of the pool for good (the CUDA graphs' scratch page)."""
        self.num_reserved_blocks += num_blocks
        return self.pool.allocate(num_blocks)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ``RequestTooLongError`` for a request that could never run."""
        if prompt_len < 1:
            raise RequestTooLongError("the prompt is empty: give at least one token")
        if prompt_len >= self.max_model_len:
            raise RequestTooLongError(
                f"the prompt has {prompt_len} tokens but {self.window_name} is "
                f"{self.max_model_len} tokens (prompt plus at least one new token must fit)")
        longest = min(prompt_len + max_tokens, self.max_model_len)
        usable = self.pool.num_blocks - self.num_reserved_blocks
        if self.blocks_for(longest) > usable:
            raise RequestTooLongError(
                f"a request of {prompt_len} prompt + {max_tokens} new tokens needs "
                f"{self.blocks_for(longest)} KV pages of {self.block_size} tokens, but the cache "
                f"holds only {usable}: raise kv_cache_gb or lower max_tokens")

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished (or aborted) and free its pages."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.LOADING:
            del self.loading[request.request_id]
            request.disk_load = None
        self._free_blocks(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)  # (also a load's: the runner drops it)
        if self.drafter is not None:
            self.drafter.finish(request.request_id)

    def finish_request(self, request_id: str, reason: str) -> None:
        """End the request ``request_id`` if it is still unfinished (an abort, a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ------------------------------------------------------------------ one step

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def schedule(self) -> SchedulerOutput:
        if self.drafter is not None:
            self._propose_drafts()
        latency = self.config.prefill_step_cost > 0
        step = _Step(self.config.max_num_batched_tokens, self.config.busy_prefill_chunk,
                     cost_left=float(self.config.prefill_step_cost) if latency else None,
                     context_cost=self.context_cost, seq_cap=self.seq_chunk or 0)
        ordered = sorted(self.running, key=lambda r: (r.num_pending, r.arrival_order))
        # latency mode: only decodes here, so a prefill's last chunk does not go before newcomers
        finishing = [r for r in ordered if r.num_pending <= (1 if latency else step.budget)]
        for req in finishing:  # decodes (and last chunks) first
            self._schedule_running(req, step)
        if self._admit(step, whole_only=True) and latency:
            # a newcomer gets its first token in this step: nothing else prefills beside it
            return self._batch(step)
        for req in ordered:
            if req not in finishing:
                self._schedule_running(req, step)
        self._admit(step, whole_only=False)
        return self._batch(step)

    def _batch(self, step: "_Step") -> SchedulerOutput:
        seqs = list(step.scheduled.values())
        if any(len(s.token_ids) > MAX_VERIFY_TOKENS for s in seqs if not s.num_draft):
            seqs = [self._without_draft(s) for s in seqs]
        new = []
        for seq in seqs:
            req = self.requests[seq.request_id]
            if not req.announced:
                req.announced = True
                new.append(NewRequest(req.request_id, req.prompt_token_ids, req.params))
        return self.pending_orders(seqs, step.preempted, new)

    def pending_orders(self, seqs: list[ScheduledSeq] = (), preempted: list[str] = (),
                       new_requests: list[NewRequest] = ()) -> SchedulerOutput:
        """An output with ``seqs`` and every order not yet handed out: finished ids, draft
        compactions (first: tier copies may read their pages), the prefix store's tier copies
        and disk reads. Without seqs: the orders alone, to run outside a step (before the
        prefix store is persisted or cleared)."""
        orders = self.cache.take_orders() if self.cache is not None else []
        loads, self._new_loads = self._new_loads, []
        finished, self._finished_ids = self._finished_ids, []
        moves, self._draft_moves = self._draft_moves, []
        return SchedulerOutput(seqs=list(seqs), preempted=list(preempted), new_requests=list(new_requests),
                               finished_ids=finished, draft_moves=moves, kv_orders=orders, disk_loads=loads,
                               wait_for_disk=not seqs and bool(self.loading))

    def _propose_drafts(self) -> None:
        """A draft tree for each decoding request, sized to what it may still emit."""
        for req in self.running:
            req.draft_token_ids, req.draft_parents = [], []
            if req.num_pending != 1:  # still prefilling
                continue
            room = min(req.params.max_tokens - len(req.output_token_ids),
                       self.max_model_len - req.num_tokens) - 1
            tree = self.drafter.propose(req.request_id, room)
            req.draft_token_ids, req.draft_parents = tree.token_ids, tree.parents

    def _schedule_running(self, req: Request, step: "_Step") -> None:
        if step.budget == 0 or req.status != RequestStatus.RUNNING:  # none left / preempted
            return
        if self._passes_rope_window(req):  # LongRoPE: recomputed from its first token, long
            self._free_blocks(req)
            req.num_computed_tokens = 0
            self._set_long_rope(req)
        num_new = step.chunk(req.num_pending, req.num_computed_tokens)
        if num_new == 0:  # latency mode: this step's prefill work is spent
            return
        num_draft = min(len(req.draft_token_ids), step.budget - 1, MAX_VERIFY_TOKENS - 1,
                        self.max_model_len - req.num_tokens - 1) if req.num_pending == 1 else 0
        if self.long_rope_after is not None and not req.rope_long:  # drafts stay inside the window
            num_draft = min(num_draft, self.long_rope_after - req.num_tokens)
        num_draft = max(num_draft, 0)
        while not self._grow(req, req.num_computed_tokens + num_new + num_draft):
            if num_draft:  # drafts are the first thing to give up
                num_draft = 0
                continue
            victim = self._pick_victim(exclude=step.scheduled)
            self._preempt(victim)
            step.preempted.append(victim.request_id)
            if victim is req:
                return
        step.take(self._seq(req, num_new, num_draft))

    def _admit(self, step: "_Step", whole_only: bool) -> int:
        """Admit waiting requests (arrival order, or cache-aware); with ``whole_only``, only
        while the next one's whole uncached prompt fits the budget left (it then samples in
        this very step). Returns how many were admitted."""
        admitted = 0
        while (self.waiting and step.budget > 0 and not step.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self._next_waiting()
            cached = self._cached_tokens(req)
            uncached = req.num_pending - cached
            if whole_only and uncached > step.chunk(uncached, cached):
                break
            self._attach_prefix(req)
            if req.disk_load is not None:  # its pages come from disk first: it waits for them
                self.waiting.remove(req)
                req.status = RequestStatus.LOADING
                self.loading[req.request_id] = req
                self._new_loads.append(req.disk_load)
                continue
            num_new = step.chunk(req.num_pending, req.num_computed_tokens)
            if num_new == 0:  # latency mode: this step's prefill work is spent
                self._free_blocks(req)
                req.num_computed_tokens = 0
                break
            if not self._grow(req, req.num_computed_tokens + num_new):
                self._free_blocks(req)  # keep waiting without pages
                req.num_computed_tokens = 0
                break
            admitted += 1
            self._count_skips(req)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.take(self._seq(req, num_new))
        return admitted

    # ------------------------------------------------------------------ prefix cache

    def _cached_tokens(self, req: Request) -> int:
        """Tokens of ``req`` the cache could serve now (a look, nothing is taken)."""
        if self.cache is None or req.num_computed_tokens or req.params.prompt_logprobs is not None:
            return 0
        usable = (req.num_tokens - 1) // self.block_size * self.block_size
        return min(usable, self.cache.cached_tokens(req.token_slice(0, usable), req.cache_salt))

    def _next_waiting(self) -> Request:
        head = self.waiting[0]
        if (self.cache is None or len(self.waiting) == 1 or head.num_preemptions
                or head.num_skips >= MAX_SKIPS):
            return head
        window = list(islice(self.waiting, ORDER_WINDOW))
        return max(window, key=self._cached_tokens)  # ties: the earliest

    def _count_skips(self, admitted: Request) -> None:
        for req in self.waiting:
            if req is admitted:
                return
            req.num_skips += 1

    def _attach_prefix(self, req: Request) -> None:
        """Take the request's cached prefix: its pages become the request's, counted computed.
        A request asking for prompt log-probabilities computes its whole prompt (as vLLM)."""
        if self.cache is None or req.num_computed_tokens or req.params.prompt_logprobs is not None:
            return
        hit = self.cache.acquire(req.token_slice(0, req.num_tokens), req.cache_salt,
                                 req.num_tokens - 1, req.request_id, use_disk=not req.disk_tried)
        req.cache_node, req.block_ids = hit.node, hit.block_ids
        req.num_computed_tokens, req.num_indexed_pages = hit.num_tokens, len(hit.block_ids)
        if not req.num_preemptions and not req.output_token_ids:
            req.num_cached_tokens = hit.num_tokens
        if hit.disk_load is not None:
            req.disk_load = hit.disk_load
            req.block_ids = hit.block_ids + list(hit.disk_load.device_ids)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self.loading

    def finish_disk_load(self, load: Any) -> None:
        """The pages of ``load`` were read (``load.num_read``, up to the first bad one) and
        written into their blocks: index them, and put the request back at the head of the
        waiting queue with its prefix computed."""
        req = self.loading.pop(load.request_id)
        num_prefix = req.num_computed_tokens // self.block_size
        req.cache_node, ids = self.cache.finish_disk_load(
            req.token_slice(0, req.num_tokens), req.cache_salt, req.cache_node,
            req.block_ids[:num_prefix], load)
        req.block_ids, req.disk_load, req.disk_tried = ids, None, True
        req.num_indexed_pages = len(ids)
        req.num_computed_tokens = len(ids) * self.block_size
        if not req.num_preemptions and not req.output_token_ids:
            req.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _index_pages(self, req: Request) -> None:
        """Hand the request's newly completed full pages to the prefix cache."""
        num_full = req.num_computed_tokens // self.block_size
        if self.cache is None or num_full <= req.num_indexed_pages:
            return
        req.cache_node = self.cache.insert(req.token_slice(0, num_full * self.block_size),
                                           req.cache_salt, req.block_ids, req.cache_node)
        req.num_indexed_pages = num_full

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        """The runner executed ``output``: take its completed disk reads, count the step's
        tokens computed, commit each sampled sequence's tokens (ending requests at a stop
        token, ``max_tokens`` or the window) and order accepted drafts compacted. One update
        per scheduled request, in step order."""
        for load in result.finished_loads:
            req = self.loading.get(load.request_id)
            if req is not None and req.disk_load is load:  # (not aborted meanwhile)
                self.finish_disk_load(load)
        self.advance(output)
        updates = []
        for seq in output.seqs:
            req = self.requests[seq.request_id]
            sampled = result.sampled.get(seq.request_id)
            if sampled is None:  # a prefill chunk that samples nothing
                updates.append(RequestUpdate(req.request_id, [], req.num_computed_tokens,
                                             len(req.prompt_token_ids)))
            else:
                updates.append(self._commit(req, seq, sampled))
        return updates

    def _commit(self, req: Request, seq: ScheduledSeq, sampled: SampledSeq) -> RequestUpdate:
        """Append ``sampled``'s tokens to ``req`` until one ends it; accepted drafts of a
        request that goes on count as computed and are compacted in the next step."""
        reason, tokens = None, []
        for token in sampled.token_ids:
            req.output_token_ids.append(token)
            tokens.append(token)
            if token in req.stop_token_ids:
                reason = "stop"
            elif len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                break
        accepted = sampled.num_accepted
        num_accepted = min(accepted, len(tokens))
        if self.drafter is not None:
            self.drafter.commit(req.request_id, tokens, sampled.num_drafted, num_accepted)
        if reason is not None:
            self.finish(req, reason)
        elif accepted:
            self.accept_draft(req.request_id, accepted)
            if sampled.accepted_nodes != list(range(accepted)):  # some node moves
                self._draft_moves.append(DraftMove(list(seq.block_ids), seq.start_pos,
                                                   list(sampled.accepted_nodes), seq.tail_slot))
        logprobs = None if sampled.logprobs is None else sampled.logprobs[:len(tokens)]
        return RequestUpdate(req.request_id, tokens, req.num_computed_tokens, len(req.prompt_token_ids),
                             reason, sampled.num_drafted, num_accepted, logprobs)

    def advance(self, batch: SchedulerOutput) -> None:
        """The runner computed ``batch``: its tokens are cached now (draft nodes are not yet:
        see ``accept_draft``)."""
        for seq in batch.seqs:
            req = self.requests[seq.request_id]
            end = seq.start_pos + len(seq.token_ids) - seq.num_draft
            self.num_computed_prompt_tokens += max(0, min(end, len(req.prompt_token_ids)) - seq.start_pos)
            req.num_computed_tokens = end
            self._index_pages(req)

    def accept_draft(self, request_id: str, num_accepted: int) -> None:
        """``num_accepted`` draft tokens of the last step were verified and appended to the
        output (their KV sits in the slots after the last token): count them computed."""
        req = self.requests[request_id]
        if not 0 <= num_accepted <= req.num_pending:
            raise ValueError(f"cannot accept {num_accepted} draft tokens with {req.num_pending} pending")
        req.num_computed_tokens += num_accepted
        self._index_pages(req)

    # ------------------------------------------------------------------ helpers

    def _seq(self, req: Request, num_new: int, num_draft: int = 0) -> ScheduledSeq:
        start = req.num_computed_tokens
        sink: tuple[int, ...] = ()
        if req.tail_slot < 0 and self._free_tail_slots:  # held until its pages are freed
            req.tail_slot = self._free_tail_slots.pop()
            if start > 0:  # its pages came from the prefix cache: the first page's rows did not
                sink = tuple(req.token_slice(0, min(start, self.block_size)))
        targets: tuple[int, ...] = ()
        if req.params.prompt_logprobs is not None:  # predictions of prompt tokens start + 1 ...
            targets = tuple(req.prompt_token_ids[start + 1:start + num_new + 1])
        return ScheduledSeq(request_id=req.request_id,
                            token_ids=req.token_slice(start, start + num_new) + req.draft_token_ids[:num_draft],
                            start_pos=start, block_ids=list(req.block_ids),
                            sample=start + num_new == req.num_tokens,
                            draft_parents=tuple(req.draft_parents[:num_draft]), logprob_targets=targets,
                            tail_slot=req.tail_slot, sink_token_ids=sink, rope_long=req.rope_long)

    @staticmethod
    def _without_draft(seq: ScheduledSeq) -> ScheduledSeq:
        if not seq.num_draft:
            return seq
        return ScheduledSeq(seq.request_id, seq.token_ids[:len(seq.token_ids) - seq.num_draft],
                            seq.start_pos, seq.block_ids, seq.sample, tail_slot=seq.tail_slot,
                            sink_token_ids=seq.sink_token_ids, rope_long=seq.rope_long)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens; False if the pool is short."""
        missing = self.blocks_for(num_tokens) - len(req.block_ids)
        if missing <= 0:
            return True
        if missing > self.pool.num_free and self.cache is not None:
            self.cache.make_room(missing - self.pool.num_free)
        if missing > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(missing))
        return True

    def _passes_rope_window(self, req: Request) -> bool:
        return self.long_rope_after is not None and not req.rope_long and req.num_tokens > self.long_rope_after

    def _set_long_rope(self, req: Request) -> None:
        req.rope_long = True
        req.cache_salt = f"{req.cache_salt or ''}\x00longrope-long"

    def _pick_victim(self, exclude: dict[str, ScheduledSeq]) -> Request:
        for req in reversed(self.running):  # most recently admitted first
            if req.request_id not in exclude:
                return req
        raise RuntimeError("no request left to preempt")  # unreachable: the requester is one

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free_blocks(self, req: Request) -> None:
        """Give back the request's pages; computed full pages stay cached for later requests."""
        if self.cache is not None:
            self._index_pages(req)
            self.cache.release(req.cache_node)
            req.cache_node, req.num_indexed_pages = None, 0
        if req.block_ids:
            self.pool.release(req.block_ids)
            req.block_ids = []
        if req.tail_slot >= 0:  # its exact tail rows go with its pages
            self._free_tail_slots.append(req.tail_slot)
            req.tail_slot = -1
