"""CUDA graphs for decode steps: the model's forward and logits for a batch of sequences that
each compute one new token, captured once per padded batch size at start-up and replayed.

Owns: the static input buffers, padding a step to a captured size, capture and replay.
Never: sampling (it runs after the graph, on its output) or choosing what runs.

A step qualifies when every sequence computes exactly one token (no prefill chunk, no draft
tree) and the batch fits the largest captured size. Its inputs are packed on the host and
uploaded in one copy as any step's (``runner.InputPacker``), then copied device-to-device
into the static buffers, so the graph always reads the same addresses. A padded batch's extra
rows are dummy sequences of one token whose KV goes to a scratch page reserved for them at
start-up (the block pool never hands it out) and which attend only to it.

What the graph fixes at capture: the kernels' launch plans (Triton: the split count for the
longest context the engine allows, ``max_model_len``; shorter contexts leave splits empty,
which the merge ignores), the RoPE table, and the addresses of every buffer. So the capture
uses ``extents=(1, max_model_len)`` and the largest block table width; the graph is correct
for every step that fits.

On a machine without CUDA the same padded path runs eagerly (``capture=False``), which is
how the tests check the padding, the scratch page and the static buffers against the plain
runner; the capture itself has not run here (no GPU in this project's CI).
"""

from __future__ import annotations

import logging

import torch

from longctx.attention import AttentionMetadata
from longctx.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch`` (vLLM's shape): few graphs, little padding."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_model_len: int, scratch_block: int,
                 capture: bool) -> None:
        self.runner = runner
        self.model, self.backend, self.kv = runner.model, runner.backend, runner.kv
        self.device = runner.device
        self.block_size = self.kv.block_size
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
        self.max_batch = self.sizes[-1]
        self.width = -(-max_model_len // self.block_size)  # block table columns
        self.scratch_block = scratch_block
        self.capture_enabled = capture
        n, dev = self.max_batch, self.device
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_block * self.block_size, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_table = torch.full((n, self.width), scratch_block, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.cu_k = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every graph writes its logits here (one buffer, not one per captured size: the sizes
        # share the graph memory pool, and a held output per size could not be shared)
        self.logits = torch.empty(n, self.model.config.vocab_size, dtype=torch.float32, device=dev)
        self.pool = None
        self.num_replays = 0

    # ------------------------------------------------------------------ which steps

    def can_run(self, batch: ScheduledBatch) -> bool:
        seqs = batch.seqs
        return (0 < len(seqs) <= self.max_batch
                and all(len(s.token_ids) == 1 and not s.num_draft and s.sample for s in seqs)
                and all(len(s.block_ids) <= self.width for s in seqs))

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    # ------------------------------------------------------------------ inputs

    def _meta(self, size: int, context_lens: list[int] | None = None,
              tables: list[list[int]] | None = None) -> AttentionMetadata:
        """Metadata over the static buffers' first ``size`` rows. Host lists (used only by the
        CPU kernels) are given in the eager path; a capture uses the widest extents."""
        meta = AttentionMetadata(
            query_lens=[1] * size, context_lens=context_lens or [self.max_model_len] * size,
            cu_seqlens_q=self.cu_q[:size + 1], context_lens_t=self.context_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slots[:size], tree_mask=None,
            kv_caches=self.kv.layers, max_query_len=1,
            max_context_len=max(context_lens) if context_lens else self.max_model_len,
            max_position=self.max_model_len, host_block_table=tables, cu_seqlens_k=self.cu_k[:size + 1])
        return meta

    def _load_inputs(self, batch: ScheduledBatch, size: int) -> tuple[list[int], list[list[int]]]:
        """Pack the step (padded to ``size``) on the host, upload once, copy into the static
        buffers. Returns the padded context lengths and block table rows (host)."""
        bs, scratch = self.block_size, self.scratch_block
        ids, positions, slots, ctx, table = [], [], [], [], []
        for s in batch.seqs:
            pos = s.start_pos
            ids.append(s.token_ids[0])
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            ctx.append(pos + 1)
            table.append(s.block_ids + [scratch] * (self.width - len(s.block_ids)))
        for _ in range(size - len(batch.seqs)):  # dummy sequences on the scratch page
            ids.append(0)
            positions.append(0)
            slots.append(scratch * bs)
            ctx.append(1)
            table.append([scratch] * self.width)
        flat = ids + positions + slots + ctx + [b for row in table for b in row]
        packer = self.runner.packer
        host = packer.host_buffer(len(flat))
        host.copy_(torch.tensor(flat, dtype=torch.int64))
        dev = packer.upload(host)
        parts = torch.split(dev, [size, size, size, size, size * self.width])
        self.ids[:size].copy_(parts[0])
        self.positions[:size].copy_(parts[1])
        self.slots[:size].copy_(parts[2])
        self.context_lens[:size].copy_(parts[3])
        self.block_table[:size].copy_(parts[4].view(size, self.width))
        self.cu_k[1:size + 1].copy_(torch.cumsum(self.context_lens[:size], 0))
        return ctx, table

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.ids[:size], self.positions[:size], self.backend, meta)
        return self.model.compute_logits(hidden)

    # ------------------------------------------------------------------ capture and replay

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first (they share one memory pool)."""
        if not self.capture_enabled:
            return
        self.model.rotary_for(self.device).cos_sin(self.positions[:1], self.max_model_len)  # table ready
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            meta = self._meta(size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
                for _ in range(2):
                    self._forward(size, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:size].copy_(self._forward(size, meta))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches of %s sequences", self.sizes)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [B, V] of a decode step (``can_run(batch)`` must hold)."""
        num_seqs = len(batch.seqs)
        size = self.padded_size(num_seqs)
        ctx, table = self._load_inputs(batch, size)
        if size in self.graphs:
            self.graphs[size].replay()
            self.num_replays += 1
            return self.logits[:num_seqs]
        return self._forward(size, self._meta(size, ctx, table))[:num_seqs]
