"""The engine: builds the parts from the configs and runs one step as one transaction.

    output  = scheduler.schedule()                 plain data (``longctx.engine.outputs``)
    result  = runner.execute(output)               forward, sampling, draft acceptance
    updates = scheduler.update(output, result)     tokens committed, requests ended
    processor.process(output, result, updates)     text, stop strings, metrics

Owns: building the model, KV pool, scheduler, runner and output processor; ``step()``; the
prefix store's persistence around them.
Never: parsing user input (``longctx.entrypoints.api`` and the CLI do that), choosing what runs (the
scheduler), touching tensors of a step (the runner) or a ``Request``'s fields.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from longctx.attention import flash_attn_available, select_backend
from longctx.cache.block_pool import BlockPool
from longctx.engine.cuda_graphs import StepGraphs
from longctx.config import (DEFAULT_KV_CACHE_GB, CacheConfig, LookaheadConfig, ModelLoadConfig, ParallelConfig,
                            SchedulerConfig, batched_tokens_for, resolve_auto)
from longctx.kernels.cpu_build import keep_large_blocks
from longctx.kv.device_pool import DeviceKVPool, num_blocks_for
from longctx.kv.formats import check_kv_format, kv_format
from longctx.kv.mover import KVMover
from longctx.kv.prefix_cache import PrefixCacheStats
from longctx.kv.setup import build_prefix_cache, fit_window, size_kv_pool
from longctx.kv.window_ring import WindowRing
from longctx.lookahead.controller import LookaheadController
from longctx.model.loader import TORCH_DTYPES, model_fingerprint, resolve_model
from longctx.model.prepare import check_window, model_window, prepare_model
from longctx.model.tokenizer import load_tokenizer
from longctx.engine.output_processor import OutputProcessor, RequestOutput, StepUpdate
from longctx.engine.runner import ModelRunner, Runner
from longctx.sampling_params import SamplingParams
from longctx.engine.scheduler import Request, Scheduler

log = logging.getLogger(__name__)

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
        check_kv_format(cache, self.dtype, self.device)
        self.model, self.cpu_matmul = prepare_model(load, parallel, self.device)
        self.model_config = self.model.config
        sched = batched_tokens_for(sched, self.model_config.intermediate_size, self.device.type)
        self.sched_config = sched
        self.tokenizer = load_tokenizer(path)
        max_len = sched.max_model_len or model_window(self.model_config)
        check_window(max_len, self.model_config, sched.allow_long_context)
        backend = select_backend(self.device, self.model_config.head_dim, load.attention_backend,
                                 self.dtype)
        self.kv_format = kv_format(cache, self.model_config, self.dtype)
        cache, pool_note, ring = self._start_runner(load, cache, sched, parallel, max_len, backend)
        if self.device.type == "cpu":  # later large blocks reuse the heap (set already where prepare_model tuned)
            keep_large_blocks()
        self.lookahead = LookaheadController(lookahead) if lookahead.lookahead else None
        try:
            self.kv = self.runner.kv
            self.pool = BlockPool(self.kv.num_blocks)
            self.kv_mover: KVMover | None = None
            self.prefix_cache = None
            if cache.enable_prefix_caching:
                self.prefix_cache, self.kv_mover = build_prefix_cache(cache, self.kv, self.pool, self.kv_format,
                                                                      model_fingerprint(path, self.model_config))
                self.runner.kv_mover = self.kv_mover
            self.max_model_len = fit_window(max_len, self.pool.num_blocks, cache.block_size,
                                            bool(sched.max_model_len), pool_note)
            mc = self.model_config
            self.scheduler = Scheduler(sched, self.pool, cache.block_size, self.max_model_len, self.prefix_cache,
                                       mc.context_cost_tokens, self.lookahead, mc.long_rope_after,
                                       seq_chunk=ring.chunk if ring is not None else None)
            if self.max_model_len < max_len:
                self.scheduler.window_name = f"the context window the KV pool holds (the model's is {max_len})"
        except BaseException:
            self.runner.shutdown()  # sequence-parallel ranks already started: no orphans
            raise
        if (self.device.type == "cuda" and not load.enforce_eager and parallel.sequence_parallel_size == 1
                and ring is None  # (the graphs' static inputs hold the pool's table only)
                and self.model_config.rope_scaling.rope_type not in ("dynamic", "longrope")):  # tables per length
            self.capture_step_graphs(sched.max_num_seqs, capture=True,
                                     max_draft=lookahead.lookahead_max_tokens if lookahead.lookahead else 0)
        self.eos_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)
        self._ids = itertools.count()

    def _start_runner(self, load: ModelLoadConfig, cache: CacheConfig, sched: SchedulerConfig,
                      parallel: ParallelConfig, max_len: int, backend: Any) -> tuple[CacheConfig, str, Any]:
        """Size the KV pool (and the windowed layers' rings when they keep only their windows),
        start the runner; returns the settled cache config, how the pool was sized, the ring."""
        ring = None
        if cache.frees_window_kv() and parallel.sequence_parallel_size == 1:
            ring = WindowRing.for_model(self.model_config, cache.block_size, sched.max_num_seqs,
                                        sched.max_num_batched_tokens)
        cache, pool_note = size_kv_pool(cache, sched, max_len, self.kv_format, self.model, backend, self.device, ring)
        if ring is not None:
            pool_note += (f"; {len(ring.layers)} sliding-window layers keep {ring.pages_per_seq} pages per "
                          f"sequence (window_kv='free')")
        self.cache_config = cache
        num_blocks = num_blocks_for(cache, self.kv_format, ring)  # per rank
        self.sequence_parallel_size = parallel.sequence_parallel_size
        self.runner: Runner
        if parallel.sequence_parallel_size > 1:
            from longctx.engine import sp

            self.runner = sp.start(self.model, load, cache, parallel, num_blocks, backend.kernels, self.device,
                                   sched.max_num_batched_tokens)
        else:
            self.runner = ModelRunner(self.model, DeviceKVPool(self.kv_format, num_blocks, cache.block_size,
                                                               self.device, tail_slots=sched.max_num_seqs, ring=ring),
                                      backend, self.device)
        return cache, pool_note, ring

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV pages store (the format's storage dtype)."""
        return self.kv_format.storage_dtype

    def capture_step_graphs(self, max_batch: int, capture: bool = True, max_draft: int = 0) -> StepGraphs:
        """Reserve a scratch page for padded rows and (on CUDA) capture the graphs of decode
        steps and of verify steps of up to ``max_draft`` draft tokens per sequence.
        ``capture=False`` runs the same padded path eagerly (how the CPU tests check it)."""
        scratch = self.scheduler.reserve_blocks(1)[0]  # never released: padded rows write here
        graphs = StepGraphs(self.runner, max_batch, self.max_model_len, scratch, capture, max_draft)
        graphs.capture()
        self.runner.graphs = graphs
        return graphs

    # ------------------------------------------------------------------ prefix cache

    def cache_stats(self, wait_for_disk: bool = False) -> PrefixCacheStats:
        """Prompt tokens seen, prefilled, and served from each cache tier, so far."""
        if wait_for_disk and self.kv_mover is not None:
            self.kv_mover.flush()  # queued disk writes count once written (the server never waits)
        sched = self.scheduler
        return PrefixCacheStats.of(self.prefix_cache, sched.num_prompt_tokens, sched.num_computed_prompt_tokens)

    # ------------------------------------------------------------------ the facade

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``RequestTooLongError`` for a request that could never run here."""
        self.scheduler.check_fits(num_prompt_tokens, max_tokens)

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for sampling parameters past this engine's limits (stop strings:
        ``max_stop_strings``, ``max_stop_length``). Reads only settings fixed at start."""
        config = self.scheduler.config
        if len(params.stop) > config.max_stop_strings:
            raise ValueError(f"stop has {len(params.stop)} strings; at most {config.max_stop_strings} are "
                             "allowed (max_stop_strings)")
        longest = max(params.stop, key=len, default="")
        if len(longest) > config.max_stop_length:
            raise ValueError(f"a stop string has {len(longest)} characters; at most {config.max_stop_length} "
                             "are allowed (max_stop_length)")

    @property
    def max_num_seqs(self) -> int:
        """The most requests that run at once."""
        return self.scheduler.config.max_num_seqs

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (all pages, per rank summed)."""
        return self.pool.num_blocks * self.scheduler.block_size

    @property
    def has_prefix_cache(self) -> bool:
        return self.prefix_cache is not None

    def kv_usage(self) -> dict[str, dict[str, int]]:
        """Pages per tier: ``in_use`` by unfinished requests (running, waiting with pages, or
        reading theirs from disk), ``cached`` (held by the prefix store only, free to evict),
        ``free``, and on the device ``reserved`` (taken for good: the CUDA graphs' scratch page)
        and ``total``; a page in none of them would be a leak. Host and disk appear when those
        tiers exist; ``window_ring`` when the windowed layers keep only their windows
        (``window_kv="free"``): its pages (of those layers only) ``in_use`` by the running
        requests' rings and ``total``."""
        sched, pc = self.scheduler, self.prefix_cache
        in_use = {b for r in sched.requests.values() for b in r.block_ids}
        cached = 0
        if pc is not None:
            cached = len({b for n in pc.tree.nodes() for b in (n.device_ids or ())} - in_use)
        usage = {"device": {"in_use": len(in_use), "cached": cached, "free": self.pool.num_free,
                            "reserved": sched.num_reserved_blocks, "total": self.pool.num_blocks}}
        if pc is not None and pc.host_kv is not None:
            usage["host"] = {"in_use": 0, "cached": pc.tree.num_host_pages,
                             "free": pc.tree.num_free_host_pages}
        if pc is not None and pc.disk is not None:
            usage["disk"] = {"in_use": 0, "cached": pc.disk.num_pages, "free": 0}
        ring = getattr(self.kv, "ring", None)
        if ring is not None:
            rings = sum(r.tail_slot >= 0 for r in sched.requests.values())
            usage["window_ring"] = {"in_use": rings * ring.pages_per_seq, "total": ring.num_pages}
        return usage

    def disk_state(self) -> dict[str, Any] | None:
        """The disk tier's health (``DiskKVStore.state``: "ok", "degraded" or "stalled", with
        timeouts, quarantined pages and operations stuck past ``disk_timeout_s``); None without
        a disk tier. Thread-safe and cheap: it never touches the disk, so /health may call it
        while the engine thread works."""
        pc = self.prefix_cache
        return pc.disk.state() if pc is not None and pc.disk is not None else None

    def request_state(self, request_id: str) -> str | None:
        """``"waiting"``, ``"loading"`` (its prefix pages are being read from disk) or
        ``"running"``; None once finished or never added."""
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.status.value

    def stats(self) -> dict[str, int]:
        """Requests running / waiting / loading now; preemptions and prompt tokens seen and
        computed since start."""
        sched = self.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting), "loading": len(sched.loading),
                "preemptions": sched.num_preemptions, "prompt_tokens": sched.num_prompt_tokens,
                "computed_prompt_tokens": sched.num_computed_prompt_tokens}

    def worker_pids(self) -> list[int]:
        """The sequence-parallel ranks' processes started by this engine (empty without SP)."""
        return list(self.runner.worker_pids())

    def rank_health(self) -> str | None:
        """None while every sequence-parallel rank is alive and answering (always without SP);
        else what is wrong, naming the rank. Never blocks: the server's ``/health`` asks."""
        return self.runner.rank_health()

    def close(self) -> None:
        """Persist the prefix cache, then stop the sequence-parallel ranks (if any). After a
        rank failed nothing can be read from the ranks' pages: the cache is not persisted."""
        try:
            if self.runner.failed:
                log.warning("a sequence-parallel rank failed: the prefix cache is not persisted")
            else:
                self.persist_prefix_cache()
                if self.kv_mover is not None:
                    self.kv_mover.close()
        finally:
            self.runner.shutdown()
            self._free_device_memory()

    def _free_device_memory(self) -> None:
        """On CUDA, hand the KV pool, the captured graphs and the weights back to the device, so
        a closed engine holds no GPU memory (another engine in the same process sizes its pool
        from what is free)."""
        if self.device.type != "cuda":
            return
        import gc

        self.runner.graphs = None
        self.kv.release()
        self.model.to("meta")
        gc.collect()
        torch.cuda.empty_cache()

    def persist_prefix_cache(self) -> int:
        """Write every cached page to the disk tier (if there is one); returns pages written."""
        if self.prefix_cache is None:
            return 0
        self.run_pending_kv_orders()
        return self.prefix_cache.persist()

    def run_pending_kv_orders(self) -> None:
        """Carry out, now, the KV orders not yet run (draft compactions of the last step,
        copies the prefix store planned outside a step by a direct ``make_room``), and wait
        for the disk thread's queue."""
        output = self.scheduler.pending_orders()
        self.scheduler.update(output, self.runner.execute(output))
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
        self.check_params(params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        arrival = time.perf_counter()
        self.scheduler.add(Request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt,
                                   stop_token_ids=stop_ids))
        self.processor.add(request_id, prompt, prompt_token_ids, params, arrival)
        return request_id

    def abort(self, request_id: str) -> None:
        self.processor.abort(request_id)
        self.scheduler.finish_request(request_id, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output(self, request_id: str) -> RequestOutput:
        return self.processor.output(request_id)

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a finished request; the engine forgets it."""
        return self.processor.release(request_id)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepUpdate]:
        """One transaction: schedule -> execute -> update, then the caller's view of it."""
        output = self.scheduler.schedule()
        if not output.seqs and not output.wait_for_disk and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any request (KV pool too small?)")
        began = time.perf_counter()
        result = self.runner.execute(output)
        updates = self.scheduler.update(output, result)
        return self.processor.process(output, result, updates, began, time.perf_counter())
