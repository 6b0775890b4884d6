"""Linear layers and their weight formats: one ``LinearMethod`` per layout (vLLM's shape).

Owns: ``Linear`` (a matrix, an optional bias and the method that holds and multiplies it) and
the methods: ``BLAS`` (``weight_t`` [in, out], the layout a checkpoint loads into), ``ROW_KERNEL``
(``weight`` [out, in], read by the C row kernel of ``longctx.kernels.cpu_linear``) and
``OneDNNWeights`` (``packed``, oneDNN's blocked layout). The model picks one at load
(``choose_cpu_matmul``); ``BlockWeights`` holds a GGUF file's blocks as stored (``BlockMatrix``,
memory-mapped), multiplied by ``longctx.kernels.cpu_blocks``.
Never: which rows a step has, or the model's structure.

A call may carry the layer's neighbours: ``norm`` (the RMSNorm before the product), ``swiglu``
(the input is [T, 2F] and the product takes ``silu(gate) * up``) and ``residual`` (added to the
result). A method that can fuse them into its product does (the row kernel: a decoder layer is
four kernel calls around attention); the others run them as separate torch ops, in the order
the model would. ``product``: a replacement for the row kernel's function with its signature
(sequence parallelism's column split). ``gated`` makes an MLP's ``act(gate) * up`` where a
method can without the whole [T, 2F] gate/up product (GGUF blocks on prefill chunks, and a
bfloat16 matrix on the AMX tiles, whose result goes to the down projection already rounded).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

from longctx.config import ConfigError
from longctx.kernels import cpu_amx, cpu_blocks, cpu_build, cpu_linear
from longctx.kernels.cpu_amx import RoundedRows  # noqa: F401 (what takes_rounded methods take)

PACK_ROWS_HINT = 16  # oneDNN packs for this many rows: measured as fast as 4, faster than 1 at 2-2048 rows
ROW_KERNEL_DTYPES = tuple(cpu_linear.WEIGHT_TYPES)  # the weight dtypes the row kernel reads


def activation(gate: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate)`` (``"silu"`` or ``"gelu_tanh"``) into ``out`` (a new tensor when None; ``gate``
    itself: in place), by torch's ``out=`` forms. Why not ``F.silu(gate)``: on a strided half of
    a [T, 2F] product, the functional form ran ~3.5x slower than the same op given its output
    (2,048 x 1,536 on the Intel Xeon: 3.8 against 1.1 ms, in place 0.7), with the same bits
    (tested)."""
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if act == "silu":
        return torch.ops.aten.silu.out(gate, out=out)
    if act == "gelu_tanh":
        return torch.ops.aten.gelu.out(gate, approximate="tanh", out=out)
    raise ValueError(f"act must be 'silu' or 'gelu_tanh', got {act!r}")


def _is_rms(norm: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether ``norm`` is one whose float32 output is ``weight * (x * norm.row_scale(x))`` (an
    RMSNorm) with a float32 weight, for a float32 x [T, K] on the CPU."""
    return (norm is not None and hasattr(norm, "row_scale") and x.dtype == torch.float32 and x.dim() == 2
            and x.device.type == "cpu" and norm.weight.dtype == torch.float32 and norm.weight.device.type == "cpu")


def normed(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``norm(x)``: an RMSNorm over float32 rows in one C pass where the row kernel runs with its
    vector paths, as the blocks' do (``cpu_linear.rms_norm``: its sums' order, so the scale may
    differ from torch's in its last bit), else the module."""
    if _is_rms(norm, x) and cpu_linear.available() and cpu_build.vectorized():
        return cpu_linear.rms_norm(x if cpu_linear.whole_rows(x) else x.contiguous(), norm.weight.contiguous(),
                                   norm.eps)
    return norm(x)


def swiglu_of(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (into ``out`` where given): one C pass over float32 rows where the row
    kernel runs with its vector paths (``cpu_linear.swiglu``: its exponential, within ~1 ulp of
    torch's; without AVX2 its scalar exponential ran 3x slower than torch's), else torch's
    activation and product."""
    if (cpu_linear.available() and cpu_build.vectorized() and cpu_linear.whole_rows(gate)
            and cpu_linear.whole_rows(up, gate.shape) and gate.stride(0) == up.stride(0)
            and (out is None or cpu_linear.whole_rows(out, gate.shape))):
        return cpu_linear.swiglu(gate, up, out)
    if out is None:
        return activation(gate, "silu").mul_(up)  # (one [T, F] temporary, not two at once)
    return torch.mul(activation(gate, "silu", out=out), up, out=out)  # (by out=: the fast forms on strided views)


def rounded_norm(x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor | None:
    """``norm(x)`` rounded for the AMX tiles (``cpu_amx.round_x``'s order) in one pass, for a norm
    whose float32 output is ``weight * (x * norm.row_scale(x))`` (an RMSNorm): its statistics,
    its two products and the rounding in the kernel's pass over x (``rms_eps``), where torch's
    ops wrote and read [T, K] floats three times more. The row scale's sums run in the kernel's
    order, so an element may land one bfloat16 step from rounding torch's ``norm(x)``. None
    where ``norm`` is not one, or x is not float32."""
    if not _is_rms(norm, x):
        return None
    x = x if x.stride(-1) == 1 else x.contiguous()
    return cpu_amx.round_x(x, col_scale=norm.weight.contiguous(), rms_eps=norm.eps)


def rounded_swiglu(x: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's ``silu(gate) * up`` of a [T, 2F] gate/up product, rounded for the AMX tiles in the
    pass that computes it (``cpu_amx.round_gated``), instead of torch's activation and product
    over [T, F] floats and a third pass to round them. The kernel's exponential, not Sleef's: an
    element may round one bfloat16 step from torch's (1 in ~3 million measured). None where x is
    not a float32 [T, 2F] with contiguous rows and F a multiple of 32."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % (2 * cpu_amx.K_MULTIPLE):
        return None
    f = x.shape[1] // 2
    return cpu_amx.round_gated(x[:, :f], x[:, f:], "silu")


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's pre-packed linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def choose_cpu_matmul(requested: str, dtype: torch.dtype) -> str:
    """'kernel', 'onednn' or 'blas' for a CPU model: 'auto' takes the row kernel for float32
    and bfloat16 where it builds with its vector paths (AVX2 and up), else oneDNN for float32
    when this torch has it, else BLAS (float16 always BLAS). A choice that cannot run here
    raises ``ConfigError``."""
    if requested == "blas":
        return "blas"
    if requested == "onednn":
        if not onednn_linear_available():
            raise ConfigError("cpu_matmul='onednn' but this torch build has no oneDNN linear ops")
        return "onednn"
    if requested == "kernel":
        if dtype not in ROW_KERNEL_DTYPES:
            raise ConfigError(f"cpu_matmul='kernel' is for float32 and bfloat16 models, not {dtype}")
        if not cpu_linear.available():
            raise ConfigError(f"cpu_matmul='kernel' but the CPU linear kernel is {cpu_linear.status()} "
                              "(use cpu_matmul='auto' to fall back)")
        return "kernel"
    # only with the kernel's intrinsic paths: its plain C loops (portable builds) measured
    # slower than BLAS (bench_cpu_isa.py, cpu-isa/amd-epyc-2c/legacy.json: one row 55.8-57.7 vs 45.1 ms over
    # the model's matrices, 4 rows 222-226 vs 66 ms)
    if dtype in ROW_KERNEL_DTYPES and cpu_linear.available() and cpu_build.vectorized():
        return "kernel"
    if dtype != torch.float32:
        return "blas"
    return "onednn" if onednn_linear_available() else "blas"


class LinearMethod:
    """How a ``Linear`` holds its matrix (``take``: from the [in, out] layout it loaded in)
    and computes with it (``product``); ``apply`` runs a call with its neighbours. Told
    apart by ``name`` (a model sent to sequence-parallel ranks arrives with copies)."""

    name = "blas"

    def take(self, layer: "Linear") -> None:
        """Hold ``layer``'s weight this method's way (it was loaded as ``weight_t``)."""

    def product(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if layer.bias is not None:
            return torch.addmm(layer.bias, x, layer.weight_t)
        return x @ layer.weight_t

    @staticmethod
    def prologue(x: torch.Tensor, norm: nn.Module | None, swiglu: bool) -> torch.Tensor:
        """The call's input as the product takes it: normed, or SwiGLU's silu(gate) * up."""
        if norm is not None:
            x = norm(x)
        if swiglu:
            gate, up = x.split(x.shape[-1] // 2, dim=-1)  # (T, F) each
            x = activation(gate, "silu").mul_(up)  # (one [T, F] temporary, not two at once)
        return x

    def apply(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None = None, swiglu: bool = False,
              residual: torch.Tensor | None = None, product: Callable | None = None) -> torch.Tensor:
        y = self.product(layer, self.prologue(x, norm, swiglu))
        return y if residual is None else residual + y

    def gated(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None, act: str,
              rounded: bool = False) -> torch.Tensor | RoundedRows | None:
        """``act(gate) * up`` [T, F] for a gate/up matrix [2F, K] (gate's rows first) without its
        [T, 2F] product, where this method can (else None: the caller takes the product and the
        prologue). ``act``: ``"silu"`` or ``"gelu_tanh"``. ``rounded``: the next product takes
        ``RoundedRows`` (its ``takes_rounded``), which this method may return instead."""
        return None

    def takes_rounded(self, layer: "Linear", rows: int) -> bool:
        """Whether ``apply`` takes a ``RoundedRows`` x of ``rows`` rows for ``layer`` (a long step
        on the tiles)."""
        return False


class RowKernelWeights(LinearMethod):
    """``weight`` [out, in] contiguous, one copy: the C row kernel for 1..``max_rows()`` rows
    (with the norm, SwiGLU and residual inside it), BLAS on the same matrix above that, and
    from ``blas_from_rows`` rows on (what ``cpu_tune`` measured faster on this machine for a
    float32 model's prefill chunks; by default never). A bfloat16 matrix goes to the AMX tiles
    (``cpu_amx``: x rounded to bfloat16, float32 sums; an RMSNorm or SwiGLU before the product
    made in the rounding pass by the kernel's own arithmetic) from
    ``amx_from_rows`` rows on, where ``cpu_tune`` measured them faster (by default never)."""

    name = "kernel"
    blas_from_rows = cpu_linear.UNBOUNDED
    amx_from_rows = cpu_linear.UNBOUNDED

    def __init__(self, blas_from_rows: int = cpu_linear.UNBOUNDED, amx_from_rows: int = cpu_linear.UNBOUNDED) -> None:
        self.blas_from_rows = int(blas_from_rows)
        self.amx_from_rows = int(amx_from_rows)

    def kernel_takes(self, rows: int) -> bool:
        return 0 < rows <= cpu_linear.max_rows() and rows < self.blas_from_rows

    def amx_takes(self, layer: "Linear", rows: int) -> bool:
        return rows >= self.amx_from_rows and cpu_amx.takes_weight(layer.weight)

    def takes_rounded(self, layer: "Linear", rows: int) -> bool:
        return self.amx_takes(layer, rows)

    def gated(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None, act: str,
              rounded: bool = False) -> torch.Tensor | RoundedRows | None:
        """On the tiles, for a down projection on them (``rounded``): SwiGLU's ``silu(gate) * up``
        straight into that projection's rounded input (``cpu_amx.gated_rounded``), without the
        [T, 2F] float32 product written and read back; the same bits as the product followed by
        the down projection's ``rounded_swiglu``. None otherwise (GELU's activation there is
        torch's, a bias is added to the product: the caller's two calls)."""
        f = layer.weight.shape[0] // 2
        if not (rounded and act == "silu" and layer.bias is None and x.dtype == torch.float32
                and self.amx_takes(layer, x.shape[0]) and f % cpu_amx.K_MULTIPLE == 0):
            return None
        xb = rounded_norm(x, norm)  # as _amx_apply rounds it: the norm folded in where it can be
        if xb is None:
            x = self.prologue(x, norm, False)
            xb = cpu_amx.round_x(x if x.stride(-1) == 1 else x.contiguous())
        return RoundedRows(cpu_amx.gated_rounded(xb, x.shape[0], layer.weight, act), x.shape[0])

    def _amx_apply(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None, swiglu: bool,
                   residual: torch.Tensor | None) -> torch.Tensor:
        # the norm folded into x's rounding, or SwiGLU made in it
        xb = (rounded_swiglu(x) if norm is None else None) if swiglu else rounded_norm(x, norm)
        if xb is not None:
            y = cpu_amx.linear_rounded(xb, x.shape[0], layer.weight)
        else:
            x = self.prologue(x, norm, swiglu)  # float32 torch ops, as the BLAS route runs them
            y = cpu_amx.linear(x if x.stride(-1) == 1 else x.contiguous(), layer.weight)
        if layer.bias is not None:
            y += layer.bias
        return y if residual is None else y.add_(residual)

    def take(self, layer: "Linear") -> None:
        w = layer.weight_t
        if w is None:
            raise ValueError("use_row_kernel needs the [in, out] weight (already converted or packed?)")
        if w.device.type != "cpu" or w.dtype not in ROW_KERNEL_DTYPES:
            raise ValueError(f"the row kernel is for float32 or bfloat16 weights on the CPU, got {w.dtype} on {w.device}")
        layer.weight = w.detach().t().contiguous()
        layer.weight_t = None

    def product(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if self.amx_takes(layer, x.shape[0]):
            return self._amx_apply(layer, x, None, False, None)
        if self.kernel_takes(x.shape[0]):
            return cpu_linear.linear(x, layer.weight, layer.bias)
        # past max_rows() or from blas_from_rows: BLAS, on float32 copies of bf16 weights
        weight = layer.weight if layer.weight.dtype == x.dtype else layer.weight.to(x.dtype)
        return nn.functional.linear(x, weight, layer.bias)

    def apply(self, layer: "Linear", x: torch.Tensor | RoundedRows, norm: nn.Module | None = None,
              swiglu: bool = False, residual: torch.Tensor | None = None,
              product: Callable | None = None) -> torch.Tensor:
        if isinstance(x, RoundedRows):  # (gated's SwiGLU, rounded for these tiles: x gives only the rows)
            if norm is not None or swiglu or product is not None or not self.takes_rounded(layer, x.rows):
                raise ValueError("rounded rows are for a long step on the tiles, without a prologue")
            y = cpu_amx.linear_rounded(x.xb, x.rows, layer.weight)
            if layer.bias is not None:
                y += layer.bias
            return y if residual is None else y.add_(residual)
        if product is None and self.amx_takes(layer, x.shape[0]):  # (SP's column split keeps its product)
            return self._amx_apply(layer, x, norm, swiglu, residual)
        if not self.kernel_takes(x.shape[0]):  # past the kernel's rows: torch ops, BLAS
            return super().apply(layer, x, norm, swiglu, residual)
        product = product or cpu_linear.linear
        if norm is None:
            return product(x, layer.weight, layer.bias, swiglu=swiglu, residual=residual)
        return product(x, layer.weight, layer.bias, norm_weight=norm.weight, eps=norm.eps, swiglu=swiglu,
                       residual=residual)


class OneDNNWeights(LinearMethod):
    """``packed``: the matrix pre-packed in oneDNN's blocked layout for ``rows_hint`` rows
    (float32 on the CPU)."""

    name = "onednn"

    def __init__(self, rows_hint: int = PACK_ROWS_HINT) -> None:
        self.rows_hint = rows_hint

    def take(self, layer: "Linear") -> None:
        w = layer.weight_t
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError(f"oneDNN packing is for float32 weights on the CPU, got {w.dtype} on {w.device}")
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().contiguous(), self.rows_hint)
        layer.weight_t = None

    def product(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed, layer.bias, "none", [], "")


class BlockMatrix:
    """A weight matrix [N, K] as a GGUF file stores it: ``parts``, each (uint8 [n_i, row_bytes_i]
    rows, GGML format id), stacked along the output rows (a fused q/k/v matrix whose parts
    have different formats, as Q4_K_M files mix them, stays three parts; nothing is copied).
    ``k``: the input width. ``order`` (int64 [N] or None): output i is stored row ``order[i]``
    (a Llama's q/k rows, which llama.cpp permutes per head: the products run on the rows as
    stored and their outputs are put back in order, instead of a copy of the rows; or RoPE puts
    them in order as it rotates them, for a layer with ``Linear.rows_as_stored``).

    Owns: the parts and their output order. Never: which kernel multiplies (``BlockWeights``)."""

    def __init__(self, parts: list[tuple[torch.Tensor, int]], k: int, order: torch.Tensor | None = None) -> None:
        self.parts, self.k = list(parts), k
        self.tensors, self.codes = [d for d, _ in self.parts], [f for _, f in self.parts]
        for data, fmt in self.parts:
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != cpu_blocks.row_bytes(fmt, k):
                raise ValueError(f"a {cpu_blocks.NAMES.get(fmt, fmt)} part of {k} inputs must be uint8 rows of "
                                 f"{cpu_blocks.row_bytes(fmt, k)} bytes, got {data.dtype} {tuple(data.shape)}")
        n = self.shape[0]
        if order is not None and (order.dtype != torch.int64 or tuple(order.shape) != (n,)
                                  or not torch.equal(order.sort().values, torch.arange(n))):
            raise ValueError(f"a BlockMatrix's order must be a permutation of its {n} rows as int64 [{n}]")
        self.order = order

    def __getstate__(self) -> dict:
        # the prepared C arrays hold this process's addresses: a sequence-parallel rank builds its own
        return {"parts": self.parts, "k": self.k, "order": self.order}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["parts"], state["k"], state.get("order"))

    def prepared(self) -> cpu_blocks.PreparedParts:
        """The parts as the block kernel's entry takes them, built on first use."""
        ready = self.__dict__.get("_prepared")
        if ready is None:
            ready = self._prepared = cpu_blocks.PreparedParts(self.tensors, self.codes, self.k)
        return ready

    def stored(self) -> "BlockMatrix":
        """This matrix with its rows in stored order (itself when it has no ``order``): the
        same parts and prepared arrays."""
        if self.order is None:
            return self
        view = self.__dict__.get("_stored")
        if view is None:
            view = self._stored = BlockMatrix(self.parts, self.k)
            view._prepared = self.prepared()
        return view

    @property
    def shape(self) -> tuple[int, int]:
        return sum(d.shape[0] for d, _ in self.parts), self.k

    def cat(self, other: "BlockMatrix") -> "BlockMatrix":
        if other.k != self.k:
            raise ValueError(f"fused matrices must share their input width, got {self.k} and {other.k}")
        order = None
        if self.order is not None or other.order is not None:
            n = self.shape[0]
            order = torch.cat([torch.arange(n) if self.order is None else self.order,
                               n + (torch.arange(other.shape[0]) if other.order is None else other.order)])
        return BlockMatrix(self.parts + other.parts, self.k, order)

    def nbytes(self) -> int:
        return sum(d.numel() for d, _ in self.parts)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [len(index), K]: the rows ``index`` names (an embedding's lookups)."""
        if len(self.parts) != 1:
            raise ValueError("row lookups are for single-part matrices (an embedding)")
        data, fmt = self.parts[0]
        stored = index.reshape(-1) if self.order is None else self.order[index.reshape(-1)]
        return cpu_blocks.dequantize(data, fmt, self.k, stored).reshape(*index.shape, self.k)


BLOCK_ROWS = 16  # rows up to which the block kernel multiplies; above, dequantized slices and the row kernel's panels
SLICE_BYTES = 8 << 20  # a slice of dequantized rows for those steps


class BlockWeights(LinearMethod):
    """``blocks``: a ``BlockMatrix``. Steps of up to ``BLOCK_ROWS`` rows (decode, verification)
    run the block kernel, which reads the blocks and dequantizes them in registers, with the
    norm or SwiGLU prologue, the bias and the residual inside the call; longer steps (prefill
    chunks) dequantize slices of ``SLICE_BYTES`` into one float32 buffer and run the row
    kernel's panels on each (the prologues as one C pass each there: ``prologue``), so the
    model never holds a float32 copy.
    ``fast`` (``block_numerics="fast"``: 1): the block kernel's steps take x rounded to int8 in
    blocks of 32 and multiply in integers, as llama.cpp does (formats without integer products
    stay exact); 2 (``"fast2"``): x as two int8 terms, x rounded and what that left rounded
    again, both multiplied on the same unpacked weights; longer steps stay exact.
    ``blas_from_rows``: from that many rows (what ``cpu_tune.slices_from_rows`` measured faster
    here, the products bare), the slices' products are torch's BLAS instead of the row kernel's
    panels.
    ``tiles`` (a bfloat16 model's blocks, where the CPU has AMX-BF16: ``use_bf16_slices``): longer
    steps dequantize slices rounded to bfloat16 and multiply them on the AMX tiles (``cpu_amx``:
    x rounded to bfloat16, float32 sums), a matrix whose parts' rows are multiples of 16 and
    whose width is a multiple of 32 (every model dimension here); the block kernel's short steps
    are the same as in float32.
    ``bf16_panels`` (a bfloat16 model's blocks without AMX, where the row kernel rounds x to
    bfloat16 for its vdpbf16ps panels: ``use_bf16_slices``): longer steps dequantize their slices
    rounded to bfloat16 and run the row kernel on them as on a bfloat16 model's matrices (x
    rounded to bfloat16, float32 sums: the tiles' numbers, up to the order of the sums), never
    BLAS; the short steps as in float32. Checked at each step (``_panels``): a process whose
    own measurement chose widening (a sequence-parallel rank handed the method) keeps the
    float32 slices, where bfloat16 ones would only round the weights."""

    name = "blocks"

    def __init__(self, fast: int = 0, blas_from_rows: int = cpu_linear.UNBOUNDED, tiles: bool = False,
                 bf16_panels: bool = False) -> None:
        self.fast = int(fast)  # steps of up to BLOCK_ROWS rows on x in this many int8 terms
        self.blas_from_rows = int(blas_from_rows)
        self.tiles = bool(tiles)  # longer steps on bfloat16 slices and the AMX tiles
        self.bf16_panels = bool(bf16_panels)  # longer steps on bfloat16 slices and the row kernel
        self._local = threading.local()  # the slice buffers: one per thread, never pickled

    def __getstate__(self) -> dict:
        # a buffer sent along to a sequence-parallel rank would be moved into shared memory and
        # written by both processes at once
        return {"fast": self.fast, "blas_from_rows": self.blas_from_rows, "tiles": self.tiles,
                "bf16_panels": self.bf16_panels}

    def __setstate__(self, state: dict) -> None:
        self.fast = state["fast"]
        self.blas_from_rows = state.get("blas_from_rows", cpu_linear.UNBOUNDED)
        self.tiles = state.get("tiles", False)
        self.bf16_panels = state.get("bf16_panels", False)
        self._local = threading.local()

    def take(self, layer: "Linear") -> None:
        if not isinstance(layer.weight, BlockMatrix):
            raise ValueError("BlockWeights holds a BlockMatrix, set as the layer's weight")
        layer.weight_t = None

    def _buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        name = "scratch" if dtype == torch.float32 else "scratch_bf16"
        scratch = getattr(self._local, name, None)
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(numel, dtype=dtype)
            setattr(self._local, name, scratch)
        return scratch[:numel]

    def _panels(self) -> bool:
        """Whether this process's long steps take bfloat16 slices on the row kernel's panels."""
        return self.bf16_panels and cpu_linear.rounds_bf16_rows() > 0

    def _on_tiles(self, blocks: BlockMatrix) -> bool:
        """Whether a long step over ``blocks`` runs on the AMX tiles."""
        return (self.tiles and blocks.k % cpu_amx.K_MULTIPLE == 0
                and all(d.shape[0] % cpu_amx.N_MULTIPLE == 0 for d in blocks.tensors) and cpu_amx.available())

    def _gated_on_tiles(self, blocks: BlockMatrix) -> bool:
        """Whether ``gated``'s slices of gate and up over ``blocks`` (half its rows each) run on
        the AMX tiles."""
        return self._on_tiles(blocks) and (blocks.shape[0] // 2) % cpu_amx.N_MULTIPLE == 0

    def long_steps_on_tiles(self, blocks: BlockMatrix) -> bool:
        """Whether every long step over ``blocks`` runs on the AMX tiles, as a product or (an
        even number of rows) as ``gated``'s halves."""
        return self._on_tiles(blocks) and (blocks.shape[0] % 2 == 1 or self._gated_on_tiles(blocks))

    def product(self, layer: "Linear", x: torch.Tensor, residual: torch.Tensor | None = None,
                rounded: torch.Tensor | None = None) -> torch.Tensor:
        """``rounded``: x as the tiles take it (``cpu_amx.round_x``), given where the product runs on
        them (``x`` then only gives the row count)."""
        blocks: BlockMatrix = layer.weight
        if blocks.order is None or _as_stored(layer):
            return self._product(blocks.stored(), layer.bias, x, residual, rounded)
        # the stored rows' products, then in order, then the bias and residual
        return _in_order(self._product(blocks.stored(), None, x, None, rounded), blocks.order, layer.bias, residual)

    def _product(self, blocks: BlockMatrix, bias: torch.Tensor | None, x: torch.Tensor,
                 residual: torch.Tensor | None, rounded: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape[0], blocks.k
        out = torch.empty(m, blocks.shape[0], dtype=torch.float32)
        if m == 0:
            return out
        x = x.contiguous()
        if m <= BLOCK_ROWS:  # every part in one call (fast: integer products where the format has them)
            return blocks.prepared()(x, out, bias, residual, num_threads=torch.get_num_threads(), fast=self.fast)
        if self._on_tiles(blocks):
            out = torch.empty(cpu_amx.padded_rows(m), blocks.shape[0], dtype=torch.float32)
            self._tile_product(blocks, cpu_amx.round_x(x) if rounded is None else rounded, m, 0, blocks.shape[0], out)
            out = out[:m]
            if bias is not None:
                out.add_(bias)
            return out if residual is None else out.add_(residual)
        lo = 0
        panels = self._panels()
        slice_type = torch.bfloat16 if panels else torch.float32
        for data, fmt in blocks.parts:
            hi = lo + data.shape[0]
            part_bias = None if bias is None else bias[lo:hi]
            res = None if residual is None else residual[:, lo:hi]
            step = _slice_rows(k)  # longer steps: slices of each part through the row kernel
            for r0 in range(0, hi - lo, step):
                r1 = min(r0 + step, hi - lo)
                w = self._buffer((r1 - r0) * k, slice_type).view(r1 - r0, k)
                cpu_blocks.dequantize(data, fmt, k, first_row=r0, num_rows=r1 - r0, out=w)
                b = None if part_bias is None else part_bias[r0:r1]
                r = None if res is None else res[:, r0:r1]
                if m >= self.blas_from_rows and not panels:  # BLAS, measured faster here at these rows, straight into
                    cols = out[:, lo + r0:lo + r1]  # out's columns (BLAS takes the row stride: no copy)
                    torch.mm(x, w.t(), out=cols) if b is None else torch.addmm(b, x, w.t(), out=cols)
                    if r is not None:
                        cols.add_(r)
                else:
                    cpu_linear.linear(x, w, b, residual=r, out=out[:, lo + r0:lo + r1])
            lo = hi
        return out

    def takes_rounded(self, layer: "Linear", rows: int) -> bool:
        return rows > BLOCK_ROWS and self._on_tiles(layer.weight)

    @staticmethod
    def prologue(x: torch.Tensor, norm: nn.Module | None, swiglu: bool) -> torch.Tensor:
        """``LinearMethod.prologue`` with each over float32 rows in one C pass where the row
        kernel runs (``normed``, ``swiglu_of``: its numbers, within float32 rounding of torch's),
        as the block kernel's short steps run them."""
        if norm is not None:
            x = normed(x, norm)
        if swiglu:
            gate, up = x.split(x.shape[-1] // 2, dim=-1)  # (T, F) each
            x = swiglu_of(gate, up)
        return x

    def apply(self, layer: "Linear", x: torch.Tensor | RoundedRows, norm: nn.Module | None = None,
              swiglu: bool = False, residual: torch.Tensor | None = None,
              product: Callable | None = None) -> torch.Tensor:
        if isinstance(x, RoundedRows):  # (gated's SwiGLU, rounded for these tiles: x gives only the rows)
            if norm is not None or swiglu or not self.takes_rounded(layer, x.rows):
                raise ValueError("rounded rows are for a long step on the tiles, without a prologue")
            return self.product(layer, x.xb[:x.rows], residual, rounded=x.xb)
        if 0 < x.shape[0] <= BLOCK_ROWS and x.dtype == torch.float32 and (
                norm is None or norm.weight.dtype == torch.float32):  # the prologue inside the one call
            blocks: BlockMatrix = layer.weight
            order = None if _as_stored(layer) else blocks.order
            out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
            out = blocks.prepared()(x.contiguous(), out, layer.bias if order is None else None,
                                    residual if order is None else None,
                                    None if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
                                    swiglu, torch.get_num_threads(), self.fast)
            return out if order is None else _in_order(out, order, layer.bias, residual)
        if not swiglu and x.shape[0] > BLOCK_ROWS and self._on_tiles(layer.weight):
            xb = rounded_norm(x, norm)  # (the norm folded into x's rounding for the tiles)
            if xb is not None:
                return self.product(layer, x, residual, rounded=xb)
        return self.product(layer, self.prologue(x, norm, swiglu), residual)

    def gated(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None, act: str,
              rounded: bool = False) -> torch.Tensor | RoundedRows | None:
        """A long step's gate/up product, a slice of F at a time: each slice's gate and up rows
        are dequantized and multiplied as ``_product`` does (the same row kernel or BLAS calls on
        the same rows, so the same numbers) into a pair buffer [T, 2 * step], and ``act(gate) * up``
        goes straight into the [T, F] result. At a 1B model's 512-row chunks the [T, 2F] product
        (32 MiB) and the activation's temporary (16 MiB) are never held; the pair is 4 MiB.
        The activation runs on strided views, each row its own loop, from columns that are
        multiples of 64: the C SwiGLU pass's 8-wide vector code (``swiglu_of``; GELU: torch's
        vector and scalar code) takes the same elements as on the whole [T, F] gate (the
        vector and scalar forms differ in the last bit), so the result is the same bit for bit (with
        BLAS's products, where gate and up are parts of their own: BLAS's sums may depend on a
        slice's width, and a fused gate/up part, Phi-3's, is cut elsewhere by ``_product``).
        With ``rounded`` (a down projection on the tiles next), on the tiles and F a multiple of
        32: ``act(gate) * up`` goes straight into that projection's rounded input instead
        (``cpu_amx.round_gated``, the kernel's exponential: not torch's bits), returned as
        ``RoundedRows``."""
        blocks: BlockMatrix = layer.weight
        m, k = x.shape[0], blocks.k
        if m <= BLOCK_ROWS or blocks.order is not None or blocks.shape[0] % 2:
            return None  # short steps: the block kernel, SwiGLU fused into the down product's call
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"act must be 'silu' or 'gelu_tanh', got {act!r}")
        tiles = self._gated_on_tiles(blocks)
        xb = rounded_norm(x, norm) if tiles else None  # (x rounded once for every slice of gate and up,
        if xb is None:  # with the norm folded into the rounding where it can be)
            x = self.prologue(x, norm, False).contiguous()
            xb = cpu_amx.round_x(x) if tiles else None
        f = blocks.shape[0] // 2
        # on the tiles, for a down projection on them: act(gate) * up straight into its rounded
        # input (cpu_amx.round_gated: the kernel's exponential, not torch's), no [T, F] floats
        to_tiles = rounded and tiles and f % cpu_amx.K_MULTIPLE == 0
        out = (cpu_amx.empty_rounded(m, f) if to_tiles
               else torch.empty(m, f, dtype=torch.float32))
        step = _slice_rows(k)
        pair = torch.empty(cpu_amx.padded_rows(m) if tiles else m, 2 * min(step, f), dtype=torch.float32)
        half = pair.shape[1] // 2
        for r0 in range(0, f, step):
            w = min(r0 + step, f) - r0
            gate, up = pair[:, :w], pair[:, half:half + w]  # (strided: each row is its own loop)
            if tiles:  # (the tiles write whole 16-row blocks: the pair's rows past m are padding)
                self._tile_product(blocks, xb, m, r0, r0 + w, gate)
                self._tile_product(blocks, xb, m, f + r0, f + r0 + w, up)
                gate, up = gate[:m], up[:m]
                if layer.bias is not None:
                    gate.add_(layer.bias[r0:r0 + w])
                    up.add_(layer.bias[f + r0:f + r0 + w])
            else:
                self._slice_product(blocks, layer.bias, x, r0, r0 + w, gate)
                self._slice_product(blocks, layer.bias, x, f + r0, f + r0 + w, up)
            if to_tiles:
                cpu_amx.round_gated(gate, up, act, xb=out, col0=r0)
            elif act == "silu":  # (the prologue's SwiGLU: the same numbers as on the whole [T, 2F] product)
                swiglu_of(gate, up, out=out[:, r0:r0 + w])
            else:
                torch.mul(activation(gate, act, out=gate), up, out=out[:, r0:r0 + w])  # (the pair is scratch)
        return RoundedRows(out, m) if to_tiles else out

    def _slice_product(self, blocks: BlockMatrix, bias: torch.Tensor | None, x: torch.Tensor, lo: int,
                       hi: int, out: torch.Tensor) -> None:
        """out = x @ rows [lo, hi) of the stacked parts .T (+ their bias), through the slice buffer
        (bfloat16 with ``bf16_panels``)."""
        panels = self._panels()
        w = self._buffer((hi - lo) * blocks.k, torch.bfloat16 if panels else torch.float32).view(hi - lo, blocks.k)
        start = 0
        for data, fmt in blocks.parts:  # (a slice may cross from one part into the next)
            end = start + data.shape[0]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                cpu_blocks.dequantize(data, fmt, blocks.k, first_row=a - start, num_rows=b - a, out=w[a - lo:b - lo])
            start = end
        b = None if bias is None else bias[lo:hi]
        if x.shape[0] >= self.blas_from_rows and not panels:  # (straight into out's strided columns)
            torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)
        else:
            cpu_linear.linear(x, w, b, out=out)


    def _tile_product(self, blocks: BlockMatrix, xb: torch.Tensor, m: int, lo: int, hi: int,
                      out: torch.Tensor) -> None:
        """out [m rounded up to 16, hi - lo] (contiguous rows; the rows past m are padding the
        tiles write) = x @ rows [lo, hi) of the stacked parts .T, on the AMX tiles, for x's m rows
        rounded once (``cpu_amx.round_x``: ``xb``): slices of each part dequantized and rounded
        to bfloat16 (``_slice_rows``' count of rows, half its bytes) and multiplied by ``cpu_amx``
        straight into their columns of ``out``."""
        k, step, threads = blocks.k, _slice_rows(blocks.k), torch.get_num_threads()
        start = 0
        for data, fmt in blocks.parts:
            end = start + data.shape[0]
            for a in range(max(lo, start), min(hi, end), step):
                b = min(a + step, hi, end)
                w = self._buffer((b - a) * k, torch.bfloat16).view(b - a, k)
                cpu_blocks.dequantize(data, fmt, k, first_row=a - start, num_rows=b - a, out=w, num_threads=threads)
                cpu_amx.amx_linear_rounded(xb, m, w, out[:, a - lo:b - lo], threads)
            start = end


def _as_stored(layer: "Linear") -> bool:
    """Whether ``layer``'s outputs stay in its matrix's stored row order (``rows_as_stored``);
    such a layer takes no bias (the bias is in order, its outputs would not be)."""
    if layer.rows_as_stored and layer.bias is not None:
        raise ValueError("a layer whose outputs stay in stored order takes no bias")
    return layer.rows_as_stored




def _slice_rows(k: int) -> int:
    """Rows of a dequantized slice of ``k`` inputs: ``SLICE_BYTES`` of float32, a multiple of 64
    (``gated``'s slices start where torch's vector loops would on a whole row; ``_product`` cuts
    a part the same way, so where gate and up are parts of their own, BLAS sees the same slices)."""
    return max(64, SLICE_BYTES // (4 * k) // 64 * 64)


def _in_order(stored: torch.Tensor, order: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
    """A product over stored rows [M, N] -> its outputs in order (+ bias) (+ residual)."""
    out = stored.index_select(1, order)
    if bias is not None:
        out.add_(bias)
    if residual is not None:
        out.add_(residual)
    return out


class BlockEmbedding(nn.Module):
    """An embedding table kept as a ``BlockMatrix``: a lookup dequantizes the rows it needs."""

    def __init__(self, blocks: BlockMatrix) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.rows(ids)


def blocks_available() -> bool:
    """Whether GGUF blocks can be kept as stored here: the block kernel and the row kernel
    (its panels take the long steps) both run."""
    return cpu_blocks.available() and cpu_linear.available() and cpu_build.vectorized()


BLAS = LinearMethod()
ROW_KERNEL = RowKernelWeights()
BLOCKS = BlockWeights()  # one for every layer: they share its float32 slice buffer
# by block_numerics' int8 terms (0: exact); one of each for every layer, as BLOCKS
BLOCK_METHODS = {0: BLOCKS, 1: BlockWeights(fast=1), 2: BlockWeights(fast=2)}


def _block_method(made: dict, method: BlockWeights, **change) -> BlockWeights:
    """``method`` with ``change`` (BlockWeights' arguments), one object per kind for all layers
    (``made``), as at load: they share its slice buffers."""
    state = {**method.__getstate__(), **change}
    return made.setdefault(tuple(sorted(state.items())), BlockWeights(**state))


def use_bf16_slices(model: nn.Module) -> int:
    """A bfloat16 model's GGUF blocks: their long steps on bfloat16 slices, multiplied on the AMX
    tiles (``BlockWeights.tiles``) where the CPU has them, else by the row kernel's bfloat16
    panels (``BlockWeights.bf16_panels``) where that kernel rounds x to bfloat16 (vdpbf16ps,
    ``cpu_linear.rounds_bf16_rows``: AVX-512 BF16, measured faster than widening); elsewhere
    nothing changes (the float32 slices, where x stays float32 and rounding the weights would
    only cost precision). Returns how many layers took it."""
    if cpu_amx.available():
        change = {"tiles": True}
    elif cpu_linear.available() and cpu_linear.rounds_bf16_rows():
        change = {"bf16_panels": True}
    else:
        return 0
    made: dict[tuple, LinearMethod] = {}
    taken = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.method, BlockWeights):
            module.method = _block_method(made, module.method, **change)
            taken += 1
    return taken


def all_on_tiles(model: nn.Module) -> bool:
    """Whether every long step of ``model``'s matrices runs on the AMX tiles: all of them GGUF
    blocks (and some) whose products and gated halves take the tiles. Then no float32 slice or
    matrix is ever multiplied, and BLAS's row count does not matter."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return bool(linears) and all(isinstance(m.method, BlockWeights) and m.method.long_steps_on_tiles(m.weight)
                                 for m in linears)


def tune_bf16_long_steps(model: nn.Module, amx_from_rows: int) -> int:
    """Steps of ``amx_from_rows`` rows and more through the AMX tiles for ``model``'s bfloat16
    row-kernel matrices (one method object for all of them). Returns how many layers took it."""
    method = RowKernelWeights(amx_from_rows=amx_from_rows)
    taken = 0
    for module in model.modules():
        if (isinstance(module, Linear) and module.method.name == ROW_KERNEL.name and module.weight is not None
                and module.weight.dtype == torch.bfloat16):
            module.method = method
            taken += 1
    return taken


def tune_long_steps(model: nn.Module, blas_from_rows: int, slices_from_rows: int | None = None) -> int:
    """Steps of ``blas_from_rows`` rows and more (prefill chunks) through BLAS on the same
    numbers for ``model``'s float32 row-kernel matrices, and of ``slices_from_rows`` (default:
    the same) for its GGUF blocks (their dequantized slices); bfloat16 matrices keep the kernel
    (BLAS would need a float32 copy). One method object per kind for all layers, as at load.
    Returns how many layers took it."""
    slices_from_rows = blas_from_rows if slices_from_rows is None else slices_from_rows
    made: dict[tuple, LinearMethod] = {}
    taken = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        method = module.method
        if method.name == ROW_KERNEL.name and module.weight is not None and module.weight.dtype == torch.float32:
            module.method = made.setdefault(("kernel",), RowKernelWeights(blas_from_rows))
        elif isinstance(method, BlockWeights):
            module.method = _block_method(made, method, blas_from_rows=slices_from_rows)
        else:
            continue
        taken += 1
    return taken


class Linear(nn.Module):
    """y = x @ W^T (+ bias), the matrix held by ``method`` (one copy): ``weight_t`` [in, out]
    as loaded (``BLAS``), ``weight`` [out, in] (``ROW_KERNEL``, after ``use_row_kernel``) or
    ``packed`` (``OneDNNWeights``, after ``pack_onednn``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.method: LinearMethod = BLAS
        # a BlockMatrix's outputs left in its stored rows' order (its ``order`` not applied):
        # set by the one caller that puts them in order itself (``Attention.rotate_stored_pairs``)
        self.rows_as_stored = False

    def hold(self, method: LinearMethod) -> None:
        method.take(self)
        self.method = method

    def use_row_kernel(self) -> None:
        self.hold(ROW_KERNEL)

    def pack_onednn(self, rows_hint: int = PACK_ROWS_HINT) -> None:
        self.hold(OneDNNWeights(rows_hint))

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, swiglu: bool = False,
                residual: torch.Tensor | None = None, product: Callable | None = None) -> torch.Tensor:
        return self.method.apply(self, x, norm, swiglu, residual, product)

    # a decoder layer makes four of these calls: straight to forward, past nn.Module's hook
    # machinery (no hooks are ever set on a Linear)
    __call__ = forward
