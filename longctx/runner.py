"""The model runner: a ``ScheduledBatch`` of ints in, next-token logits out.

Owns: turning the scheduler's plain data into tensors (ids, positions, slot mapping, block
table, lengths, the tree mask of lookahead drafts), calling the model, and picking the hidden
states that need logits. Never: requests, sampling, or deciding what runs.

A sequence with a draft tree computes ``[last token, node 0, node 1, ...]``: their KV goes to
consecutive slots in that order, their positions are the last token's plus each node's depth,
and each sees the cached context plus its ancestors (the tree mask). It gets one logits row
per token: row 0 predicts what follows the last token, row ``i + 1`` what follows node ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from longctx.attention import AttentionMetadata
from longctx.kv.device_pool import DeviceKVPool
from longctx.model.llama import LlamaForCausalLM
from longctx.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    """One step flattened over its sequences, as host lists (every runner starts here)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each token's K/V goes: block id * BS + offset
    query_lens: list[int]
    context_lens: list[int]
    tree_words: list[int] | None  # per token (kernels' tree mask), None when no seq drafts
    sample_rows: list[int]  # tokens whose hidden state gets logits, in order


def flatten_batch(batch: ScheduledBatch, block_size: int) -> StepInputs:
    """The step's tokens in order, with their positions (a draft node's: the last token's plus
    its depth), KV slots, tree-mask words and the rows that need logits."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    for seq in batch.seqs:
        ids.extend(seq.token_ids)
        memory = range(seq.start_pos, seq.start_pos + len(seq.token_ids))
        slots.extend(seq.block_ids[p // block_size] * block_size + p % block_size for p in memory)
        if seq.num_draft:
            positions.extend(seq.start_pos + d for d in tree_depths(seq.draft_parents))
        else:
            positions.extend(memory)
        if seq.sample:
            rows.extend(range(len(ids) - 1 - seq.num_draft, len(ids)))
    words = None
    if any(seq.num_draft for seq in batch.seqs):
        words = []
        for seq in batch.seqs:
            if seq.num_draft:
                words.extend(tree_ancestor_words(seq.draft_parents))
            else:  # causal within the sequence's new tokens
                words.extend((1 << (i + 1)) - 1 for i in range(len(seq.token_ids)))
    return StepInputs(ids, positions, slots, [len(s.token_ids) for s in batch.seqs],
                      [s.start_pos + len(s.token_ids) for s in batch.seqs], words, rows)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: DeviceKVPool, backend, device: torch.device) -> None:
        self.model, self.kv, self.backend, self.device = model, kv, backend, device
        self.block_size = kv.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        step = flatten_batch(batch, self.block_size)
        width = max(len(s.block_ids) for s in batch.seqs)
        table = [s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            query_lens=step.query_lens, context_lens=step.context_lens,
            cu_seqlens_q=torch.tensor(list(accumulate(step.query_lens, initial=0)), dtype=torch.int32, device=dev),
            context_lens_t=torch.tensor(step.context_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(step.slots, dtype=torch.int64, device=dev),
            tree_mask=None if step.tree_words is None else torch.tensor(step.tree_words, dtype=torch.int64, device=dev),
            kv_caches=self.kv.layers)
        return (torch.tensor(step.token_ids, dtype=torch.long, device=dev),
                torch.tensor(step.positions, dtype=torch.long, device=dev), meta, step.sample_rows)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits (fp32) for the seqs of ``batch`` that sample, in order: one row each, or
        ``1 + num_draft`` rows for a seq with a draft tree."""
        input_ids, positions, meta, rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.backend, meta)  # (T, E)
        if not rows:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def move_draft_kv(self, seq_block_ids: list[int], start_pos: int, accepted: list[int]) -> None:
        self.kv.move_slots(*draft_slot_moves(seq_block_ids, start_pos, accepted, self.block_size))


def draft_slot_moves(seq_block_ids: list[int], start_pos: int, accepted: list[int],
                     block_size: int) -> tuple[list[int], list[int]]:
    """Compacting an accepted draft branch: node ``accepted[j]`` (KV at position ``start_pos +
    1 + accepted[j]``) moves to position ``start_pos + 1 + j``. Returns the (source, target)
    slots of the nodes that move; the pool copies all sources before writing any target."""
    def slot(p: int) -> int:
        return seq_block_ids[p // block_size] * block_size + p % block_size

    pairs = [(start_pos + 1 + node, start_pos + 1 + j) for j, node in enumerate(accepted) if node != j]
    return [slot(a) for a, _ in pairs], [slot(b) for _, b in pairs]


def tree_depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Depth of the root (the last token, 0) then of each draft node (parent -1 is the root)."""
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    return depths


def tree_ancestor_words(parents: tuple[int, ...] | list[int]) -> list[int]:
    """The kernels' tree mask for ``[root, node 0, ...]``: bit j of word i says token i sees
    new token j (itself and its ancestors)."""
    words = [1]
    for i, p in enumerate(parents):
        words.append(words[p + 1] | (1 << (i + 1)))
    return words
