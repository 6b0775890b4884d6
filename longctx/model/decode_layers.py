"""A decode step's decoder layers as one loop of C calls (CPU, the row kernel).

Why: at one to a few rows per step the C kernels take ~0.75 ms a layer of the default model
(bf16, 8K tokens of context) and the Python around them (modules, methods, the operators'
dispatch and checks, the attention backend's routing) took another ~0.3 ms warm and ~0.45 ms
as it runs, between kernels that have just streamed megabytes through the caches: a third of
the step. Here a step checks once what every layer shares (the model's layers, the step's
route, the caches' layout, the tables), then calls the same C entries with the same arguments
the modules would, layer after layer:

    qkv   = linear_rows(x, W_qkv, prologue RMSNorm(input_layernorm))   (or the block kernel's call)
            rope_inplace(q and k of qkv)
            write_kv(k, v of qkv -> the layer's pages at the step's slots)
    attn  = paged_decode_batch(q, the layer's pages, the step's tables)  (and/or paged_flash_batch)
    mid   = linear_rows(attn, W_o) + x
    gu    = linear_rows(mid, W_gate_up, prologue RMSNorm(post_attention_layernorm))
    x     = linear_rows(gu, W_down, prologue SwiGLU) + mid   (x's buffer again)

The same kernels in the same order on the same inputs: the same bits as the modules' path
(``tests/test_decode_layers.py`` compares them). What it takes (``DecodeLayers.build``
for the model, ``DecodeLayers.step`` for the step); anything else runs the modules:

- the model: Llama-shaped layers (no sandwich norms, SwiGLU, no q/k norms, RoPE over the whole
  head, no sliding window or score cap, one RoPE table) with float32 norms, every product on the
  row kernel (``RowKernelWeights``: float32 or bfloat16 matrices) or on GGUF blocks
  (``BlockWeights``, exact or fast numerics; a Llama file's q/k rows as stored, put in order by
  the RoPE pass as the modules do);
- the step: on the CPU with the C libraries loaded, the plain paged backend over float32 or
  bfloat16 pages (``FloatPages``: no int8 pages, no exact tail, no window ring, no sequence
  parallelism's split products, no LongRoPE), every sequence routed to a compiled kernel (the
  decode kernel, or the flash kernel for a verification step of more rows per KV head, as
  ``torch_paged.paged_attention`` routes them: causal or a draft tree's words), each
  product in one call at the step's rows (the row kernel's, not the AMX tiles or BLAS; the block
  kernel's, up to ``BLOCK_ROWS``).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from longctx.kernels import cpu_blocks, cpu_decode, cpu_flash, cpu_linear, torch_paged

ENV = "LONGCTX_DECODE_LAYERS"  # "0": every step through the modules
MAX_ROWS = 64  # steps of more rows run the modules (prefill chunks: the kernels' time dwarfs the Python)
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (DecodeLayers or None,)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class _Layer:
    """One layer's norms (weight pointers, eps), products (``_product``'s callables) and attention
    (its own score scale, None: the backend's; RoPE over llama.cpp's stored pairs)."""

    norm1: int
    eps1: float
    qkv: Callable
    o: Callable
    norm2: int
    eps2: float
    gate_up: Callable
    down: Callable
    scale: float | None
    pairs: int


def _product(lin: Any, keep: list) -> Callable | None:
    """``lin``'s product as one C call, ``call(x, ldx, rows, out, ldo, prologue, norm, eps, res,
    ldr, threads) -> rc`` with the arguments its method passes (pointers; prologue 1 RMSNorm, 2
    SwiGLU), or None where the loop does not take it: the row kernel's float32 or bfloat16
    matrix (``cpu_linear.linear``), or GGUF blocks whose rows are in order or kept as stored
    (``BlockWeights``' short steps, ``PreparedParts``). ``keep`` gets the tensors behind the
    pointers."""
    from longctx.model.linear import BlockMatrix, BlockWeights, RowKernelWeights, _as_stored

    w, b = lin.weight, lin.bias
    if b is not None and (b.dtype != torch.float32 or b.dim() != 1 or not b.is_contiguous() or b.device.type != "cpu"):
        return None
    bias = None if b is None else b.data_ptr()
    if isinstance(lin.method, RowKernelWeights):
        if (not isinstance(w, torch.Tensor) or w.dtype not in cpu_linear.WEIGHT_TYPES or w.device.type != "cpu"
                or w.dim() != 2 or not w.is_contiguous() or (b is not None and b.shape[0] != w.shape[0])):
            return None
        keep += [w, b]
        fn, wp, wt = cpu_linear._load().longctx_linear_rows, w.data_ptr(), cpu_linear.WEIGHT_TYPES[w.dtype]
        n, k = w.shape
        return lambda x, ldx, m, out, ldo, pro, norm, eps, res, ldr, th: fn(
            x, ldx, m, wp, wt, n, k, bias, out, ldo, pro, norm, eps, res, ldr, th)
    if isinstance(lin.method, BlockWeights) and isinstance(w, BlockMatrix) and cpu_blocks.available():
        if (w.order is not None and not _as_stored(lin)) or (b is not None and b.shape[0] != w.shape[0]):
            return None
        prepared = w.prepared()
        keep += [prepared, b]
        fn, arrays, parts, k, terms = (cpu_blocks._load().longctx_blocks_linear_parts, prepared.arrays, prepared.n,
                                       prepared.k, cpu_blocks._terms(lin.method.fast))
        return lambda x, ldx, m, out, ldo, pro, norm, eps, res, ldr, th: fn(
            x, ldx, m, parts, *arrays, k, bias, out, ldo, res, ldr, th, pro, norm, eps, terms)
    return None


class DecodeLayers:
    """The model's layers as pointers (``build``), run for a step that qualifies (``step``)."""

    def __init__(self, model: Any, layers: list[_Layer], keep: list[torch.Tensor]) -> None:
        cfg = model.config
        attn = model.layers[0].self_attn
        self.layers = layers
        self.keep = keep  # the tensors behind the pointers (the modules' own: kept alive with them)
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.qkv_width = self.q_size + 2 * self.kv_size
        self.ffn = model.layers[0].mlp.intermediate_size
        self.products = _products(model.layers[0])
        self.signature = [(lin, lin.weight, lin.method)
                          for lay in (model.layers[0], model.layers[-1]) for lin in _products(lay)]

    @classmethod
    def build(cls, model: Any) -> "DecodeLayers | None":
        """The model's layers as this loop takes them, or None where any of them is not (see the
        module's docstring)."""
        from longctx.model.llama import RMSNorm  # (imported here: llama.py imports this module)

        norm = getattr(model.layers[0], "input_layernorm", None) if len(model.layers) else None
        if not (enabled() and isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.is_cpu):
            return None  # (a model on CUDA: its C libraries are never loaded for this)
        if not (cpu_linear.available() and cpu_decode.available()):
            return None
        cfg = model.config
        if cfg.local_rope_theta is not None or cfg.sandwich_norms:
            return None
        layers, keep = [], []
        for idx, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if (attn.q_norm is not None or mlp.gelu
                    or (attn.rotary_dim is not None and attn.rotary_dim < attn.head_dim)
                    or attn.spec.window is not None or attn.spec.softcap is not None
                    or cfg.layer_window(idx) is not None):
                return None
            products = [_product(lin, keep) for lin in _products(layer)]
            if any(p is None for p in products):
                return None
            norms = []
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                nw = norm.weight
                if (type(norm) is not RMSNorm or nw.dtype != torch.float32 or not nw.is_contiguous()
                        or nw.shape != (cfg.hidden_size,)):
                    return None
                keep.append(nw)
                norms.append((nw.data_ptr(), float(norm.eps)))
            qkv, o, gate_up, down = products
            d, h, hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
            e, f = cfg.hidden_size, mlp.intermediate_size
            if (tuple(attn.qkv_proj.weight.shape) != (h * d + 2 * hkv * d, e)
                    or tuple(attn.o_proj.weight.shape) != (e, h * d)
                    or tuple(mlp.gate_up_proj.weight.shape) != (2 * f, e)
                    or tuple(mlp.down_proj.weight.shape) != (e, f)):
                return None
            layers.append(_Layer(norms[0][0], norms[0][1], qkv, o, norms[1][0], norms[1][1], gate_up, down,
                                 attn.spec.scale, int(attn.rope_pairs)))
        first = model.layers[0]
        shape = lambda lay: (lay.self_attn.num_heads, lay.self_attn.num_kv_heads, lay.self_attn.head_dim,  # noqa: E731
                             lay.mlp.intermediate_size)
        methods = lambda lay: tuple(lin.method for lin in _products(lay))  # noqa: E731
        if any(shape(lay) != shape(first) or any(a is not b for a, b in zip(methods(lay), methods(first)))
               for lay in model.layers):  # one shape, and the same method objects (``step`` asks the first's)
            return None
        return cls(model, layers, keep)

    @classmethod
    def of(cls, model: Any) -> "DecodeLayers | None":
        """``build``'s result for ``model``, kept beside it (not in it: the model may be pickled for
        sequence-parallel ranks, and this holds C function pointers) and built again where the
        model's products were re-held since."""
        found = _BUILT.get(model)
        if found is None or (found[0] is not None and not found[0].current()):
            found = _BUILT[model] = (cls.build(model),)
        return found[0]

    def current(self) -> bool:
        """Whether the model still holds what ``build`` read (its first and last layers' matrices
        and methods): a model whose products were re-held since is built again."""
        return all(lin.weight is weight and lin.method is method for lin, weight, method in self.signature)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any, plan: Any) -> bool:
        """Run every layer on x [T, E] (float32, contiguous, the step's own: updated in place) and
        return True, where this step qualifies; else False, with nothing touched."""
        from longctx.attention import AttentionPlan, PagedAttentionBackend  # (it imports the model's package)
        from longctx.kv.formats import FloatPages

        if (type(backend) is not PagedAttentionBackend or backend.kernels is not torch_paged
                or type(plan) is not AttentionPlan):
            return False  # (sequence parallelism's backend and step, CUDA's kernels)
        meta = plan.meta
        rows, fmt = x.shape[0], type(meta.kv_format)
        if (meta.kv_caches is None or len(meta.kv_caches) != len(self.layers)
                or not issubclass(fmt, FloatPages) or fmt.enter is not FloatPages.enter
                or fmt.leave is not FloatPages.leave or meta.tail is not None
                or meta.ring is not None or plan.split_linear is not None
                or getattr(meta, "rope_long", None) is not None
                or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 2
                or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
                or tuple(cos.shape) != (rows, self.head_dim // 2) or sin.shape != cos.shape):
            return False
        if not all(_takes(lin, rows) for lin in self.products):  # (every layer holds the same method objects)
            return False
        k0, v0 = meta.kv_caches[0][:2]
        d, h, hkv = self.head_dim, self.heads, self.kv_heads
        qkv = torch.empty(rows, self.qkv_width, dtype=torch.float32)
        q = qkv[:, :self.q_size].view(rows, h, d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(rows, hkv, d)
        v = qkv[:, self.q_size + self.kv_size:].view(rows, hkv, d)
        if not cpu_decode.takes_float_write(k0, v0, k, v) or any(
                len(c) != 2 or c[0].shape != k0.shape or c[0].dtype != k0.dtype or c[1].shape != k0.shape
                or c[1].dtype != k0.dtype or not (c[0].is_contiguous() and c[1].is_contiguous())
                for c in meta.kv_caches):
            return False
        table, slots, memo = plan.tables(None)
        sp = memo.get("torch_paged.plan")
        if sp is None:
            sp = memo["torch_paged.plan"] = torch_paged._StepPlan(table, meta.context_lens_t, meta.cu_seqlens_q,
                                                                  memo.get("host"))
        tree = meta.tree_mask is not None
        decode, flash, rest = sp.route(q, k0, tree, None)
        if rest or (decode is None and flash is None):
            return False
        flash_fn = None
        if flash is not None:  # (verification steps of more rows per KV head: the flash kernel)
            lib = cpu_flash._library_for(k0)
            if lib is None:
                return False
            flash_fn = lib.longctx_paged_flash_batch
        slots64 = memo.get("torch_paged.slots64")
        if slots64 is None:
            slots64 = memo["torch_paged.slots64"] = slots.long()
        slots64 = slots64.contiguous()
        words = None if not tree else meta.tree_mask.to(torch.int64).contiguous()
        tables = sp.kernel_tables
        # the decode kernel's q: contiguous (a copy of q's rows where the step has several); the
        # flash kernel's: the view of qkv, its rows apart
        qc = q if rows == 1 or decode is None else torch.empty(rows, h, d, dtype=torch.float32)
        attn = torch.empty(rows, h, d, dtype=torch.float32)
        lse = torch.empty(rows, h, dtype=torch.float32)
        if slots64.shape != (rows,):
            return False
        if decode is not None:
            cpu_decode.check_batch(qc, k0, v0, None, None, tables.block_table, tables.ctx_lens, tables.cu_q, decode,
                                   words, attn, lse)
        if flash is not None:
            cpu_decode.check_batch(q, k0, v0, None, None, tables.block_table, tables.ctx_lens, tables.cu_q, flash[0],
                                   words, attn, lse, strided_q=True)
            if flash[1].dtype != torch.int32 or flash[1].shape != flash[0].shape or not flash[1].is_contiguous():
                return False
        gu = torch.empty(rows, 2 * self.ffn, dtype=torch.float32)
        mid = torch.empty_like(x)  # the hidden state between attention and the MLP (see _run)
        self._run(x, mid, qkv, q, qc, attn, lse, gu, cos, sin, slots64, tables, decode, flash, flash_fn, words,
                  meta.kv_caches, backend.scale)
        return True

    def _run(self, x, mid, qkv, q, qc, attn, lse, gu, cos, sin, slots, tables, seqs, flash, flash_fn, words, caches,
             scale) -> None:
        """Each layer: x -> (attention) mid = o(attn) + x -> x = down(swiglu(gate_up(norm(mid)))) + mid.
        A product's output is never its residual: the row kernel's panels (17 rows and more) sum
        K in blocks of PANEL_K and store the first block's partial sums before the last adds
        the residual, so an output that was also the residual would lose it (K > 2,048)."""
        rope = cpu_linear._load().longctx_rope_inplace
        dec = cpu_decode._load()
        write, attend = dec.longctx_write_kv, dec.longctx_paged_decode_batch
        threads = torch.get_num_threads()
        rows, e, f, w = x.shape[0], self.hidden, self.ffn, self.qkv_width
        d, h, hkv = self.head_dim, self.heads, self.kv_heads
        hd = h * d
        xp, midp, qkvp, attnp = x.data_ptr(), mid.data_ptr(), qkv.data_ptr(), attn.data_ptr()
        lsep, gup = lse.data_ptr(), gu.data_ptr()
        kp, vp = qkvp + 4 * self.q_size, qkvp + 4 * (self.q_size + self.kv_size)
        qcp, cosp, sinp, slotp = qc.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        bt = tables.block_table
        k0 = caches[0][0]
        dtype = cpu_decode.FLOAT_PAGES[k0.dtype]
        nb, bs = k0.shape[0], k0.shape[1]
        btp, brows, bw = bt.data_ptr(), bt.shape[0], bt.shape[1]
        ctxp, cup = tables.ctx_lens.data_ptr(), tables.cu_q.data_ptr()
        seqp, nseq = (None, 0) if seqs is None else (seqs.data_ptr(), seqs.shape[0])
        fseqp, fsplitp, fnseq = (None, None, 0) if flash is None else (flash[0].data_ptr(), flash[1].data_ptr(),
                                                                     flash[0].shape[0])
        qstride = cpu_decode.q_row_stride(q)
        wordp = None if words is None else words.data_ptr()
        copy_q = seqs is not None and qc is not q
        for layer, cache in zip(self.layers, caches):
            kc, vc = cache[0].data_ptr(), cache[1].data_ptr()
            _ok(layer.qkv(xp, e, rows, qkvp, w, 1, layer.norm1, layer.eps1, None, 0, threads), "qkv")
            _ok(rope(qkvp, rows, w, h + hkv, d, cosp, sinp, layer.pairs, threads), "rope")
            _ok(write(kc, vc, dtype, kp, w, vp, w, slotp, rows, nb, bs, hkv, d, threads), "write_kv")
            sc = scale if layer.scale is None else layer.scale
            if seqs is not None:
                if copy_q:
                    qc.copy_(q)
                _ok(attend(qcp, kc, vc, None, None, dtype, btp, brows, bw, nb, ctxp, cup, rows, seqp, nseq, bs, h, hkv,
                           d, sc, wordp, 0, 0.0, cpu_decode.SPLIT_TOKENS, threads, attnp, lsep), "paged_decode")
            if flash is not None:
                _ok(flash_fn(qkvp, kc, vc, None, None, dtype, btp, brows, bw, nb, ctxp, cup, rows, fseqp, fsplitp,
                             qstride, fnseq, bs, h, hkv, d, sc, wordp, 0, 0.0, threads, attnp, lsep, None),
                    "paged_flash")
            _ok(layer.o(attnp, hd, rows, midp, e, 0, None, 0.0, xp, e, threads), "o_proj")
            _ok(layer.gate_up(midp, e, rows, gup, 2 * f, 1, layer.norm2, layer.eps2, None, 0, threads), "gate_up")
            _ok(layer.down(gup, 2 * f, rows, xp, e, 2, None, 0.0, midp, e, threads), "down")


def _takes(lin: Any, rows: int) -> bool:
    """Whether ``lin``'s method runs a step of ``rows`` rows as ``_product``'s one call: the row
    kernel's (not the AMX tiles, not BLAS) or the block kernel's (up to ``BLOCK_ROWS``)."""
    from longctx.model.linear import BLOCK_ROWS, RowKernelWeights

    if isinstance(lin.method, RowKernelWeights):
        return lin.method.kernel_takes(rows) and not lin.method.amx_takes(lin, rows)
    return 0 < rows <= BLOCK_ROWS


def _products(layer: Any) -> tuple:
    """A decoder layer's four products, in the order they run."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"decode layers: the C {what} call returned {rc} after the step's checks passed")
