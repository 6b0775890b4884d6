"""A model made ready for the engine: loaded onto its device in the form its products take, and
the context window it serves.

Owns: ``prepare_model`` (the same on every sequence-parallel rank), ``model_window`` and the
check of a ``max_model_len`` past the trained window. Never: KV, scheduling.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from longctx.config import BLOCK_TERMS, ConfigError, ModelLoadConfig, ParallelConfig
from longctx.kernels import cpu_blocks, cpu_build, cpu_tune

from .config import ModelConfig
from .gguf_file import GGUFFile
from .llama import LlamaForCausalLM, choose_cpu_matmul
from .linear import (ROW_KERNEL, BlockWeights, Linear, blocks_available, tune_bf16_long_steps,
                     tune_long_steps, use_bf16_slices)
from .loader import (TORCH_DTYPES, load_blocks_model, load_model, load_quantized_model, load_row_kernel_model,
                     resolve_model)

log = logging.getLogger(__name__)


def prepare_model(load: ModelLoadConfig, parallel: ParallelConfig,
                  device: torch.device) -> tuple[LlamaForCausalLM, str | None]:
    """Load the model onto ``device`` in the form its products take ("kernel", "onednn" or
    "blas" on the CPU, None elsewhere): the same on every sequence-parallel rank."""
    if load.num_threads:
        torch.set_num_threads(load.num_threads)
    if device.type == "cpu":
        # SiLU of very negative pre-activations underflows to denormals, and x86 matmuls on
        # denormal inputs run several times slower (measured: a 4K-token prefill 30 s -> 12 s).
        # Flushing them to zero changes values below 1e-38 only.
        torch.set_flush_denormal(True)
    dtype = TORCH_DTYPES[load.dtype]
    if load.quantization != "none":
        _check_quantization(load)
        return _blocks_tuned(load_quantized_model(load.model, load.quantization, load.quantization_group_size,
                                                  rope_scaling=load.rope_scaling,
                                                  fast=BLOCK_TERMS[load.block_numerics]), dtype), "blocks"
    if device.type == "cpu" and _keeps_blocks(load, dtype):
        return _blocks_tuned(load_blocks_model(load.model, rope_scaling=load.rope_scaling,
                                               fast=BLOCK_TERMS[load.block_numerics]), dtype), "blocks"
    cpu_matmul = choose_cpu_matmul(load.cpu_matmul, dtype) if device.type == "cpu" else None
    if cpu_matmul == "kernel":  # from the weight cache in the kernel's layout, memory-mapped
        model = load_row_kernel_model(load.model, dtype, rope_scaling=load.rope_scaling,
                                      cache_bytes=weight_cache_bytes(load))
        return _tuned(model, dtype), cpu_matmul
    model = load_model(load.model, dtype=dtype, device=device, rope_scaling=load.rope_scaling,
                       cache_bytes=weight_cache_bytes(load))
    if device.type != "cpu":
        return model, None
    if cpu_matmul == "onednn" and load.cpu_matmul == "auto" and parallel.sequence_parallel_size > 1:
        # the ranks share the weights through shared memory, which oneDNN's packed (opaque)
        # tensors cannot join: keep them as plain BLAS matrices
        cpu_matmul = "blas"
    if cpu_matmul == "onednn":
        model.pack_linears_onednn()
    return model, cpu_matmul


def weight_cache_bytes(load: ModelLoadConfig) -> int:
    """``weight_cache_gb`` in bytes: the bound of the converted-weight caches (the loader's)."""
    return int(load.weight_cache_gb * 2**30)


def _tuned(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Prefill chunks of a model with float32 activations: the row kernel's panels or, whichever
    ``cpu_tune`` measured faster on this machine for its MLP shapes, BLAS (float32 matrices; GGUF
    blocks' slices, measured bare: nothing is fused there) or the AMX tiles (bfloat16 matrices,
    where the CPU has them). Only what the model multiplies in float32 is measured (nothing for
    blocks whose long steps all take bfloat16 slices, on the AMX tiles or the panels). The
    measurements run in the heap regime the steps will (``keep_large_blocks``, which the engine
    sets anyway once loaded): before it, with torch's large tensors on huge pages, each
    temporary of BLAS's way at 2,048 rows was mapped and faulted in afresh (the 135M shapes' two
    products 67 ms against 30 in the heap; Intel Xeon model 167), and the tune kept the kernel
    where BLAS ran 15% faster in the model."""
    shapes = model.mlp_shapes()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    cpu_build.keep_large_blocks()
    try:
        cpu_tune.setting()  # (a bad LONGCTX_CPU_TUNE is refused even where nothing is measured)
        if dtype == torch.bfloat16:
            tune_bf16_long_steps(model, cpu_tune.amx_from_rows(shapes))
            return model
        kernel = any(m.method.name == ROW_KERNEL.name and m.weight.dtype == torch.float32 for m in linears)
        # (blocks whose long steps all take bfloat16 slices, on the tiles or the panels, multiply no
        # float32 slice: nothing to measure)
        blocks = any(isinstance(m.method, BlockWeights) and not m.method.bf16_panels
                     and not m.method.long_steps_on_tiles(m.weight) for m in linears)
        rows = cpu_tune.blas_from_rows(shapes) if kernel else None
        slices = cpu_tune.slices_from_rows(shapes) if blocks else None
    except ValueError as err:  # LONGCTX_CPU_TUNE that is not auto, off or a row count
        raise ConfigError(str(err)) from None
    if kernel or blocks:
        tune_long_steps(model, cpu_tune.NEVER if rows is None else rows, slices)
    return model


def _blocks_tuned(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """A model of blocks (float32 activations) computing in ``dtype``: bfloat16 sends its prefill
    chunks to bfloat16 slices, on the AMX tiles where the CPU has them, else on the row kernel's
    vdpbf16ps panels where it uses them (``use_bf16_slices``); the rest as float32's
    (``_tuned``)."""
    if dtype == torch.bfloat16:
        use_bf16_slices(model)
    return _tuned(model)


def _check_quantization(load: ModelLoadConfig) -> None:
    """``quantization`` is for an HF folder, on a machine where the block kernel runs."""
    if resolve_model(load.model).is_file():
        raise ConfigError(f"quantization={load.quantization!r} is for HF folders; {load.model!r} is a .gguf "
                          "file, whose blocks are kept as stored (gguf_weights)")
    if not blocks_available():
        raise ConfigError(f"quantization={load.quantization!r} needs the CPU block and row kernels with their "
                          f"vector paths (block kernel: {cpu_blocks.status()}, instruction set {cpu_build.isa()})")


def _keeps_blocks(load: ModelLoadConfig, dtype: torch.dtype) -> bool:
    """Whether a CPU model keeps its GGUF blocks (``gguf_weights``); 'blocks' that cannot be
    served here raises ``ConfigError``."""
    if load.gguf_weights == "float":
        return False
    is_gguf = resolve_model(load.model).is_file()
    if load.gguf_weights == "blocks":
        if not is_gguf:
            raise ConfigError(f"gguf_weights='blocks' is for .gguf models, {load.model!r} is an HF folder")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"gguf_weights='blocks' computes in float32 or bfloat16, got dtype {dtype}")
        if not blocks_available():
            raise ConfigError("gguf_weights='blocks' needs the CPU block and row kernels with their vector "
                              f"paths (block kernel: {cpu_blocks.status()}, instruction set {cpu_build.isa()})")
        return True
    # auto: a CPU model whose products are left to choose (cpu_matmul 'auto'; a chosen cpu_matmul
    # is a product over float weights), in float32, or in bfloat16 where the file's matrices take
    # fewer bytes as stored than as bfloat16 (a quantized file: expanded, a Q4_K_M would take
    # ~3.5x its size). Its prefill then runs on bfloat16 slices with the AMX tiles or the row
    # kernel's vdpbf16ps panels (the expanded weights' own kernel), else on float32 slices near
    # the expanded weights' widened products (a Xeon without AMX, 1B-shaped Q4_K_M: level at 2K
    # in one process, 1.05x at 4K in one record, decode 0.76x at 0.43x the RSS; AMD not measured
    # yet); an F32/F16/BF16 file in bfloat16 is expanded to the row kernel's layout
    if not (is_gguf and load.cpu_matmul == "auto" and blocks_available()):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and narrower_than_bf16(resolve_model(load.model)))


def narrower_than_bf16(path: Path) -> bool:
    """Whether a GGUF file's matrices (its 2-D tensors) take fewer bytes as stored than they
    would as bfloat16: quantized blocks, not F32/F16/BF16."""
    stored = wide = 0
    for t in GGUFFile(path).tensors:
        if len(t.shape) == 2:
            stored += t.data.nbytes
            wide += 2 * int(t.shape[0]) * int(t.shape[1])
    return 0 < stored < wide


def model_window(config: ModelConfig) -> int:
    """The context window the model's RoPE serves, read as vLLM and HF read it: the checkpoint's
    ``max_position_embeddings``, stretched by a linear, dynamic or YaRN ``rope_scaling`` (from
    config.json, GGUF keys or the override) to ``original_max_position_embeddings`` (else the
    checkpoint's) times ``factor``; llama3 and GGUF frequency factors already state theirs."""
    window = config.max_position_embeddings
    rs = config.rope_scaling
    if rs.rope_type in ("linear", "dynamic", "yarn") and rs.freq_factors is None:
        window = max(window, int((rs.original_max_position_embeddings or window) * rs.factor))
    return window


def check_window(max_len: int, config: ModelConfig, allow_long_context: bool) -> None:
    """Refuse a ``max_model_len`` past the trained window unless ``allow_long_context``; warn
    (naming the reason) when it is allowed."""
    window = model_window(config)
    if max_len <= window:
        return
    rs = config.rope_scaling
    if rs.rope_type in ("linear", "dynamic", "yarn"):
        why = f"the {rs.rope_type} rope_scaling (factor {rs.factor:g}) stretches the model to {window} positions"
    else:
        why = (f"the model was trained on {window} positions (max_position_embeddings) and its "
               f"RoPE ({rs.rope_type}) does not stretch further")
    hint = f"pass rope_scaling, e.g. {{\"rope_type\": \"yarn\", \"factor\": {2 ** math.ceil(math.log2(max_len / window)):g}}}"
    if not allow_long_context:
        raise ConfigError(f"max_model_len {max_len} is past the model's window: {why}; {hint}, or "
                          "allow_long_context=True (--allow-long-context) to accept degraded outputs past it")
    log.warning("max_model_len %d is past the model's window (allow_long_context): %s; outputs "
                "past %d positions degrade", max_len, why, window)
