"""The exact tail of int8 KV pages: every query sees its sequence's first page and its own
page at full precision.

With ``kv_cache_dtype='int8'`` the kernels attend over int8 pages as before; then, for each
query at position p, the keys it sees at positions ``0 .. BS - 1`` (the first page: the
attention sink, whose one scale its large first token sets) and ``p // BS * BS .. p`` (its
own page: the 1-64 most recent tokens) have their int8 rows swapped for the rows the model
computed, from the kernel's output and log-sum-exp (``kv_quant.exchange_keys``). These are the
two largest single parts of int8's error in the int8 error study (docs/benchmarks.md), and the
only parts that need no storage beyond three pages per running sequence. What a query sees
exact depends on its position alone: the same with any chunk size, with lookahead or without,
in one process or over ranks, cold or from the prefix cache.

Owns: ``TailStore`` (per layer, exact K and V rows: three pages per sequence slot; the
scheduler gives each running request a slot, ``ScheduledSeq.tail_slot``), ``TailPlan`` /
``TailStep`` (what a step derives once from its plain data and every layer reuses: the rows
to keep, the queries and keys to exchange) and ``fill_first_pages``. Never: which request
holds which slot, the kernels.

Which rows are kept. A query's own-page keys written in earlier steps all lie in the page of
its sequence's first new position (``start_pos``), before it. So a slot holds its sequence's
first page and its last two pages, each in the half its page's parity picks: a lookahead step
whose drafts reach into the next page and are rejected leaves the page before intact, and
accepted drafts move there as their pages' rows do (``TailStore.move``). A sequence starts on a
page boundary when it is first scheduled (prefix hits are whole pages; a preempted request
recomputes); when it starts past its first page (a prefix hit on any tier), the runner
recomputes that page's exact rows from its tokens first (``fill_first_pages``: they see only
each other), so no tier stores them.

Cost: per layer two small attention products per group of queries (a page of a prefill chunk,
or one decoding sequence with its drafts) over at most 2 * BS - 1 + its new tokens keys, one C
call on the CPU (``torch.ops.longctx.tail_exchange``); memory three pages per slot (float32 on
the CPU, else the model's dtype; ``TailStore.nbytes``), outside the KV budget (CUDA's profiled
budget is reduced by it). On the CPU the store is allocated empty and only the slots in use
become resident. ``CacheConfig.kv_quant_exact_tail=False`` turns it off (every key read as stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx.kernels import kv_quant


FIELDS = 11  # numbers per group in a TailPlan


def tail_store_bytes(model, num_slots: int, block_size: int, dtype: torch.dtype) -> int:
    """What a ``TailStore`` of ``num_slots`` slots takes for ``model`` (a ModelConfig)."""
    rows = 1 + (num_slots + 1) * 3 * block_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * rows * model.num_key_value_heads * model.head_dim * itemsize


class TailStore:
    """Exact K/V rows of sequences' last two pages, per layer: ``layers[l] = (K, V)``, each
    ``[1 + (num_slots + 1) * 3 * BS, Hkv, D]``. Row 0 is zero and never written (what keys that
    do not exist read); slot -1 takes the rows nobody keeps (a step writes every row
    somewhere). ``reserve`` grows the slots (a CUDA graph's capture fixes the tensors: the
    engine reserves ``max_num_seqs`` before it)."""

    def __init__(self, num_layers: int, num_slots: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size, self.num_slots = block_size, 0
        self.layers = [(torch.zeros((1, num_kv_heads, head_dim), dtype=dtype, device=device),
                        torch.zeros((1, num_kv_heads, head_dim), dtype=dtype, device=device))
                       for _ in range(num_layers)]
        self.reserve(num_slots)

    def reserve(self, num_slots: int) -> None:
        """Room for slots ``0 .. num_slots - 1`` (rows kept so far stay)."""
        if num_slots <= self.num_slots:
            return
        rows = 1 + (num_slots + 1) * 3 * self.block_size
        grown = []
        for pair in self.layers:
            new = tuple(t.new_empty((rows, *t.shape[1:])) for t in pair)  # untouched rows stay unmapped on the CPU
            for old, t in zip(pair, new):
                t[:old.shape[0]].copy_(old)
            grown.append(new)
        self.layers = grown
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    def row(self, slot, pos):
        """Where the exact row of position ``pos`` of the sequence in ``slot`` is kept: a slot
        holds three pages, its first page's rows, then its even and its odd pages'. Ints, or
        int64 tensors that broadcast (a step's groups)."""
        bs = self.block_size
        return 1 + (slot + 1) * 3 * bs + (pos >= bs) * bs * (1 + (pos // bs) % 2) + pos % bs

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Accepted lookahead drafts: the rows of positions ``src`` go to positions ``dst``
        (all read before any is written), as ``draft_slot_moves`` moves their pages' rows."""
        if not src or slot < 0:
            return
        dev = self.layers[0][0].device
        s = torch.tensor([self.row(slot, p) for p in src], dtype=torch.long, device=dev)
        d = torch.tensor([self.row(slot, p) for p in dst], dtype=torch.long, device=dev)
        for pair in self.layers:
            for t in pair:
                t.index_copy_(0, d, t.index_select(0, s))


@dataclass(frozen=True)
class TailSeq:
    """One sequence of a step, as plain data."""

    slot: int  # its TailStore slot (-1: none; its rows are not kept)
    start_pos: int  # tokens cached before the step
    num_new: int
    first_row: int  # flat index of its first new token in the step
    tree: bool  # its new tokens carry a draft tree (ancestor words), else causal


def tail_seqs(batch_seqs, query_lens: list[int]) -> list[TailSeq]:
    """``TailSeq`` of each ``ScheduledSeq`` of a step (``query_lens``: their new tokens)."""
    out, row = [], 0
    for seq, n in zip(batch_seqs, query_lens):
        out.append(TailSeq(seq.tail_slot, seq.start_pos, n, row, bool(seq.num_draft)))
        row += n
    return out


class TailPlan:
    """A step's exact-tail plan on the host: the store row of every token (``writes``), the
    groups (``desc``: b, first query row, queries, first query's memory position, first key's
    position, keys, start_pos, slot, tree, the sequence's first row, sink), and for the result
    the real query rows (``src`` in the padded groups, ``dst`` in the step). ``ints`` is all of
    it as one list, for the step's one upload.

    Groups: the queries of one page of a sequence without drafts (keys: that page's first
    position up to its last new token), or all new tokens of a sequence with drafts (keys: the
    page of ``start_pos`` from its start, and the new tokens); a group past the first page
    (``sink``) has the first page's BS keys in front. Padded to ``qw`` queries and ``kw`` keys
    (``widths``: fixed ones, a CUDA graph's shape)."""

    def __init__(self, seqs: list[TailSeq], store: TailStore, num_tokens: int,
                 widths: tuple[int, int] | None = None) -> None:
        bs = store.block_size
        store.reserve(1 + max((s.slot for s in seqs), default=-1))
        writes = [store.row(-1, 0)] * num_tokens
        desc: list[tuple[int, ...]] = []
        for b, s in enumerate(seqs):
            end = s.start_pos + s.num_new
            if s.num_new == 0:
                continue
            if s.slot >= 0:  # its rows in its first page and in the last two pages it reaches
                last2 = ((end - 1) // bs - 1) * bs
                for p in range(s.start_pos, end):
                    if p < bs or p >= last2:
                        writes[s.first_row + p - s.start_pos] = store.row(s.slot, p)
            if s.tree:
                k0 = s.start_pos // bs * bs
                desc.append((b, s.first_row, s.num_new, s.start_pos, k0, end - k0, s.start_pos, s.slot, 1,
                             s.first_row, int(k0 > 0)))
                continue
            for page in range(s.start_pos // bs, (end - 1) // bs + 1):
                a, e = max(page * bs, s.start_pos), min((page + 1) * bs, end)
                desc.append((b, s.first_row + a - s.start_pos, e - a, a, page * bs, e - page * bs,
                             s.start_pos, s.slot, 0, s.first_row, int(page > 0)))
        qw = max((d[2] for d in desc), default=0)
        kw = max((d[5] + bs * d[10] for d in desc), default=0)
        if widths is not None:
            if widths[0] < qw or widths[1] < kw:
                raise ValueError(f"exact tail: groups of {qw} queries x {kw} keys exceed the fixed {widths}")
            qw, kw = widths
        self.qw, self.kw, self.num_groups = qw, kw, len(desc)
        src = [g * qw + i for g, d in enumerate(desc) for i in range(d[2])]
        dst = [d[1] + i for d in desc for i in range(d[2])]
        self.sizes = [len(writes), FIELDS * len(desc), len(src), len(dst)]
        self.ints = writes + [x for d in desc for x in d] + src + dst
        self.src, self.dst = src, dst

    @classmethod
    def fixed(cls, num_seqs: int, width: int, block_size: int) -> "TailPlan":
        """The shape of the plan of every step of ``num_seqs`` sequences of ``width`` tokens
        that each sample their last one (decode, verification; a CUDA graph's step): one group
        per sequence, ``width`` queries over at most ``2 * block_size - 1 + width`` keys (the
        first page's, the page of its first new token up to it, and its new tokens)."""
        plan = cls.__new__(cls)
        plan.qw, plan.kw, plan.num_groups = width, 2 * block_size - 1 + width, num_seqs
        tokens = num_seqs * width
        plan.sizes, plan.ints = [tokens, FIELDS * num_seqs, tokens, tokens], []
        return plan


class TailStep:
    """What a step derives once for the exact tail, on the device; every layer calls ``keep``
    (the step's exact rows into the store) and ``exchange``. ``visible`` [G, Qw, Kw] says
    which key each query sees exact: it exists, the query sees it (causal, or the draft tree;
    cached keys all), and its position is in the query's page."""

    def __init__(self, plan: TailPlan, ints: torch.Tensor, store: TailStore, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, block_table: torch.Tensor, own: list[int] | None = None) -> None:
        """``ints``: ``plan.ints`` on the device; ``positions`` [T] (each token's position: a
        draft node's is its parent's + 1), ``tree_mask`` [T] ancestor words or None,
        ``block_table`` [B, W]: the step's device tensors. ``own``: the step's tokens whose
        results this process holds (a sequence-parallel rank's, ascending; ``exchange``'s out
        and lse then have one row per own token); default all."""
        self.store, self.num_groups, self.qw, self.kw = store, plan.num_groups, plan.qw, plan.kw
        self.write_rows, self._desc, self.src, self.dst = torch.split(ints, plan.sizes)
        self._inputs = (positions, tree_mask, block_table)
        self._derived = False
        self._local = None
        self._c_step = None  # cpu_decode.TailStepArgs, made at the first layer on the CPU
        if own is not None:
            at = {t: i for i, t in enumerate(own)}
            pairs = [(s, at[d]) for s, d in zip(plan.src, plan.dst) if d in at]
            local = [at.get(t, 0) for t in range(plan.sizes[0])]
            dev = ints.device
            self._local = torch.tensor(local, dtype=torch.long, device=dev)  # a token's row among own
            self.src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=dev)
            self.dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dev)

    def ready(self) -> None:
        """Derive the groups' tensors at the first layer (inside a CUDA graph's capture when
        there is one, so a replay derives them from its new inputs)."""
        if not self._derived and self.num_groups:
            self._derive(self._desc.view(-1, FIELDS), self.store, *self._inputs, self.write_rows.numel())
        self._derived = True

    def _derive(self, d: torch.Tensor, store: TailStore, positions: torch.Tensor,
                tree_mask: torch.Tensor | None, block_table: torch.Tensor, num_tokens: int) -> None:
        """The device tensors of the groups ``d`` [G, FIELDS] (``TailPlan``'s descriptors)."""
        bs, dev = store.block_size, d.device
        b, q_row0, nq, q_pos0, k_pos0, nk, start, slot, tree, first, sink = d.unbind(1)
        i = torch.arange(self.qw, device=dev)
        j = torch.arange(self.kw, device=dev)
        q_ok = i[None, :] < nq[:, None]
        q_rows = torch.where(q_ok, q_row0[:, None] + i[None, :], 0)  # [G, Qw]
        q_pos = q_pos0[:, None] + i[None, :]  # memory positions (a causal group's are its positions)
        q_page = positions.index_select(0, q_rows.flatten()).view_as(q_rows) // bs * bs
        # [G, Kw] memory positions: with ``sink`` the first page's BS, then the group's own
        in_sink = j[None, :] < bs * sink[:, None]
        k_pos = torch.where(in_sink, j[None, :], k_pos0[:, None] + j[None, :] - bs * sink[:, None])
        k_ok = in_sink | (j[None, :] - bs * sink[:, None] < nk[:, None])
        cached = k_pos < start[:, None]
        new_row = (first[:, None] + k_pos - start[:, None]).clamp(0, max(num_tokens - 1, 0))
        k_where = torch.where(cached, k_pos, positions.index_select(0, new_row.flatten()).view_as(new_row))
        causal = k_pos[:, None, :] <= q_pos[:, :, None]
        if tree_mask is not None:
            words = tree_mask.index_select(0, q_rows.flatten()).view_as(q_rows)
            shift = (k_pos - start[:, None]).clamp(0, 62)
            in_tree = ((words[:, :, None] >> shift[:, None, :]) & 1) == 1
            sees_new = torch.where(tree[:, None, None] == 1, in_tree, causal)
        else:
            sees_new = causal
        exact = (k_where[:, None, :] >= q_page[:, :, None]) | (k_where < bs)[:, None, :]  # own page, first page
        self.visible = q_ok[:, :, None] & k_ok[:, None, :] & (cached[:, None, :] | sees_new) & exact
        self.q_rows = q_rows.flatten()
        page = (k_pos // bs).clamp(0, block_table.shape[1] - 1)
        blocks = block_table.long()[b[:, None], page]
        self.pool_slots = (blocks * bs + k_pos % bs).flatten()
        keep = store.row(slot[:, None], k_pos)
        kept = slot[:, None] >= 0  # a sequence without a slot sees its cached keys as stored
        self.visible &= ~cached[:, None, :] | kept[:, :, None]
        self.cached = cached.flatten().contiguous()
        self.store_rows = torch.where(cached & k_ok & kept, keep, 0).flatten().contiguous()
        self.new_rows = new_row.flatten().contiguous()
        self.visible = self.visible.contiguous()

    def apply(self, layer: int, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, caches: tuple[torch.Tensor, ...], scale: float,
              old: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``exchange`` over the pages ``caches`` (K, V, K scale, V scale), then ``keep``: one
        process's layer (``old``: the keys' int8 rows when the caller read them, as a
        sequence-parallel rank does; else from ``caches``). On the CPU with float32 activations one C call
        (``cpu_decode.tail_exchange_layer``, the step's part checked once; per layer of SmolLM2 on 2 cores: +0.12 ms for a
        decoded token against +0.9 ms for the ~50 operations of the torch form, and +7 ms
        against +13 ms for a 512-token chunk at 4K); elsewhere (CUDA) the torch form."""
        sk, sv = self.store.layers[layer]
        if not self.num_groups:
            self.keep(layer, k, v)
            return out
        k_cache, v_cache, k_scale, v_scale = caches
        c = _c_kernel() if out.device.type == "cpu" else None
        if (c is not None and out.dtype == torch.float32 and q.dtype == torch.float32
                and sk.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
                and q.is_contiguous() and k_cache.is_contiguous()):
            if self._c_step is None:  # the step's tensors, checked once for every layer
                self.ready()
                self._c_step = c.tail_step_args(
                    self.pool_slots, self.store_rows, self.new_rows, self.cached, self.q_rows, self.visible,
                    self.src, self.dst, self.write_rows, self.num_groups, self.qw, self.kw, q.shape[0])
            old_k, old_v = (None, None) if old is None else (old[0].float().contiguous(), old[1].float().contiguous())
            c.tail_exchange_layer(self._c_step, q, out, lse, k_cache, v_cache, k_scale, v_scale, old_k, old_v, sk,
                                  sv, k.float().contiguous(), v.float().contiguous(), scale, torch.get_num_threads())
            return out
        out = self.exchange(layer, out, lse, q, k, v, self.stored_rows(*caches) if old is None else old, scale)
        self.keep(layer, k, v)
        return out

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's exact rows k / v [T, Hkv, D] (as the pages get them: rotated),
        after ``exchange``: a chunk's last pages may reuse the halves its first page's rows
        are read from."""
        sk, sv = self.store.layers[layer]
        sk.index_copy_(0, self.write_rows, k.to(sk.dtype))
        sv.index_copy_(0, self.write_rows, v.to(sv.dtype))

    def stored_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The groups' keys as the int8 pages hold them now, fp32 [G * Kw, Hkv, D] each (None
        without groups)."""
        if not self.num_groups:
            return None
        self.ready()
        return (kv_quant.dequantize_rows(k_cache, k_scale, self.pool_slots),
                kv_quant.dequantize_rows(v_cache, v_scale, self.pool_slots))

    def exchange(self, layer: int, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, old: tuple[torch.Tensor, torch.Tensor] | None,
                 scale: float) -> torch.Tensor:
        """``out`` [T, H, D] (with ``lse`` [T, H]: attention over the int8 pages) with each
        query's first-page and own-page keys exact; ``q``, ``k``, ``v``: the step's (as the pages see them),
        ``old``: ``stored_rows``. Returns ``out`` (updated in place). With ``own``: out and lse
        hold the own tokens' rows; q, k and v every token's."""
        if not self.num_groups or not self.dst.numel():
            return out
        self.ready()
        g, qw, kw = self.num_groups, self.qw, self.kw
        sk, sv = self.store.layers[layer]
        shape = (g, kw, *k.shape[1:])
        k_new = torch.where(self.cached[:, None, None], sk.index_select(0, self.store_rows).to(k.dtype),
                            k.index_select(0, self.new_rows)).view(shape)
        v_new = torch.where(self.cached[:, None, None], sv.index_select(0, self.store_rows).to(v.dtype),
                            v.index_select(0, self.new_rows)).view(shape)
        rows = self.q_rows if self._local is None else self._local.index_select(0, self.q_rows)
        res, _ = kv_quant.exchange_keys(
            out.index_select(0, rows).view(g, qw, *out.shape[1:]),
            lse.index_select(0, rows).view(g, qw, -1),
            q.index_select(0, self.q_rows).view(g, qw, *q.shape[1:]),
            old[0].view(shape), old[1].view(shape), k_new, v_new, self.visible, scale)
        out.index_copy_(0, self.dst, res.flatten(0, 1).index_select(0, self.src).to(out.dtype))
        return out


def _c_kernel():
    """``longctx.kernels.cpu_decode`` where its C library runs, else None."""
    from longctx.kernels import cpu_decode

    return cpu_decode if cpu_decode.available() else None


class _FirstPageCapture:
    """An attention backend for ``fill_first_pages``: keeps each layer's K/V rows (turned as
    the pages store them) in the store, and attends causally within each sequence."""

    def __init__(self, store: TailStore, rows: torch.Tensor, rotation: torch.Tensor | None, head_dim: int) -> None:
        from longctx.attention import AttentionPlan, dense_causal  # (attention imports this module)

        self.store, self.rows, self.rotation = store, rows, rotation
        self.scale = head_dim ** -0.5
        self.dense_causal, self.attention_plan = dense_causal, AttentionPlan

    def plan(self, meta):
        return self.attention_plan(meta)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, scale: float | None = None,
            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        sk, sv = self.store.layers[layer]
        kr, vr = (k, v) if self.rotation is None else ((x.float() @ self.rotation) for x in (k, v))
        sk.index_copy_(0, self.rows, kr.to(sk.dtype))
        sv.index_copy_(0, self.rows, vr.to(sv.dtype))
        return self.dense_causal(q, k, v, plan.meta.query_lens, self.scale if scale is None else scale,
                                 window=window, softcap=softcap)


def fill_first_pages(model, store: TailStore, seqs: list[tuple[int, tuple[int, ...]]],
                     rotation: torch.Tensor | None) -> None:
    """Put the exact K/V of the first pages of ``seqs`` ((slot, that page's token ids, LongRoPE's
    long table)) in the
    store: a prefix hit brings a sequence's int8 pages, not the exact rows its first page's
    queries computed. The first page's tokens see only each other, and every key they see is
    exact (their own page), so a causal forward over them alone gives those rows (to float32
    rounding: ~1e-6 of a value; dynamic RoPE, whose tables follow a step's longest position,
    may differ more). ``rotation``: what int8 pages are turned by, or None."""
    if not seqs:
        return
    from longctx.attention import AttentionMetadata

    store.reserve(1 + max(slot for slot, *_ in seqs))
    dev = store.layers[0][0].device
    lens = [len(ids) for _, ids, _ in seqs]
    ids = torch.tensor([t for _, x, _ in seqs for t in x], dtype=torch.long, device=dev)
    pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=dev)
    rows = torch.tensor([store.row(slot, p) for slot, x, _ in seqs for p in range(len(x))], dtype=torch.long,
                        device=dev)
    backend = _FirstPageCapture(store, rows, rotation, model.config.head_dim)
    meta = AttentionMetadata.dense(lens, dev)
    meta.max_position = max(lens)
    if model.config.long_rope_after is not None:  # LongRoPE: each sequence's table
        meta.rope_long = torch.tensor([bool(long) for _, x, long in seqs for _ in x], dtype=torch.bool, device=dev)
    model(ids, pos, backend, meta)


def first_pages_to_fill(batch_seqs) -> list[tuple[int, tuple[int, ...], bool]]:
    """(slot, first page's token ids, LongRoPE's long table) of the step's sequences that
    bring them (``ScheduledSeq.sink_token_ids``: a prefix hit's first step on its slot)."""
    return [(s.tail_slot, tuple(s.sink_token_ids), s.rope_long) for s in batch_seqs
            if s.sink_token_ids and s.tail_slot >= 0]
