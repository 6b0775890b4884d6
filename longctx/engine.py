"""The engine: the step loop (schedule -> run -> sample -> update) and per-request outputs.

Owns: building the model, KV pool, scheduler and runner from the configs; one ``step()``;
detokenization, stop rules and timings of each request.
Never: parsing user input (``longctx.api`` and the CLI do that) or choosing what runs
(the scheduler).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import logging
import time
from dataclasses import dataclass, field

import torch

from longctx.attention import ROTATE_INT8, flash_attn_available, select_backend
from longctx.cache.block_pool import BlockPool
from longctx.cache.radix_tree import RadixTree
from longctx.cuda_graphs import StepGraphs
from longctx.config import (DEFAULT_KV_CACHE_GB, CacheConfig, LookaheadConfig, ModelLoadConfig, ParallelConfig,
                            SchedulerConfig, resolve_auto)
from longctx.detokenizer import Detokenizer, make_detokenizer
from longctx.kv.device_pool import (DeviceKVPool, bytes_per_block, kv_storage_dtype, num_blocks_for,
                                    profile_kv_cache_gb)
from longctx.kv.disk_store import DiskKVStore
from longctx.kv.exact_tail import tail_store_bytes
from longctx.kv.host_pool import HostKVPool
from longctx.kv.mover import KVMover
from longctx.kv.prefix_cache import PrefixCache, PrefixCacheStats, host_tier_pages
from longctx.lookahead.acceptance import accept_tokens
from longctx.lookahead.controller import LookaheadController
from longctx.lookahead.tree import DraftTree
from longctx.model.config import ModelConfig
from longctx.model.llama import LlamaForCausalLM, choose_cpu_matmul
from longctx.model.loader import TORCH_DTYPES, load_model, load_row_kernel_model, model_fingerprint, resolve_model
from longctx.model.tokenizer import load_tokenizer
from longctx.runner import ModelRunner
from longctx.runner import SeqResult
from longctx.sampling import SeqSampling
from longctx.sampling_params import SamplingParams
from longctx.scheduler import Request, RequestStatus, ScheduledSeq, Scheduler

log = logging.getLogger(__name__)

DISK_WAIT_S = 0.05  # a step with nothing to run waits this long for a disk read to finish



@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per token (a step's tokens share one)
    num_verify_steps: int = 0  # lookahead: steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token: its own and the top ones


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per token
    # {token id: logprob} with the token's own and the top ones
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StepUpdate:
    """What one step did for one request: new tokens and text, or prefill progress."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_computed_tokens: int
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict[int, float]] | None = None  # per new token, when the request asked


@dataclass
class _Tracked:
    request: Request
    prompt: str | None
    metrics: RequestMetrics
    text: str = ""
    num_sent: int = 0  # characters of ``text`` already handed out as ``new_text``
    detok: Detokenizer | None = None  # the output's text, token by token (made on the first)
    stop_ids: frozenset[int] = frozenset()
    logprobs: list[dict[int, float]] | None = None  # per output token, when asked
    prompt_logprobs: list[dict[int, float] | None] | None = None


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of some stop string: text a
    later token may turn into a stop (and cut), so it is not handed out yet."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def prepare_model(load: ModelLoadConfig, parallel: ParallelConfig,
                  device: torch.device) -> tuple[LlamaForCausalLM, str | None]:
    """Load the model onto ``device`` in the form its products take ("kernel", "onednn" or
    "blas" on the CPU, None elsewhere): the same on every sequence-parallel rank."""
    if load.num_threads:
        torch.set_num_threads(load.num_threads)
    if device.type == "cpu":
        # SiLU of very negative pre-activations underflows to denormals, and x86 matmuls on
        # denormal inputs run several times slower (measured: a 4K-token prefill 30 s -> 12 s).
        # Flushing them to zero changes values below 1e-38 only.
        torch.set_flush_denormal(True)
    dtype = TORCH_DTYPES[load.dtype]
    cpu_matmul = choose_cpu_matmul(load.cpu_matmul, dtype) if device.type == "cpu" else None
    if cpu_matmul == "kernel":  # from the weight cache in the kernel's layout, memory-mapped
        return load_row_kernel_model(load.model, dtype, rope_scaling=load.rope_scaling), cpu_matmul
    model = load_model(load.model, dtype=dtype, device=device, rope_scaling=load.rope_scaling)
    if device.type != "cpu":
        return model, None
    if cpu_matmul == "onednn" and load.cpu_matmul == "auto" and parallel.sequence_parallel_size > 1:
        # the ranks share the weights through shared memory, which oneDNN's packed (opaque)
        # tensors cannot join: keep them as plain BLAS matrices
        cpu_matmul = "blas"
    if cpu_matmul == "onednn":
        model.pack_linears_onednn()
    return model, cpu_matmul


def model_window(config: ModelConfig, rope_scaling: dict | None) -> int:
    """The context window when ``max_model_len`` is not given: the checkpoint's
    ``max_position_embeddings``, or with a ``rope_scaling`` override the window it stretches
    to (``original_max_position_embeddings``, else the checkpoint's, times ``factor``)."""
    window = config.max_position_embeddings
    if rope_scaling:
        rs = config.rope_scaling
        window = max(window, int((rs.original_max_position_embeddings or window) * rs.factor))
    return window


def _warn_past_window(max_len: int, config: ModelConfig, rope_scaling: dict | None) -> None:
    window = model_window(config, rope_scaling)
    if max_len <= window:
        return
    if rope_scaling:
        log.warning("max_model_len %d exceeds the %d positions the rope_scaling override stretches "
                    "the model to; outputs past it may degrade", max_len, window)
    else:
        log.warning("max_model_len %d exceeds the model's window (max_position_embeddings %d) and no "
                    "rope_scaling is given: positions past %d were never trained and outputs there "
                    "degrade; pass rope_scaling, e.g. {\"rope_type\": \"yarn\", \"factor\": %g}",
                    max_len, window, window, 2 ** math.ceil(math.log2(max_len / window)))


class LLMEngine:
    def __init__(self, load: ModelLoadConfig, cache: CacheConfig, sched: SchedulerConfig,
                 lookahead: LookaheadConfig = LookaheadConfig(),
                 parallel: ParallelConfig = ParallelConfig()) -> None:
        self.device = torch.device(load.device)
        load, cache = resolve_auto(load, cache, self.device.type, flash_attn_available())
        if cache.kv_cache_gb is None and parallel.sequence_parallel_size > 1:
            cache = dataclasses.replace(cache, kv_cache_gb=DEFAULT_KV_CACHE_GB)  # the same on every rank
        self.load_config, self.cache_config = load, cache
        self.dtype = TORCH_DTYPES[load.dtype]
        path = resolve_model(load.model)
        self.model, self.cpu_matmul = prepare_model(load, parallel, self.device)
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(path)
        max_len = sched.max_model_len or model_window(self.model_config, load.rope_scaling)
        _warn_past_window(max_len, self.model_config, load.rope_scaling)
        backend = select_backend(self.device, self.model_config.head_dim, load.attention_backend,
                                 self.dtype)
        if cache.kv_cache_gb is None and not cache.num_blocks:  # CUDA: what the model leaves free
            budget = profile_kv_cache_gb(self.model, backend, self.device, sched.max_num_batched_tokens,
                                         cache.gpu_memory_utilization)
            if cache.kv_cache_dtype == "int8":  # less the exact tail's rows (outside the pages)
                budget -= tail_store_bytes(self.model_config, sched.max_num_seqs, cache.block_size,
                                           self.dtype) / (1 << 30)
            cache = self.cache_config = dataclasses.replace(cache, kv_cache_gb=budget)
        self.kv_dtype = kv_storage_dtype(cache.kv_cache_dtype, self.dtype)
        num_blocks = num_blocks_for(self.model_config, cache, self.kv_dtype)  # per rank
        self.sequence_parallel_size = parallel.sequence_parallel_size
        if parallel.sequence_parallel_size > 1:
            from longctx import sp

            self.runner = sp.start(self.model, load, cache, parallel, num_blocks, backend.kernels, self.device,
                                   sched.max_num_batched_tokens)
        else:
            self.runner = ModelRunner(self.model, DeviceKVPool(self.model_config, num_blocks, cache.block_size,
                                                               self.dtype, self.device, self.kv_dtype,
                                                               tail_slots=sched.max_num_seqs),
                                      backend, self.device)
        try:
            self.kv = self.runner.kv
            self.pool = BlockPool(self.kv.num_blocks)
            self.kv_mover: KVMover | None = None
            self.prefix_cache = self._build_prefix_cache(cache, path) if cache.enable_prefix_caching else None
            self.scheduler = Scheduler(sched, self.pool, cache.block_size, max_len, self.prefix_cache,
                                       context_cost=self.model_config.context_cost_tokens)
        except BaseException:
            self._stop_runner()  # sequence-parallel ranks already started: no orphans
            raise
        self.max_model_len = max_len
        if (self.device.type == "cuda" and not load.enforce_eager and parallel.sequence_parallel_size == 1
                and self.model_config.rope_scaling.rope_type != "dynamic"):  # dynamic RoPE: tables per length
            self.capture_step_graphs(sched.max_num_seqs, capture=True,
                                     max_draft=lookahead.lookahead_max_tokens if lookahead.lookahead else 0)
        self.lookahead = LookaheadController(lookahead) if lookahead.lookahead else None
        self.eos_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

    def capture_step_graphs(self, max_batch: int, capture: bool = True, max_draft: int = 0) -> StepGraphs:
        """Reserve a scratch page for padded rows and (on CUDA) capture the graphs of decode
        steps and of verify steps of up to ``max_draft`` draft tokens per sequence.
        ``capture=False`` runs the same padded path eagerly (how the CPU tests check it)."""
        scratch = self.pool.allocate(1)[0]  # never released: padded rows write here
        self.scheduler.num_reserved_blocks += 1
        graphs = StepGraphs(self.runner, max_batch, self.max_model_len, scratch, capture, max_draft)
        graphs.capture()
        self.runner.graphs = graphs
        return graphs

    def _build_prefix_cache(self, cache: CacheConfig, path) -> PrefixCache:
        page_bytes = bytes_per_block(self.model_config, cache.block_size, self.kv_dtype)
        host_pages = host_tier_pages(cache.host_tier_gb(torch.device(self.kv.device).type), page_bytes)
        host = HostKVPool(self.kv, host_pages) if host_pages else None
        disk = None
        if cache.disk_cache_dir:
            disk = DiskKVStore(cache.disk_cache_dir, int(cache.disk_cache_gb * (1 << 30)), self.kv.page_shape,
                               self.kv.page_dtype)
        tree = RadixTree(cache.block_size, host_capacity_pages=host_pages)
        # the fingerprint holds the whole ModelConfig, RoPE included: pages cached under another
        # rope_scaling (another rotation of the keys) never match, on any tier
        kv_format = str(self.kv_dtype) + ("+rotated" if self.kv_dtype == torch.int8 and ROTATE_INT8 else "")
        key = ("longctx-kv-1", model_fingerprint(path, self.model_config), str(self.dtype), kv_format)
        self.kv_mover = self.runner.kv_mover = KVMover(self.kv, host, disk)
        return PrefixCache(tree, self.pool, self.kv, host, disk, key)

    # ------------------------------------------------------------------ prefix cache

    def cache_stats(self, wait_for_disk: bool = False) -> PrefixCacheStats:
        """Prompt tokens seen, prefilled, and served from each cache tier, so far."""
        sched, pc = self.scheduler, self.prefix_cache
        if wait_for_disk and self.kv_mover is not None:
            self.kv_mover.flush()  # queued disk writes count once written (the server never waits)
        stats = PrefixCacheStats(sched.num_prompt_tokens, sched.num_computed_prompt_tokens)
        if pc is not None:
            stats.hit_tokens = dict(pc.hit_tokens)
            if pc.disk is not None:
                stats.disk_misses = pc.disk.miss_counts()
                stats.pages_written_to_disk = pc.disk.num_written
        return stats

    def kv_usage(self) -> dict[str, dict[str, int]]:
        """Pages per tier: ``in_use`` by requests, ``cached`` (held by the prefix store only, so
        free to evict) and ``free``. Host and disk appear when those tiers exist."""
        in_use = len({b for r in self.scheduler.running for b in r.block_ids})
        held = self.pool.num_blocks - self.pool.num_free
        usage = {"device": {"in_use": in_use, "cached": held - in_use, "free": self.pool.num_free}}
        pc = self.prefix_cache
        if pc is not None and pc.host_kv is not None:
            usage["host"] = {"in_use": 0, "cached": pc.tree.num_host_pages,
                             "free": pc.tree.num_free_host_pages}
        if pc is not None and pc.disk is not None:
            usage["disk"] = {"in_use": 0, "cached": pc.disk.num_pages, "free": 0}
        return usage

    def close(self) -> None:
        """Persist the prefix cache, then stop the sequence-parallel ranks (if any). After a
        rank failed nothing can be read from the ranks' pages: the cache is not persisted."""
        try:
            if getattr(self.runner, "failed", False):
                log.warning("a sequence-parallel rank failed: the prefix cache is not persisted")
            else:
                self.persist_prefix_cache()
                if self.kv_mover is not None:
                    self.kv_mover.close()
        finally:
            self._stop_runner()
            self._free_device_memory()

    def _free_device_memory(self) -> None:
        """On CUDA, hand the KV pool, the captured graphs and the weights back to the device, so
        a closed engine holds no GPU memory (another engine in the same process sizes its pool
        from what is free)."""
        if self.device.type != "cuda":
            return
        import gc

        self.runner.graphs = None
        self.kv.layers, self.kv.scales = [], None
        self.model.to("meta")
        gc.collect()
        torch.cuda.empty_cache()

    def _stop_runner(self) -> None:
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def persist_prefix_cache(self) -> int:
        """Write every cached page to the disk tier (if there is one); returns pages written."""
        if self.prefix_cache is None:
            return 0
        self.run_pending_kv_orders()
        return self.prefix_cache.persist()

    def run_pending_kv_orders(self) -> None:
        """Carry out, now, copies the prefix store planned outside a step (a direct
        ``prefix_cache.make_room``), and wait for the disk thread's queue."""
        self.runner.apply_kv_orders(self.prefix_cache.take_orders())
        self.kv_mover.flush()

    def clear_prefix_cache(self) -> None:
        """Drop every cached page from the device and host tiers (the disk tier is kept)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("cannot clear the prefix cache while requests are running")
        if self.prefix_cache is not None:
            self.run_pending_kv_orders()
            self.prefix_cache.clear()

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.prompt_logprobs is not None and self.sequence_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with sequence_parallel_size > 1")
        request = Request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt)
        self.scheduler.add(request)
        if params.prompt_logprobs is not None:
            self.runner.want_prompt_logprobs(request_id, params.prompt_logprobs)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        self._tracked[request_id] = _Tracked(request, prompt, RequestMetrics(time.perf_counter()),
                                             stop_ids=stop_ids,
                                             logprobs=[] if params.logprobs is not None else None,
                                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        if self.lookahead is not None:
            self.lookahead.add(request_id, request.prompt_token_ids, shared=params.greedy)
        return request_id

    def abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and tracked.request.status != RequestStatus.FINISHED:
            self.scheduler.finish(tracked.request, "abort")
        self.runner.forget(request_id)
        if self.lookahead is not None:
            self.lookahead.finish(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output(self, request_id: str) -> RequestOutput:
        t = self._tracked[request_id]
        req = t.request
        return RequestOutput(req.request_id, t.prompt, req.prompt_token_ids,
                             [CompletionOutput(0, t.text, list(req.output_token_ids), req.finish_reason,
                                               None if t.logprobs is None else list(t.logprobs))],
                             req.status == RequestStatus.FINISHED, t.metrics,
                             None if t.prompt_logprobs is None else list(t.prompt_logprobs))

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a finished request; the engine forgets it."""
        out = self.output(request_id)
        del self._tracked[request_id]
        return out

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepUpdate]:
        self._finish_disk_loads()
        if self.lookahead is not None:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        for load in batch.disk_loads:  # read on the disk thread; the requests wait meanwhile
            self.kv_mover.submit_read(load)
        if not batch.seqs:
            self.runner.apply_kv_orders(batch.kv_orders)
            if self.scheduler.loading:  # only requests waiting for disk pages: wait for one
                self._finish_disk_loads(wait=DISK_WAIT_S)
            elif self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request (KV pool too small?)")
            return []
        now = time.perf_counter()
        for seq in batch.seqs:
            m = self._tracked[seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        sampling = [s for s in batch.seqs if s.sample]
        results = self.runner.run(batch, [self._sampling(s) for s in sampling])
        for rid, (first, entries) in self.runner.take_prompt_logprobs().items():
            kept = self._tracked[rid].prompt_logprobs
            if len(kept) >= first:  # (a preempted request recomputes what it has: kept once)
                kept.extend(entries[len(kept) - first:])
        self.scheduler.advance(batch)
        now = time.perf_counter()
        updates = {s.request_id: self._progress(self._tracked[s.request_id]) for s in batch.seqs}
        for seq, result in zip(sampling, results):
            if seq.num_draft:
                updates[seq.request_id] = self._verify(seq, result, now)
            else:
                updates[seq.request_id] = self._commit(seq, result.tokens, now, rows=[0], result=result)
        for rid, update in updates.items():
            if update.finished:
                self.runner.forget(rid)
        return list(updates.values())

    def _sampling(self, seq: ScheduledSeq) -> SeqSampling:
        """What the runner's sampler needs of ``seq``'s request (plain data, no ``Request``)."""
        req = self._tracked[seq.request_id].request
        return SeqSampling(seq.request_id, req.params, len(req.output_token_ids),
                           tuple(seq.token_ids[1:]) if seq.num_draft else (), seq.draft_parents,
                           req.prompt_token_ids, req.output_token_ids)

    # ------------------------------------------------------------------ lookahead

    def _finish_disk_loads(self, wait: float = 0.0) -> None:
        """Requests whose disk pages the disk thread has read: write the good pages into
        their blocks and hand the requests back to the scheduler."""
        if self.kv_mover is None or not self.scheduler.loading:
            return
        for load in self.kv_mover.completed_reads(wait):
            req = self.scheduler.loading.get(load.request_id)
            if req is None or req.disk_load is not load:
                continue  # aborted meanwhile (its id maybe reused): its blocks are gone, nothing is written
            if load.num_read:
                self.kv_mover.write_pages(list(load.device_ids[:load.num_read]), load.buffer[:load.num_read])
            self.scheduler.finish_disk_load(load)

    def _propose_drafts(self) -> None:
        for req in self.scheduler.running:
            req.draft_token_ids, req.draft_parents = [], []
            if req.num_pending != 1:  # still prefilling
                continue
            room = min(req.params.max_tokens - len(req.output_token_ids),
                       self.max_model_len - req.num_tokens) - 1
            tree = self.lookahead.propose(req.request_id, room)
            req.draft_token_ids, req.draft_parents = tree.token_ids, tree.parents

    def _verify(self, seq: ScheduledSeq, sampled: SeqResult, now: float) -> StepUpdate:
        """Judge the draft of ``seq`` by the tokens sampled for its rows, commit the accepted
        tokens and the bonus token, and move the accepted branch's KV next to the last token."""
        t = self._tracked[seq.request_id]
        tree = DraftTree(seq.token_ids[1:], list(seq.draft_parents))
        result = accept_tokens(tree, sampled.tokens)
        m = t.metrics
        m.num_verify_steps += 1
        m.num_draft_tokens += len(tree)
        m.num_accepted_tokens += result.num_accepted
        update = self._commit(seq, result.tokens, now, num_drafted=len(tree),
                              num_accepted=result.num_accepted, rows=result.kept_queries,
                              result=sampled)
        if not update.finished:
            self.runner.move_draft_kv(seq.block_ids, seq.start_pos, result.accepted_nodes, seq.tail_slot)
            self.scheduler.accept_draft(seq.request_id, result.num_accepted)
        return update

    def _commit(self, seq: ScheduledSeq, tokens: list[int], now: float, num_drafted: int = 0,
                num_accepted: int = 0, rows: list[int] = (), result: SeqResult | None = None) -> StepUpdate:
        """Append ``tokens`` in order until one finishes the request; one update for all.
        ``rows``: the sampler's row of each token (for its log-probabilities)."""
        t = self._tracked[seq.request_id]
        tokens = tokens[:len(rows)] if rows else tokens
        parts = [self._append(t, token, now) for token in tokens[:1]]
        while not parts[-1].finished and len(parts) < len(tokens):
            parts.append(self._append(t, tokens[len(parts)], now))
        new_logprobs = None
        if t.logprobs is not None and result is not None and result.logprobs is not None:
            new_logprobs = []
            for row, token in zip(rows, tokens[:len(parts)]):
                entry = dict(zip(result.top_ids[row], result.top_logprobs[row]))
                entry[token] = result.logprobs[row]
                new_logprobs.append(entry)
            t.logprobs.extend(new_logprobs)
        if self.lookahead is not None:
            committed = [u.new_token_ids[0] for u in parts]
            self.lookahead.commit(seq.request_id, committed, num_drafted, min(num_accepted, len(committed)))
            if parts[-1].finished:
                self.lookahead.finish(seq.request_id)
        last = parts[-1]
        return StepUpdate(last.request_id, [u.new_token_ids[0] for u in parts],
                          "".join(u.new_text for u in parts), last.num_computed_tokens,
                          last.num_prompt_tokens, last.finished, last.finish_reason, new_logprobs)

    def _progress(self, t: _Tracked) -> StepUpdate:
        req = t.request
        return StepUpdate(req.request_id, [], "", req.num_computed_tokens, len(req.prompt_token_ids),
                          False, None)

    def _append(self, t: _Tracked, token: int, now: float) -> StepUpdate:
        req, params = t.request, t.request.params
        req.output_token_ids.append(token)
        m = t.metrics
        m.first_token_time = m.first_token_time or now
        m.token_times.append(now)
        old_text = t.text
        if t.detok is None or len(t.detok.token_ids) != len(req.output_token_ids) - 1:
            t.detok = make_detokenizer(self.tokenizer, req.output_token_ids[:-1])
        # == tokenizer.decode(req.output_token_ids, skip_special_tokens=True), at a cost per
        # token that does not grow with the output
        text = t.detok.add(token)
        reason = None
        if token in t.stop_ids:
            reason = "stop"
        for stop in params.stop:
            at = text.find(stop, max(0, len(old_text) - len(stop)))
            if at >= 0:
                text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                reason = "stop"
                break
        if reason is None and (len(req.output_token_ids) >= params.max_tokens
                               or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None and text.endswith("\ufffd"):
            text = old_text  # an incomplete UTF-8 sequence: wait for the next token
        t.text = text
        if reason is not None:
            self.scheduler.finish(req, reason)
            m.finished_time = now
            end = len(text)
        else:
            end = max(t.num_sent, len(text) - partial_stop_len(text, params.stop))
        new_text, t.num_sent = text[t.num_sent:end], end
        return StepUpdate(req.request_id, [token], new_text, req.num_computed_tokens,
                          len(req.prompt_token_ids), reason is not None, reason)
