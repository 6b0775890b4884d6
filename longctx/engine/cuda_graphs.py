"""CUDA graphs for decode and lookahead-verify steps: the model's forward and logits for a
batch in which every sequence computes its last token (plus, when verifying, its draft
nodes), captured at start-up for padded shapes and replayed.

Owns: the static input buffers, padding a step to a captured shape, capture and replay.
Never: sampling (it runs after the graph, on its output) or choosing what runs.

Shapes. A graph is captured per (sequences, tokens per sequence): decode graphs (1 token) for
batch sizes 1, 2, 4, 8, 16, ... up to ``max_num_seqs``, and verify graphs for widths 2, 4, 8,
... up to 1 + the most draft tokens a step may carry, for batch sizes whose total stays under
``MAX_GRAPH_TOKENS``. A step qualifies when every sequence samples and computes only its last
token and its draft (no prefill chunk), and it fits a captured shape; it runs in the smallest
one that fits.

Padding. Each sequence's tokens are ``[last token, its draft nodes, pads]`` up to the width; a
pad is a child of the root (its tree word: the root and itself), so no real token sees it, and
its K/V go to the sequence's next slots as draft nodes' do: inside the sequence's own pages
(slots later tokens overwrite, as they do a rejected draft's) or, past them, to a scratch page
reserved at start-up that the block pool never hands out (the block table is filled with it).
Every slot a step's attention reads is written earlier in that step or holds real KV, so no
uninitialised (possibly NaN) value reaches a real row. Extra sequences of a padded batch live
on the scratch page alone. The real rows' logits are gathered with the step's packed rows.

What a capture fixes: the kernels' launch plans (Triton: the split count for the longest
context the engine allows, ``max_model_len``; shorter contexts leave splits empty, which the
merge ignores), the RoPE table, the buffers' addresses. The inputs are packed on the host and
uploaded in one copy as any step's (``step_inputs.InputPacker``), then copied device-to-device into
the static buffers. Every graph writes its logits into one static buffer.

On a machine without CUDA the same padded path runs eagerly (``capture=False``): how the tests
check padding, the scratch page and the static buffers against the plain runner. The capture
itself has not run here (no GPU in this project's CI).
"""

from __future__ import annotations

import logging
from itertools import accumulate

import torch

from longctx.attention import AttentionMetadata
from longctx.kv.exact_tail import FIELDS, TailPlan, TailSeq, TailStep
from longctx.engine.step_inputs import flatten_batch
from longctx.engine.outputs import SchedulerOutput

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256
MAX_GRAPH_TOKENS = 512  # verify graphs: sequences x width at most this


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch`` (vLLM's shape): few graphs, little padding."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def graph_shapes(max_batch: int, max_draft: int) -> list[tuple[int, int]]:
    """(sequences, tokens per sequence) to capture: every batch size at width 1, then widths
    2, 4, ... up to the power of two covering ``1 + max_draft``, each for the batch sizes
    whose total is at most ``MAX_GRAPH_TOKENS``."""
    sizes = graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
    shapes = [(s, 1) for s in sizes]
    width = 2
    while max_draft and width // 2 < 1 + max_draft:
        shapes += [(s, width) for s in sizes if s * width <= MAX_GRAPH_TOKENS]
        width *= 2
    return shapes


class StepGraphs:
    def __init__(self, runner, max_batch: int, max_model_len: int, scratch_block: int,
                 capture: bool, max_draft: int = 0) -> None:
        self.runner = runner
        self.model, self.backend, self.kv = runner.model, runner.backend, runner.kv
        self.device = runner.device
        self.block_size = self.kv.block_size
        self.max_model_len = max_model_len
        self.shapes = graph_shapes(max_batch, max_draft)
        self.max_tokens = max(s * w for s, w in self.shapes)
        self.max_batch = max(s for s, _ in self.shapes)
        self.width = -(-max_model_len // self.block_size)  # block table columns
        self.scratch_block = scratch_block
        self.capture_enabled = capture
        for caches in self.kv.caches:  # the scratch page starts finite (and int8 scales at 0)
            for t in caches:
                t[scratch_block].zero_()
        t, n, dev = self.max_tokens, self.max_batch, self.device
        self.ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)
        self.slots = torch.full((t,), scratch_block * self.block_size, dtype=torch.long, device=dev)
        self.tree = torch.ones(t, dtype=torch.int64, device=dev)
        self.rows = torch.zeros(t, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_table = torch.full((n, self.width), scratch_block, dtype=torch.int32, device=dev)
        self.cu_q = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.cu_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        # int8 pages: the exact tail's plan (``TailPlan.fixed`` per shape; its store is sized
        # for ``max_num_seqs`` before the capture, so its tensors stay where the graphs read them)
        self.tail_ints = (torch.zeros(3 * t + FIELDS * n, dtype=torch.long, device=dev)
                          if self.kv.tail is not None else None)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # every graph writes its logits here (one buffer, not one per captured shape: the
        # shapes share the graph memory pool, and a held output per shape could not be shared)
        self.logits = torch.empty(t, self.model.config.vocab_size, dtype=torch.float32, device=dev)
        self.pool = None
        self.num_replays = 0

    # ------------------------------------------------------------------ which steps

    def shape_for(self, batch: SchedulerOutput) -> tuple[int, int] | None:
        """The smallest captured shape ``batch`` fits, or None if it does not qualify."""
        seqs = batch.seqs
        if not seqs or not all(s.sample and len(s.token_ids) == 1 + s.num_draft
                               and len(s.block_ids) <= self.width for s in seqs):
            return None
        need = max(len(s.token_ids) for s in seqs)
        fits = [(s, w) for s, w in self.shapes if s >= len(seqs) and w >= need and (w == 1) == (need == 1)]
        if not fits:
            return None
        size, width = min(fits, key=lambda sw: (sw[0] * sw[1], sw[1]))
        # padded contexts must stay within what the capture planned for (and the table's width)
        if any(s.start_pos + width > self.max_model_len for s in seqs):
            return None
        return size, width

    def can_run(self, batch: SchedulerOutput) -> bool:
        return self.shape_for(batch) is not None

    # ------------------------------------------------------------------ inputs

    def _meta(self, size: int, width: int, context_lens: list[int] | None = None,
              tables: list[list[int]] | None = None) -> AttentionMetadata:
        """Metadata over the static buffers for ``size`` sequences of ``width`` tokens. Host
        lists (read only by the CPU kernels) come in the eager path; a capture uses the widest
        extents."""
        tokens = size * width
        return AttentionMetadata(
            query_lens=[width] * size, context_lens=context_lens or [self.max_model_len] * size,
            cu_seqlens_q=self.cu_q[:size + 1], context_lens_t=self.context_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slots[:tokens],
            tree_mask=self.tree[:tokens] if width > 1 else None, kv_caches=self.kv.caches, kv_format=self.kv.format,
            max_query_len=width, max_context_len=max(context_lens) if context_lens else self.max_model_len,
            max_position=self.max_model_len, host_block_table=tables, cu_seqlens_k=self.cu_k[:size + 1],
            tail=self._tail(size, width))

    def _tail(self, size: int, width: int) -> TailStep | None:
        if self.tail_ints is None:
            return None
        plan = TailPlan.fixed(size, width, self.block_size)
        tokens = size * width
        return TailStep(plan, self.tail_ints[:sum(plan.sizes)], self.kv.tail, self.positions[:tokens],
                        self.tree[:tokens] if width > 1 else None, self.block_table[:size])

    def _slot(self, block_ids: list[int], pos: int) -> int:
        bs = self.block_size
        block = block_ids[pos // bs] if pos // bs < len(block_ids) else self.scratch_block
        return block * bs + pos % bs

    def _load_inputs(self, batch: SchedulerOutput, size: int, width: int):
        """Pack the step (padded to ``size`` x ``width``) on the host, upload once, copy into
        the static buffers. Returns the host context lengths, block table rows and the number
        of real rows."""
        step = flatten_batch(batch, self.block_size)  # the real tokens, as the plain runner has them
        ids, positions, slots, tree, ctx, table, rows = [], [], [], [], [], [], []
        start = 0
        for i, s in enumerate(batch.seqs):
            n = len(s.token_ids)
            real, pads = slice(start, start + n), range(n, width)
            ids += step.token_ids[real] + [0] * len(pads)
            positions += step.positions[real] + [s.start_pos + 1] * len(pads)
            slots += step.slots[real] + [self._slot(s.block_ids, s.start_pos + k) for k in pads]
            words = step.tree_words[real] if step.tree_words is not None else [1]
            tree += words + [1 | 1 << k for k in pads]
            ctx.append(s.start_pos + width)
            table.append(s.block_ids + [self.scratch_block] * (self.width - len(s.block_ids)))
            rows += range(i * width, i * width + n)
            start += n
        for _ in range(size - len(batch.seqs)):  # extra sequences, on the scratch page alone
            ids += [0] * width
            positions += list(range(width))
            slots += [self._slot([], k) for k in range(width)]
            tree += [1] + [1 | 1 << k for k in range(1, width)]
            ctx.append(width)
            table.append([self.scratch_block] * self.width)
        tokens = size * width
        cu_q = [i * width for i in range(size + 1)]
        cu_k = list(accumulate(ctx, initial=0))
        parts = [ids, positions, slots, tree, rows, ctx, [b for r in table for b in r], cu_q, cu_k]
        if self.tail_ints is not None:  # the padded rows are drafts / decodes of their sequences
            seqs = [TailSeq(s.tail_slot, s.start_pos, width, i * width, width > 1) for i, s in enumerate(batch.seqs)]
            seqs += [TailSeq(-1, 0, width, i * width, width > 1) for i in range(len(batch.seqs), size)]
            plan = TailPlan(seqs, self.kv.tail, tokens, widths=(width, 2 * self.block_size - 1 + width))
            parts.append(plan.ints)
        dev = torch.split(self.runner.packer.upload_ints([x for p in parts for x in p]), [len(p) for p in parts])
        self.ids[:tokens].copy_(dev[0])
        self.positions[:tokens].copy_(dev[1])
        self.slots[:tokens].copy_(dev[2])
        self.tree[:tokens].copy_(dev[3])
        self.rows[:len(rows)].copy_(dev[4])
        self.context_lens[:size].copy_(dev[5])
        self.block_table[:size].copy_(dev[6].view(size, self.width))
        self.cu_q[:size + 1].copy_(dev[7])
        self.cu_k[:size + 1].copy_(dev[8])
        if self.tail_ints is not None:
            self.tail_ints[:dev[9].numel()].copy_(dev[9])
        return ctx, table, len(rows)

    def _forward(self, size: int, width: int, meta: AttentionMetadata) -> torch.Tensor:
        tokens = size * width
        hidden = self.model(self.ids[:tokens], self.positions[:tokens], self.backend, meta)
        return self.model.compute_logits(hidden)

    # ------------------------------------------------------------------ capture and replay

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per shape, largest first (they share one memory pool)."""
        if not self.capture_enabled:
            return
        self.model.rotary_for(self.device).cos_sin(self.positions[:1], self.max_model_len)  # table ready
        stream = torch.cuda.Stream(self.device)
        for size, width in sorted(self.shapes, key=lambda sw: -sw[0] * sw[1]):
            self.cu_q[:size + 1].copy_(torch.arange(size + 1, device=self.device) * width)
            meta = self._meta(size, width)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
                for _ in range(2):
                    self._forward(size, width, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            meta = self._meta(size, width)  # new: nothing the warm-up planned outlives it
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:size * width].copy_(self._forward(size, width, meta))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(size, width)] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for %d (sequences, tokens per sequence) shapes", len(self.shapes))

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits of the step's sampled rows, in the runner's order (``can_run(batch)``)."""
        size, width = self.shape_for(batch)
        ctx, table, num_rows = self._load_inputs(batch, size, width)
        if (size, width) in self.graphs:
            self.graphs[(size, width)].replay()
            self.num_replays += 1
            logits = self.logits[:size * width]
        else:
            logits = self._forward(size, width, self._meta(size, width, ctx, table))
        if width == 1:
            return logits[:num_rows]
        return logits.index_select(0, self.rows[:num_rows])

