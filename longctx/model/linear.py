"""Linear layers and their weight formats: one ``LinearMethod`` per layout (vLLM's shape).

Owns: ``Linear`` (a matrix, an optional bias and the method that holds and multiplies it) and
the methods: ``BLAS`` (``weight_t`` [in, out], the layout a checkpoint loads into), ``ROW_KERNEL``
(``weight`` [out, in], read by the C row kernel of ``longctx.kernels.cpu_linear``) and
``OneDNNWeights`` (``packed``, oneDNN's blocked layout). The model picks one at load
(``choose_cpu_matmul``); quantized block formats come in as further methods.
Never: which rows a step has, or the model's structure.

A call may carry the layer's neighbours: ``norm`` (the RMSNorm before the product), ``swiglu``
(the input is [T, 2F] and the product takes ``silu(gate) * up``) and ``residual`` (added to the
result). A method that can fuse them into its product does (the row kernel: a decoder layer is
four kernel calls around attention); the others run them as separate torch ops, in the order
the model would. ``product``: a replacement for the row kernel's function with its signature
(sequence parallelism's column split).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from longctx.config import ConfigError
from longctx.kernels import cpu_build, cpu_linear

PACK_ROWS_HINT = 16  # oneDNN packs for this many rows: measured as fast as 4, faster than 1 at 2-2048 rows
ROW_KERNEL_DTYPES = tuple(cpu_linear.WEIGHT_TYPES)  # the weight dtypes the row kernel reads


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

    def apply(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None = None, swiglu: bool = False,
              residual: torch.Tensor | None = None, product: Callable | None = None) -> torch.Tensor:
        if norm is not None:
            x = norm(x)
        if swiglu:
            gate, up = x.split(x.shape[-1] // 2, dim=-1)  # (T, F) each
            x = nn.functional.silu(gate) * up
        y = self.product(layer, x)
        return y if residual is None else residual + y


class RowKernelWeights(LinearMethod):
    """``weight`` [out, in] contiguous, one copy: the C row kernel for 1..``max_rows()`` rows
    (with the norm, SwiGLU and residual inside it), BLAS on the same matrix above that."""

    name = "kernel"

    def take(self, layer: "Linear") -> None:
        w = layer.weight_t
        if w is None:
            raise ValueError("use_row_kernel needs the [in, out] weight (already converted or packed?)")
        if w.device.type != "cpu" or w.dtype not in ROW_KERNEL_DTYPES:
            raise ValueError(f"the row kernel is for float32 or bfloat16 weights on the CPU, got {w.dtype} on {w.device}")
        layer.weight = w.detach().t().contiguous()
        layer.weight_t = None

    def product(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= cpu_linear.max_rows():
            return cpu_linear.linear(x, layer.weight, layer.bias)
        # past max_rows(): BLAS, on float32 copies of bf16 weights
        weight = layer.weight if layer.weight.dtype == x.dtype else layer.weight.to(x.dtype)
        return nn.functional.linear(x, weight, layer.bias)

    def apply(self, layer: "Linear", x: torch.Tensor, norm: nn.Module | None = None, swiglu: bool = False,
              residual: torch.Tensor | None = None, product: Callable | None = None) -> torch.Tensor:
        if not 0 < x.shape[0] <= cpu_linear.max_rows():  # past the kernel's rows: torch ops, BLAS
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


BLAS = LinearMethod()
ROW_KERNEL = RowKernelWeights()


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
