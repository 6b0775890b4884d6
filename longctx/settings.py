"""Every environment variable longctx reads, with its meaning.

Owns: the list (``ENV_VARS``) and the one resolution of the cache folder. The variables are
read where they act (the C kernels' build in ``longctx.kernels.cpu_build``, which imports
nothing of ``longctx``; torchrun's in ``longctx.entrypoints.torchrun`` / ``longctx.parallel.comm``);
``tests/test_settings.py`` fails when code reads one that is not listed here. Settings of the
engine itself are config fields (``longctx.config``), never environment variables.
"""

from __future__ import annotations

from pathlib import Path

from longctx.kernels import cpu_build

ENV_VARS: dict[str, str] = {
    # longctx's own
    "LONGCTX_CACHE_DIR": "folder for converted weights, tokenizers and compiled C kernels "
                         "(default: $XDG_CACHE_HOME/longctx, else ~/.cache/longctx)",
    "XDG_CACHE_HOME": "the user's cache folder, when LONGCTX_CACHE_DIR is not set",
    "XDG_CONFIG_HOME": "the user's config folder: the disk KV tier's per-user HMAC key is made in "
                       "$XDG_CONFIG_HOME/longctx/ (else ~/.config/longctx/) unless disk_cache_key_file names one",
    "LONGCTX_CPU_KERNEL": "0: never build or use the compiled C kernels (torch paths only)",
    "LONGCTX_CPU_ISA": "build the C kernels for this instruction-set level (avx512bf16, avx512, "
                       "avx2, portable, native) instead of the best the CPU supports",
    "LONGCTX_CPU_TUNE": "where a float32 model's prefill chunks leave the C row kernel for BLAS (a bfloat16 "
                        "model's: for the AMX tiles, where the CPU has them): auto (default: measured at first use, "
                        "cached per CPU and build in the cache folder's cpu_kernels/tune.json), off (the kernel for "
                        "every step) or a row count (BLAS or AMX from that many rows)",
    "LONGCTX_BF16_DOT": "on or off: bfloat16 weights' long products in the row kernel and bfloat16 KV pages' "
                        "flash attention in its vector build (not the AMX tiles' kernels) by vdpbf16ps (x, q and "
                        "the softmax weights rounded to bfloat16) or widened to float32 "
                        "(default auto: measured at first use where the CPU has AVX-512 BF16, cached with "
                        "LONGCTX_CPU_TUNE's choices; LONGCTX_CPU_TUNE=off keeps vdpbf16ps)",
    "LONGCTX_FLASH_AMX": "0: bfloat16 KV pages' prefill attention keeps the flash kernel's vector build where the "
                         "CPU has AMX-BF16 (default: its AMX build there)",
    "LONGCTX_DECODE_LAYERS": "0: run every step's decoder layers through the modules (default: a CPU decode or "
                             "verification step that qualifies runs them as one loop of C calls, the same bits; "
                             "longctx/model/decode_layers.py)",
    "LONGCTX_MALLOC_TUNE": "0: leave glibc's malloc thresholds as they are (default: once a CPU engine's weights are "
                           "loaded, before its first-use tuning, blocks under 256 MiB come from the heap and 512 MiB "
                           "stay at its top, mallopt)",
    "LONGCTX_HUGE_PAGES": "0: do not ask torch for transparent huge pages (default: import longctx sets "
                          "THP_MEM_ALLOC_ENABLE=1 on Linux unless it is set)",
    "LONGCTX_API_KEY": "the API key `longctx serve` requires when --api-key is not given",
    "LONGCTX_SP_TORCHRUN": "internal: set by `python -m longctx.entrypoints.torchrun` on rank 0 (the ranks' "
                           "torchrun variables, handed to the engine)",
    "CC": "the C compiler for the kernels (default: cc, then gcc)",
    # set by torchrun (sequence parallelism across processes or machines) and batch sharding
    "RANK": "this process's rank (torchrun); `longctx batch` shards its jobs by it",
    "WORLD_SIZE": "the number of ranks (torchrun); `longctx batch` shards its jobs by it",
    "LOCAL_RANK": "the rank on this machine (torchrun): picks the GPU",
    "LOCAL_WORLD_SIZE": "the ranks on this machine (torchrun): splits the CPU's threads",
    "MASTER_ADDR": "the rendezvous address (torchrun)",
    "MASTER_PORT": "the rendezvous port (torchrun)",
    # others' variables longctx reads or sets
    "TRITON_INTERPRET": "1: Triton kernels run in its interpreter (tests on the CPU)",
    "THP_MEM_ALLOC_ENABLE": "torch's: 1 puts CPU blocks of 2 MiB or more on transparent huge pages (set to 1 "
                            "at import unless given or LONGCTX_HUGE_PAGES=0; torch reads it at its first CPU "
                            "allocation)",
    "TOKENIZERS_PARALLELISM": "set to false unless given (the tokenizers library's threads "
                              "would fight the engine's)",
}


def cache_dir() -> Path:
    """The cache folder (``LONGCTX_CACHE_DIR``, else ``$XDG_CACHE_HOME/longctx``, else
    ``~/.cache/longctx``): the same for the weights and the C kernels."""
    return cpu_build.cache_root()
