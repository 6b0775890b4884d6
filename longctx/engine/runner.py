"""The model runner: ``execute(SchedulerOutput) -> RunnerOutput``.

Owns: a step's KV orders (draft compaction, tier copies, disk reads), turning the scheduler's
plain data into tensors (ids, positions, slot mapping, block table, lengths, the tree mask of
lookahead drafts), calling the model, picking the hidden states that need logits, sampling
them and judging drafts; per request, what sampling needs (sent once). Never: ``Request``s,
stop rules or deciding what runs.

A step's tokens, slots and tree masks are laid out by ``longctx.engine.step_inputs`` (one upload).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from longctx.attention import AttentionMetadata
from longctx.kv.device_pool import DeviceKVPool, KVPages
from longctx.kv.exact_tail import TailPlan, TailStep, fill_first_pages, first_pages_to_fill, tail_seqs
from longctx.kv.mover import KVMover
from longctx.lookahead.acceptance import accept_tokens
from longctx.lookahead.tree import DraftTree
from longctx.model.llama import LlamaForCausalLM
from longctx.engine.outputs import DraftMove, RunnerOutput, SampledSeq, ScheduledSeq, SchedulerOutput
from longctx.sampling import PenaltyState, Sampler, SeqSampling, sampling_rows
from longctx.sampling_params import SamplingParams
from longctx.engine.step_inputs import InputPacker, flatten_batch

DISK_WAIT_S = 0.05  # a step with nothing to compute waits this long for a disk read to finish


@dataclass
class SeqResult:
    """What a step sampled for one sampling sequence: a token per row (root first, then one
    per draft node), and, when asked, the chosen tokens' log-probabilities and the top ones."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Runner(Protocol):
    """What the engine uses of a runner: ``ModelRunner`` (one process) and
    ``longctx.engine.sp.SequenceParallelRunner`` (rank 0 of N) both are one."""

    kv: KVPages
    kv_mover: KVMover | None
    failed: bool  # a rank failed: nothing can be read from the pages any more

    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...

    def shutdown(self) -> None: ...

    def worker_pids(self) -> list[int]: ...  # the SP ranks' processes (none in one process)

    def rank_health(self) -> str | None: ...  # why a rank cannot take part in a step, or None


@dataclass
class _RequestState:
    """What the runner keeps of a request between steps: its sampling parameters, prompt and
    the tokens it sampled for it (penalties and seeded draws read them)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


class SamplingRunner:
    """``execute(SchedulerOutput) -> RunnerOutput``: the step's KV orders, the forward
    (``forward``, the subclass's), the batched device sampler with one device-to-host copy of
    the sampled tokens, and the acceptance of lookahead drafts. Shared by the single-device
    runner and the sequence-parallel one (whose rank 0 holds the logits)."""

    sampler: Sampler
    penalties: PenaltyState
    packer: InputPacker
    kv_mover: KVMover | None = None  # executes the prefix store's tier copies and disk reads

    def _init_sampling(self, vocab_size: int, device: torch.device) -> None:
        self.packer = InputPacker(device)
        self.sampler = Sampler(upload=self.packer.upload)
        self.penalties = PenaltyState(vocab_size, device)
        self.requests: dict[str, _RequestState] = {}
        self.disk_loads: dict[str, Any] = {}  # started reads, by request
        self.prompt_logprobs: dict = {}  # the last forward's (``RunnerOutput.prompt_logprobs``)

    def apply_kv_orders(self, orders: list) -> None:
        """Carry out a step's KV tier copies (before its forward, in order)."""
        if orders:
            self.kv_mover.execute(orders)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Run ``output``'s orders in the order ``SchedulerOutput`` states, compute its seqs,
        sample the ones that sample and judge their drafts."""
        for request_id in output.finished_ids:
            self.requests.pop(request_id, None)
            self.penalties.forget(request_id)
        for new in output.new_requests:
            self.requests[new.request_id] = _RequestState(new.params, new.prompt_token_ids)
        for move in output.draft_moves:
            self.move_draft_kv(move)
        self.apply_kv_orders(output.kv_orders)
        result = RunnerOutput(finished_loads=self._run_disk_loads(output))
        if output.seqs:
            self.prompt_logprobs = {}
            logits = self.forward(output)
            result.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, {}
            result.sampled = self._sample(output, logits)
        return result

    def _run_disk_loads(self, output: SchedulerOutput) -> list:
        """Start ``output``'s disk reads; write the pages of reads that completed (waiting a
        moment when the step has nothing else to do) unless their request ended meanwhile."""
        for request_id in output.finished_ids:
            self.disk_loads.pop(request_id, None)
        for load in output.disk_loads:  # read on the disk thread; the requests wait meanwhile
            self.disk_loads[load.request_id] = load
            self.kv_mover.submit_read(load)
        if not self.disk_loads:
            return []
        done = []
        for load in self.kv_mover.completed_reads(DISK_WAIT_S if output.wait_for_disk else 0.0):
            if self.disk_loads.get(load.request_id) is not load:
                continue  # aborted (its id maybe reused): its blocks are gone, nothing is written
            del self.disk_loads[load.request_id]
            if load.num_read:
                self.kv_mover.write_pages(list(load.device_ids[:load.num_read]), load.buffer[:load.num_read])
            done.append(load)
        return done

    def _sample(self, output: SchedulerOutput, logits: torch.Tensor) -> dict[str, SampledSeq]:
        """Sample every row of the sampling seqs, walk their drafts and keep the tokens."""
        seqs = [s for s in output.seqs if s.sample]
        rows = self._sample_rows(logits, [self._seq_sampling(s) for s in seqs])
        sampled = {}
        for seq, res in zip(seqs, rows):
            if seq.num_draft:
                accepted = accept_tokens(DraftTree(seq.token_ids[1:], list(seq.draft_parents)), res.tokens)
                out = SampledSeq(accepted.tokens, seq.num_draft, accepted.accepted_nodes)
                kept = accepted.kept_queries
            else:
                out, kept = SampledSeq(res.tokens[:1]), [0]
            if res.logprobs is not None:
                out.logprobs = []
                for row, token in zip(kept, out.token_ids):
                    entry = dict(zip(res.top_ids[row], res.top_logprobs[row]))
                    entry[token] = res.logprobs[row]
                    out.logprobs.append(entry)
            self.requests[seq.request_id].output_ids.extend(out.token_ids)
            sampled[seq.request_id] = out
        return sampled

    def _seq_sampling(self, seq: ScheduledSeq) -> SeqSampling:
        state = self.requests[seq.request_id]
        return SeqSampling(seq.request_id, state.params, len(state.output_ids),
                           tuple(seq.token_ids[1:]) if seq.num_draft else (), seq.draft_parents,
                           state.prompt_ids, state.output_ids)

    def _sample_rows(self, logits: torch.Tensor, seqs: list[SeqSampling]) -> list[SeqResult]:
        """One token per row of ``seqs`` (``1 + num_draft`` rows each, in order), with the
        log-probabilities of those that asked for them."""
        if not seqs:
            return []
        result = self.sampler.sample(logits, sampling_rows(seqs, self.penalties))
        if result.logprobs is None:
            tokens = self.packer.download(result.tokens)
            extra = None
        else:  # logprobs asked: pack them with the tokens into one copy
            k = result.top_ids.shape[1]
            packed = torch.cat([result.tokens[:, None].double(), result.logprobs[:, None].double(),
                                result.top_ids.double(), result.top_logprobs.double()], dim=1)
            rows = self.packer.download(packed)
            tokens = [int(r[0]) for r in rows]
            extra = [(r[1], [int(x) for x in r[2:2 + k]], r[2 + k:]) for r in rows]
        out, start = [], 0
        for s in seqs:
            end = start + s.num_rows
            res = SeqResult(tokens[start:end])
            if extra is not None and s.params.logprobs is not None:
                n = s.params.logprobs
                res.logprobs = [e[0] for e in extra[start:end]]
                res.top_ids = [e[1][:n] for e in extra[start:end]]
                res.top_logprobs = [e[2][:n] for e in extra[start:end]]
            out.append(res)
            start = end
        return out


class ModelRunner(SamplingRunner):
    def __init__(self, model: LlamaForCausalLM, kv: DeviceKVPool, backend, device: torch.device) -> None:
        self.model, self.kv, self.backend, self.device = model, kv, backend, torch.device(device)
        self.block_size = kv.block_size
        self._init_sampling(model.config.vocab_size, self.device)
        self.graphs = None  # a ``cuda_graphs.StepGraphs`` replays decode and verify steps when set
        self.failed = False

    def shutdown(self) -> None:
        """Nothing to stop in one process."""

    def worker_pids(self) -> list[int]:
        return []

    def rank_health(self) -> str | None:
        """One process: always live."""
        return None

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        step = flatten_batch(batch, self.block_size)
        width = max(len(s.block_ids) for s in batch.seqs)
        table = [s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.seqs]
        plan = None
        if self.kv.tail is not None:  # an exact tail: each query's own page exact
            plan = TailPlan(tail_seqs(batch.seqs, step.query_lens), self.kv.tail, len(step.token_ids))
        ring = None
        if self.kv.ring is not None:  # the windowed layers' rows in their sequences' rings
            r = self.kv.ring
            ring = ([x for s in batch.seqs for x in r.slots(s.tail_slot, range(s.start_pos, s.start_pos + len(s.token_ids)))],
                    [r.table_row(s.tail_slot, width, r.first_key(s.start_pos)) for s in batch.seqs])
        t = self.packer.pack(step, table, plan.ints if plan else None, ring)
        meta = AttentionMetadata(
            query_lens=step.query_lens, context_lens=step.context_lens, cu_seqlens_q=t["cu_seqlens_q"],
            context_lens_t=t["context_lens"], block_table=t["block_table"], slot_mapping=t["slots"],
            tree_mask=t["tree_mask"], cu_seqlens_k=t["cu_seqlens_k"],
            kv_caches=self.kv.caches, kv_format=self.kv.format, max_query_len=max(step.query_lens),
            max_context_len=max(step.context_lens), max_position=max(step.positions) + 1,
            host_block_table=table, rope_long=step.rope_long(self.model.config, self.device))
        if ring is not None:
            meta.ring = (t["ring_table"], t["ring_slots"], ring[1])
        if plan is not None:
            meta.tail = TailStep(plan, t["tail"], self.kv.tail, t["positions"], t["tree_mask"], t["block_table"])
        return t["ids"], t["positions"], meta, (step.sample_rows, t["rows"])

    @torch.inference_mode()
    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits (fp32) for the seqs of ``batch`` that sample, in order: one row each, or
        ``1 + num_draft`` rows for a seq with a draft tree."""
        if self.kv.tail is not None:  # an exact tail: prefix hits' first pages, exact
            fill_first_pages(self.model, self.kv.tail, first_pages_to_fill(batch.seqs),
                             self.kv.format.rotation(self.device))
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        input_ids, positions, meta, (rows, rows_t) = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.backend, meta)  # (T, E)
        if any(s.logprob_targets for s in batch.seqs):
            self.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if not rows:
            return torch.empty(0, self.model.config.vocab_size, device=hidden.device)
        if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous: a view
            return self.model.compute_logits(hidden[rows[0]:rows[0] + len(rows)])
        return self.model.compute_logits(hidden.index_select(0, rows_t))

    def _prompt_logprobs(self, batch: SchedulerOutput, hidden: torch.Tensor,
                         rows_per_block: int = 512) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """For seqs with ``logprob_targets``: the log-probability of each next prompt token and
        the top ``prompt_logprobs`` ones, from the raw distribution, ``rows_per_block`` logits
        rows at a time (a row is V floats). Costs one upload and one download per block."""
        found: dict[str, tuple[int, list[dict[int, float]]]] = {}
        start = 0
        for seq in batch.seqs:
            targets = seq.logprob_targets
            if targets:
                k = self.requests[seq.request_id].params.prompt_logprobs
                entries: list[dict[int, float]] = []
                for a in range(0, len(targets), rows_per_block):
                    block = targets[a:a + rows_per_block]
                    logp = torch.log_softmax(self.model.compute_logits(
                        hidden[start + a:start + a + len(block)]), dim=-1)
                    ids = self.packer.upload(torch.tensor(block))
                    chosen = logp.gather(1, ids[:, None])
                    top = torch.topk(logp, k, dim=-1)
                    packed = self.packer.download(torch.cat([chosen.double(), top.indices.double(),
                                                             top.values.double()], dim=1))
                    for token, row in zip(block, packed):
                        entry = {int(i): v for i, v in zip(row[1:1 + k], row[1 + k:])}
                        entry[token] = row[0]
                        entries.append(entry)
                found[seq.request_id] = (seq.start_pos + 1, entries)
            start += len(seq.token_ids)
        return found

    def move_draft_kv(self, move: DraftMove) -> None:
        ring = None
        if self.kv.ring is not None:  # the windowed layers' rows move in their ring
            ring = tuple(self.kv.ring.slots(move.tail_slot, p) for p in draft_position_moves(move.start_pos, move.accepted))
        self.kv.move_slots(*draft_slot_moves(move.block_ids, move.start_pos, move.accepted, self.block_size), ring)
        if self.kv.tail is not None:  # the exact rows of the newest pages move alike
            self.kv.tail.move(move.tail_slot, *draft_position_moves(move.start_pos, move.accepted))


def draft_position_moves(start_pos: int, accepted: list[int]) -> tuple[list[int], list[int]]:
    """Compacting an accepted draft branch: node ``accepted[j]`` (KV at position ``start_pos +
    1 + accepted[j]``) moves to position ``start_pos + 1 + j``. Returns the (source, target)
    positions of the nodes that move."""
    pairs = [(start_pos + 1 + node, start_pos + 1 + j) for j, node in enumerate(accepted) if node != j]
    return [a for a, _ in pairs], [b for _, b in pairs]


def draft_slot_moves(seq_block_ids: list[int], start_pos: int, accepted: list[int],
                     block_size: int) -> tuple[list[int], list[int]]:
    """``draft_position_moves`` as KV slots; the pool copies all sources before writing any
    target."""
    def slot(p: int) -> int:
        return seq_block_ids[p // block_size] * block_size + p % block_size

    src, dst = draft_position_moves(start_pos, accepted)
    return [slot(a) for a in src], [slot(b) for b in dst]
