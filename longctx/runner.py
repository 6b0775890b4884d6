"""The model runner: a ``ScheduledBatch`` of ints in, next-token logits out.

Owns: turning the scheduler's plain data into tensors (ids, positions, slot mapping, block
table, lengths), calling the model, and picking the hidden states that need logits.
Never: requests, sampling, or deciding what runs.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from longctx.attention import AttentionMetadata
from longctx.kv.device_pool import DeviceKVPool
from longctx.model.llama import LlamaForCausalLM
from longctx.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: DeviceKVPool, backend, device: torch.device) -> None:
        self.model, self.kv, self.backend, self.device = model, kv, backend, device
        self.block_size = kv.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for seq in batch.seqs:
            ids.extend(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + len(seq.token_ids))
            positions.extend(pos)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in pos)
        query_lens = [len(s.token_ids) for s in batch.seqs]
        context_lens = [s.start_pos + len(s.token_ids) for s in batch.seqs]
        width = max(len(s.block_ids) for s in batch.seqs)
        table = [s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.seqs]
        cu = list(accumulate(query_lens, initial=0))
        dev = self.device
        meta = AttentionMetadata(
            query_lens=query_lens, context_lens=context_lens,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            kv_caches=self.kv.layers)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [num sampling seqs, V] (fp32), in the order of ``batch.seqs`` that sample."""
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.backend, meta)  # (T, E)
        last = []
        end = 0
        for seq in batch.seqs:
            end += len(seq.token_ids)
            if seq.sample:
                last.append(end - 1)
        if not last:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)])
