"""A model made ready for the engine: loaded onto its device in the form its products take, and
the context window it serves.

Owns: ``prepare_model`` (the same on every sequence-parallel rank), ``model_window`` and the
warning for a ``max_model_len`` past the trained window. Never: KV, scheduling.
"""

from __future__ import annotations

import logging
import math

import torch

from longctx.config import ModelLoadConfig, ParallelConfig

from .config import ModelConfig
from .llama import LlamaForCausalLM, choose_cpu_matmul
from .loader import TORCH_DTYPES, load_model, load_row_kernel_model

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
    cpu_matmul = choose_cpu_matmul(load.cpu_matmul, dtype) if device.type == "cpu" else None
    if cpu_matmul == "kernel":  # from the weight cache in the kernel's layout, memory-mapped
        return load_row_kernel_model(load.model, dtype, rope_scaling=load.rope_scaling), cpu_matmul
    model = load_model(load.model, dtype=dtype, device=device, rope_scaling=load.rope_scaling)
    if device.type != "cpu":
        return model, None
    if cpu_matmul == "onednn" and load.cpu_matmul == "auto" and parallel.sequence_parallel_size > 1:
        # the ranks share the weights through shared memory, which oneDNN's packed (opaque)
        # tensors cannot join: keep them as plain BLAS matrices
        cpu_matmul = "blas"
    if cpu_matmul == "onednn":
        model.pack_linears_onednn()
    return model, cpu_matmul


def model_window(config: ModelConfig, rope_scaling: dict | None) -> int:
    """The context window when ``max_model_len`` is not given: the checkpoint's
    ``max_position_embeddings``, or with a ``rope_scaling`` override the window it stretches
    to (``original_max_position_embeddings``, else the checkpoint's, times ``factor``)."""
    window = config.max_position_embeddings
    if rope_scaling:
        rs = config.rope_scaling
        window = max(window, int((rs.original_max_position_embeddings or window) * rs.factor))
    return window


def warn_past_window(max_len: int, config: ModelConfig, rope_scaling: dict | None) -> None:
    window = model_window(config, rope_scaling)
    if max_len <= window:
        return
    if rope_scaling:
        log.warning("max_model_len %d exceeds the %d positions the rope_scaling override stretches "
                    "the model to; outputs past it may degrade", max_len, window)
    else:
        log.warning("max_model_len %d exceeds the model's window (max_position_embeddings %d) and no "
                    "rope_scaling is given: positions past %d were never trained and outputs there "
                    "degrade; pass rope_scaling, e.g. {\"rope_type\": \"yarn\", \"factor\": %g}",
                    max_len, window, window, 2 ** math.ceil(math.log2(max_len / window)))
