"""A step's integer inputs: the scheduler's plain data flattened over its sequences, and the
one upload that takes them to the device.

Owns: ``flatten_batch`` (token ids, positions, KV slots, tree-mask words and the rows that
sample, in step order) and ``InputPacker`` (one host tensor, pinned on CUDA, uploaded in one
non-blocking copy and sliced on the device). Used by the one-process runner, the
sequence-parallel ranks and the CUDA graphs' static inputs. Never: requests, the model.

A sequence with a draft tree computes ``[last token, node 0, node 1, ...]``: their KV goes to
consecutive slots in that order, their positions are the last token's plus each node's depth,
and each sees the cached context plus its ancestors (the tree mask). It gets one logits row
per token: row 0 predicts what follows the last token, row ``i + 1`` what follows node ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from longctx.lookahead.tree import tree_ancestor_words, tree_depths
from longctx.model.rope import long_rope_tokens
from longctx.engine.outputs import SchedulerOutput


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
    seq_rope_long: list[bool] | None = None  # per sequence: LongRoPE's long table

    def rope_long(self, config, device: torch.device) -> torch.Tensor | None:
        """LongRoPE's per-token table choice on ``device`` (``rope.long_rope_tokens``), or None."""
        flags = long_rope_tokens(config, self.seq_rope_long or [], self.query_lens)
        return None if flags is None else torch.tensor(flags, dtype=torch.bool).to(device)


def flatten_batch(batch: SchedulerOutput, block_size: int) -> StepInputs:
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
                      [s.start_pos + len(s.token_ids) for s in batch.seqs], words, rows,
                      [s.rope_long for s in batch.seqs])


class InputPacker:
    """A step's integer inputs as one host tensor (pinned when the device is CUDA), copied to
    the device in one non-blocking upload and sliced there: ids, positions, slots, the query
    start offsets, context lengths, the block table and the tree mask. A new tensor per step:
    the upload is asynchronous, and a step that samples nothing ends without a sync, so a
    reused buffer could be overwritten while the GPU still copies it (PyTorch's pinned-memory
    cache hands a block out again only after its copies finish). ``uploads`` and
    ``downloads`` count the copies (tests hold the step to one of each)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.uploads = self.downloads = 0

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        self.uploads += 1
        return host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)

    def upload_ints(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device (one upload)."""
        return self.upload(torch.tensor(values, dtype=torch.int64, pin_memory=self.pin))

    def download(self, values: torch.Tensor) -> list:
        self.downloads += 1
        return values.tolist()

    def pack(self, step: StepInputs, table: list[list[int]],
             tail: list[int] | None = None,
             ring: tuple[list[int], list[list[int]]] | None = None) -> dict[str, torch.Tensor | None]:
        """The device tensors of ``step``: ids, positions, slots, cu_seqlens_q, context_lens,
        block_table (int32 [B, W]), tree_mask (or None), rows (the tokens to sample) and, when
        given, ``tail`` (an exact-tail plan's ints) and ``ring`` (a window ring's slots and
        table: ``ring_slots``, ``ring_table`` int32 [B, W]) in the same upload."""
        num_seqs = len(step.query_lens)
        width = len(table[0]) if table else 0
        parts = {"ids": step.token_ids, "positions": step.positions, "slots": step.slots,
                 "cu_seqlens_q": list(accumulate(step.query_lens, initial=0)),
                 "cu_seqlens_k": list(accumulate(step.context_lens, initial=0)),
                 "context_lens": step.context_lens,
                 "block_table": [b for row in table for b in row], "rows": step.sample_rows}
        if step.tree_words is not None:
            parts["tree_mask"] = step.tree_words
        if tail is not None:
            parts["tail"] = tail
        if ring is not None:
            parts["ring_slots"], parts["ring_table"] = ring[0], [b for row in ring[1] for b in row]
        sizes = [len(p) for p in parts.values()]
        dev = self.upload_ints([x for part in parts.values() for x in part])
        out: dict[str, torch.Tensor | None] = dict(zip(parts, torch.split(dev, sizes)))
        for name in ("cu_seqlens_q", "cu_seqlens_k", "context_lens", "block_table"):  # int32 inputs
            out[name] = out[name].to(torch.int32)
        out["block_table"] = out["block_table"].view(num_seqs, width)
        if ring is not None:
            out["ring_table"] = out["ring_table"].to(torch.int32).view(num_seqs, width)
        out.setdefault("tree_mask", None)
        return out
