"""Engine configuration: one frozen dataclass per concern, validated on construction.

Owns: the knobs users set (through ``LLM(...)`` keyword arguments or CLI flags, which are
derived from these fields) and their checks.
Never: behaviour. Components read these; nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
CPU_MATMULS = ("auto", "kernel", "onednn", "blas")
GGUF_WEIGHTS = ("auto", "blocks", "float")
# block_numerics -> x's int8 terms in the block kernel's decode products (0: float32, exact)
BLOCK_TERMS = {"exact": 0, "fast": 1, "fast2": 2}
QUANTIZATIONS = ("none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")  # longctx.kv.formats' names
DEFAULT_HOST_CACHE_GB = 2.0
DEFAULT_KV_CACHE_GB = 1.0  # the KV pool of each sequence-parallel rank (one process: "auto")
CPU_KV_SHARE = 0.5  # "auto" on the CPU: this share of the memory available after the weights
DEFAULT_BLOCK_SIZE = 64
FLASH_ATTN_BLOCK_SIZE = 256  # flash-attn's paged KV needs pages of a multiple of 256 tokens


class ConfigError(ValueError):
    """A configuration value a user gave is invalid; the message says which and why."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


ROPE_SCALING_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings",
                     "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor", "mscale", "mscale_all_dim", "truncate")


def parse_rope_scaling(value: Any) -> dict | None:
    """A ``rope_scaling`` override (a dict, or its JSON text from a flag) checked and
    normalized: ``rope_type`` (HF's older ``type`` accepted) in ``ROPE_TYPES``, a positive
    ``factor``, numbers where numbers go and no unknown keys. None or "" is no override."""
    from longctx.model.config import ROPE_TYPES, RopeScaling  # plain dataclasses, no torch

    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"rope_scaling must be a JSON object, e.g. "
                              f'{{"rope_type": "yarn", "factor": 4.0}}; got {value!r} ({err})') from None
    _check(isinstance(value, dict), f"rope_scaling must be a dict (JSON object), got {value!r}")
    unknown = sorted(set(value) - set(ROPE_SCALING_KEYS))
    _check(not unknown, f"rope_scaling has unknown field(s) {', '.join(map(repr, unknown))}; "
                        f"known: {', '.join(ROPE_SCALING_KEYS)}")
    out = dict(value)
    if "type" in out:
        _check("rope_type" not in out or out["rope_type"] == out["type"],
               "rope_scaling gives rope_type and type differently")
        out["rope_type"] = out.pop("type")
    _check("rope_type" in out, f"rope_scaling needs rope_type (one of {', '.join(ROPE_TYPES[1:])})")
    _check(out["rope_type"] in ROPE_TYPES[1:],
           f"rope_scaling rope_type must be one of {', '.join(ROPE_TYPES[1:])}, got {out['rope_type']!r}")
    for key in ROPE_SCALING_KEYS[2:-1]:
        if key in out and out[key] is not None:
            v = out[key]
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                   f"rope_scaling {key} must be a number, got {v!r}")
    _check("factor" in out, "rope_scaling needs factor (how many times the window grows)")
    _check(out["factor"] > 0, f"rope_scaling factor must be positive, got {out['factor']!r}")
    orig = out.get("original_max_position_embeddings")
    _check(orig is None or (float(orig).is_integer() and orig > 0),
           f"rope_scaling original_max_position_embeddings must be a positive integer, got {orig!r}")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    _check(not isinstance(out.get("truncate", True), str) and isinstance(out.get("truncate", True), bool),
           f"rope_scaling truncate must be true or false, got {out.get('truncate')!r}")
    try:
        RopeScaling(**{k: v for k, v in out.items() if v is not None})
    except ValueError as err:
        raise ConfigError(f"rope_scaling: {err}") from None
    return out


@dataclass(frozen=True)
class ModelLoadConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "alias, HF folder or .gguf file"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16 "
                                                         "(auto: bfloat16 on CUDA, float32 on the CPU)"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:N"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads (0: leave as is)"})
    attention_backend: str = field(
        default="auto", metadata={"help": "auto | torch | triton | flash-attn (auto: by device)"})
    cpu_matmul: str = field(
        default="auto", metadata={"help": "auto | kernel | onednn | blas: the CPU weight products "
                                          "(auto: for float32 and bfloat16 the C row kernel where "
                                          "it builds, else oneDNN pre-packed (float32), else BLAS; "
                                          "BLAS for float16)"})
    gguf_weights: str = field(
        default="auto", metadata={"help": "auto | blocks | float: how a .gguf model's matrices are held on "
                                          "the CPU. blocks: as the file stores them (Q8_0, Q4_0/1, Q5_0/1, "
                                          "Q4_K, Q5_K, Q6_K, F16, BF16), memory-mapped and multiplied by the "
                                          "block kernel (dtype float32 or bfloat16: bfloat16 also runs prefill "
                                          "chunks on bfloat16 slices, on AMX tiles or vdpbf16ps where the CPU "
                                          "has them); float: expanded to dtype at load (cached). auto: blocks "
                                          "where the block kernel runs and dtype is float32, or bfloat16 with "
                                          "quantized matrices (fewer bytes as stored than as bfloat16), else "
                                          "float"})
    block_numerics: str = field(
        default="exact", metadata={"help": "exact | fast | fast2: with GGUF blocks, exact multiplies float32 "
                                           "activations by the exactly dequantized weights (HF's numbers); "
                                           "fast rounds a decode step's activations to int8 in blocks of 32 "
                                           "and multiplies in integers, as llama.cpp does (faster, tokens "
                                           "part from exact's sooner); fast2 takes them as two int8 terms "
                                           "(the rounding's remainder rounded again: ~250x closer to exact, "
                                           "twice the integer work on the same weight bytes)"})
    quantization: str = field(
        default="none", metadata={"help": "none | int8 | int4: quantize an HF folder's matrices at load "
                                          "into the block kernel's layouts on the CPU (float32 activations; "
                                          "dtype bfloat16 as with gguf_weights blocks): "
                                          "int8 is Q8_0 (a scale per 32 inputs of each row), int4 is Q4_1 "
                                          "(scale and minimum per quantization_group_size inputs); the "
                                          "embedding and LM head take int8 under int4"})
    quantization_group_size: int = field(
        default=32, metadata={"help": "int4's group: 32 or 128 inputs per scale and minimum (128 is "
                                      "stored in 32-input blocks: its rounding, not a smaller size)"})
    weight_cache_gb: float = field(
        default=16.0, metadata={"help": "disk bound (GiB) of the weights that .gguf models expanded to float "
                                        "(gguf_weights float, bfloat16, GPU) leave in the cache folder for "
                                        "their next load, all models together: the least recently used go "
                                        "to make room, a model larger than the bound is not cached; 0: none"})
    enforce_eager: bool = field(
        default=False, metadata={"help": "on CUDA, run decode and lookahead-verify steps eagerly "
                                         "instead of replaying CUDA graphs captured at start-up"})
    rope_scaling: dict | None = field(
        default=None, metadata={"help": "override the model's RoPE scaling, as HF's rope_scaling "
                                        "(a dict, or JSON on the command line), e.g. "
                                        "'{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                        "\"original_max_position_embeddings\": 8192}' "
                                        "(rope_type: linear | dynamic | llama3 | yarn)"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_scaling", parse_rope_scaling(self.rope_scaling))
        _check(self.cpu_matmul in CPU_MATMULS,
               f"cpu_matmul must be one of {', '.join(CPU_MATMULS)}, got {self.cpu_matmul!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
               f"got {self.attention_backend!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(isinstance(self.weight_cache_gb, (int, float)) and not isinstance(self.weight_cache_gb, bool)
               and math.isfinite(self.weight_cache_gb) and self.weight_cache_gb >= 0,
               f"weight_cache_gb must be a finite number >= 0, got {self.weight_cache_gb!r}")
        _check(self.cpu_matmul != "onednn" or self.dtype in ("float32", "auto"),
               f"cpu_matmul='onednn' is for float32 models, got dtype={self.dtype!r} "
               "(use cpu_matmul='auto' or 'blas')")
        _check(self.cpu_matmul != "kernel" or self.dtype in ("float32", "bfloat16", "auto"),
               f"cpu_matmul='kernel' is for float32 and bfloat16 models, got dtype={self.dtype!r} "
               "(use cpu_matmul='auto' or 'blas')")
        _check(self.num_threads >= 0, f"num_threads must be >= 0, got {self.num_threads}")
        _check(self.block_numerics in BLOCK_TERMS,
               f"block_numerics must be one of {', '.join(BLOCK_TERMS)}, got {self.block_numerics!r}")
        _check(self.gguf_weights in GGUF_WEIGHTS,
               f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        _check(self.gguf_weights != "blocks" or self.dtype in ("float32", "bfloat16", "auto"),
               f"gguf_weights='blocks' computes in float32 or bfloat16, got dtype={self.dtype!r} "
               "(use gguf_weights='float')")
        _check(self.quantization in QUANTIZATIONS,
               f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _check(self.quantization_group_size in (32, 128),
               f"quantization_group_size must be 32 or 128, got {self.quantization_group_size!r}")
        _check(self.quantization_group_size == 32 or self.quantization == "int4",
               f"quantization_group_size is int4's (got {self.quantization_group_size} with "
               f"quantization={self.quantization!r}; int8 keeps a scale per 32 inputs)")
        if self.quantization != "none":
            _check(self.device == "cpu", f"quantization={self.quantization!r} is for the CPU's block kernel, "
                                         f"got device={self.device!r}")
            _check(self.dtype in ("float32", "bfloat16", "auto"),
                   f"quantization={self.quantization!r} computes in float32 or bfloat16, got dtype={self.dtype!r}")
            _check(self.cpu_matmul == "auto", f"quantization={self.quantization!r} multiplies with the block "
                                              f"kernel, got cpu_matmul={self.cpu_matmul!r}")
            _check(self.gguf_weights == "auto", f"quantization={self.quantization!r} is for HF folders, "
                                                f"got gguf_weights={self.gguf_weights!r}")
        _check(self.gguf_weights != "blocks" or self.device == "cpu",
               f"gguf_weights='blocks' is for the CPU, got device={self.device!r} (use gguf_weights='float')")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = field(
        default=None, metadata={"help": "tokens per KV page (default: 64; 256 when flash-attn runs)"})
    kv_cache_gb: float | None = field(
        default=None, metadata={"help": "memory budget for the KV pool (GiB; default \"auto\": on the CPU "
                                        "half the memory available after the weights, at most what "
                                        "max_num_seqs requests of max_model_len tokens need; on a GPU "
                                        "gpu_memory_utilization of its memory less the model's; 1 per "
                                        "sequence-parallel rank)"})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "share of the GPU's memory the engine may use (weights, "
                                       "activations and the KV pool) when kv_cache_gb is not given"})
    num_blocks: int = field(default=0, metadata={"help": "exact KV pool size in pages (overrides kv_cache_gb)"})
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV pages of earlier requests' common prefixes"})
    host_cache_gb: float | None = field(
        default=None, metadata={"help": "host (CPU) tier for pages evicted from the device (GiB; 0: none; "
                                        "default: 2 beside a GPU, none when the device is the CPU)"})
    disk_cache_dir: str = field(
        default="", metadata={"help": "folder for the disk tier; pages persist across restarts ('': none)"})
    disk_cache_gb: float = field(
        default=20.0, metadata={"help": "disk tier budget (GiB), held across every process sharing the folder "
                                        "(least recently used pages go first)"})
    disk_cache_key_file: str = field(
        default="", metadata={"help": "file of at least 32 secret bytes (mode 0600, outside disk_cache_dir) whose "
                                      "HMAC authenticates each disk page ('': a per-user key in "
                                      "$XDG_CONFIG_HOME/longctx/ or ~/.config/longctx/, made on first use)"})
    disk_timeout_s: float = field(
        default=10.0, metadata={"help": "seconds a disk tier read or write may take: a read past it is a miss "
                                        "(its file is not read again), and while one is stuck the tier is "
                                        "skipped (reported as stalled on /health)"})
    kv_cache_dtype: str = field(
        default="auto", metadata={"help": "what KV pages store: auto (the model's dtype), bfloat16 (K and V "
                                          "rounded to bfloat16: half the bytes of a float32 model's pages; "
                                          "CPU) or int8 (symmetric int8 with an fp32 scale per page, layer, "
                                          "KV head and K/V: about 0.26x the bytes of float32 pages, on every "
                                          "tier)"})
    kv_quant_rotation: bool = field(
        default=True, metadata={"help": "quantized KV pages hold rows turned by an orthogonal rotation "
                                        "(queries alike, outputs back): about half the rounding error "
                                        "for the same bytes; pages of one setting never serve the other"})
    kv_quant_exact_tail: bool = field(
        default=True, metadata={"help": "with quantized KV pages, each query reads its sequence's first "
                                        "page and its own page at the model's precision (three pages "
                                        "per running request outside the budget); off: every key as stored"})

    window_kv: str = field(
        default="auto", metadata={"help": "sliding-window layers' KV: 'free' keeps only each running "
                                          "sequence's window (a ring of pages; no prefix caching), 'keep' "
                                          "the whole context like every other layer, 'auto' frees unless "
                                          "prefix caching is on"})

    def frees_window_kv(self) -> bool:
        """Whether windowed layers keep only their window (``window_kv``; 'auto': unless the
        prefix store needs their pages)."""
        return self.window_kv == "free" or (self.window_kv == "auto" and not self.enable_prefix_caching)

    def host_tier_gb(self, device_type: str) -> float:
        """The host tier's budget: as given, else 2 GiB beside a GPU and none when the KV pool
        is itself in CPU memory (a second copy in the same RAM buys nothing; an explicit size
        still builds one, which the tests use to run the tier's logic on the CPU)."""
        if self.host_cache_gb is not None:
            return float(self.host_cache_gb)
        return 0.0 if device_type == "cpu" else DEFAULT_HOST_CACHE_GB

    def __post_init__(self) -> None:
        _check(self.block_size is None or (isinstance(self.block_size, int) and 1 <= self.block_size <= 1024
                                           and self.block_size & (self.block_size - 1) == 0),
               f"block_size must be a power of two in [1, 1024], got {self.block_size}")
        if self.kv_cache_gb == "auto":
            object.__setattr__(self, "kv_cache_gb", None)
        _check(self.kv_cache_gb is None or (isinstance(self.kv_cache_gb, (int, float)) and self.kv_cache_gb > 0),
               f"kv_cache_gb must be positive or \"auto\", got {self.kv_cache_gb!r}")
        _check(0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.num_blocks >= 0, f"num_blocks must be >= 0, got {self.num_blocks}")
        _check(self.host_cache_gb is None or (isinstance(self.host_cache_gb, (int, float))
                                              and self.host_cache_gb >= 0),
               f"host_cache_gb must be >= 0, got {self.host_cache_gb}")
        _check(self.disk_cache_gb > 0, f"disk_cache_gb must be positive, got {self.disk_cache_gb}")
        _check(isinstance(self.disk_timeout_s, (int, float)) and not isinstance(self.disk_timeout_s, bool)
               and 0 < self.disk_timeout_s < math.inf,
               f"disk_timeout_s must be a positive number of seconds, got {self.disk_timeout_s!r}")
        _check(isinstance(self.disk_cache_key_file, str),
               f"disk_cache_key_file must be a path (a string), got {self.disk_cache_key_file!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {self.kv_cache_dtype!r}")
        _check(isinstance(self.kv_quant_rotation, bool) and isinstance(self.kv_quant_exact_tail, bool),
               "kv_quant_rotation and kv_quant_exact_tail must be True or False")
        _check(isinstance(self.enable_prefix_caching, bool),
               f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        _check(not self.disk_cache_dir or self.enable_prefix_caching,
               "disk_cache_dir needs enable_prefix_caching")
        _check(self.window_kv in ("auto", "free", "keep"),
               f"window_kv must be 'auto', 'free' or 'keep', got {self.window_kv!r}")
        _check(not (self.window_kv == "free" and self.enable_prefix_caching),
               "window_kv='free' drops the windowed layers' pages a prefix hit needs: use "
               "enable_prefix_caching=False with it, or window_kv='keep'")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "token budget per step (the prefill chunk size; default \"auto\": "
                                        "2048 on a GPU; on the CPU the most, down to 256, whose MLP "
                                        "activations stay within 80 MiB: 4096 for SmolLM2-135M, 512 "
                                        "for a 1B Llama)"})
    busy_prefill_chunk: int = field(
        default=256, metadata={"help": "prefill chunk of a long prompt in a step that also gives "
                                       "other requests tokens (0: no cap)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most requests running at once"})
    max_model_len: int = field(default=0, metadata={"help": "context limit (0: the model's window, as "
                                                            "its rope_scaling stretches it)"})
    allow_long_context: bool = field(
        default=False, metadata={"help": "accept a max_model_len past the model's trained window "
                                         "(positions past it were never trained: outputs there degrade)"})
    prefill_step_cost: int = field(
        default=0, metadata={"help": "latency mode for serving: a step's work, counted in tokens "
                                     "at zero context (attention to a long context counts extra), "
                                     "stays under this, and a step that gives a new request its "
                                     "first token runs no other prefill chunk (0: off)"})

    max_stop_strings: int = field(
        default=64, metadata={"help": "most stop strings one request may give (each costs its length "
                                      "once at the request's start, not per token)"})
    max_stop_length: int = field(
        default=1024, metadata={"help": "most characters in one stop string"})

    def __post_init__(self) -> None:
        _check(self.max_stop_strings >= 0 and self.max_stop_length >= 1,
               f"max_stop_strings must be >= 0 and max_stop_length >= 1, got {self.max_stop_strings} "
               f"and {self.max_stop_length}")
        if self.max_num_batched_tokens == "auto":
            object.__setattr__(self, "max_num_batched_tokens", None)
        _check(self.max_num_batched_tokens is None or (isinstance(self.max_num_batched_tokens, int)
                                                       and self.max_num_batched_tokens >= 1),
               f"max_num_batched_tokens must be >= 1 or \"auto\", got {self.max_num_batched_tokens!r}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.busy_prefill_chunk >= 0, f"busy_prefill_chunk must be >= 0, got {self.busy_prefill_chunk}")
        _check(self.max_model_len >= 0, f"max_model_len must be >= 0, got {self.max_model_len}")
        _check(self.prefill_step_cost >= 0, f"prefill_step_cost must be >= 0, got {self.prefill_step_cost}")


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding (docs/lookahead.md). ``LLM(lookahead=...)`` takes True, False or one
    of these."""

    lookahead: bool = field(default=True, metadata={"help": "draft from the text seen so far and "
                                                             "verify drafts in the decode pass"})
    lookahead_max_tokens: int = field(default=8, metadata={"help": "draft tokens per step at most"})
    lookahead_max_branches: int = field(default=4, metadata={"help": "branches per draft tree"})

    def __post_init__(self) -> None:
        _check(isinstance(self.lookahead, bool), f"lookahead must be True or False, got {self.lookahead!r}")
        _check(1 <= self.lookahead_max_tokens <= 62,
               f"lookahead_max_tokens must be in [1, 62], got {self.lookahead_max_tokens}")
        _check(self.lookahead_max_branches >= 1,
               f"lookahead_max_branches must be >= 1, got {self.lookahead_max_branches}")


@dataclass(frozen=True)
class ParallelConfig:
    """Sequence parallelism (docs/parallel.md): the engine's ranks, started once with it."""

    sequence_parallel_size: int = field(
        default=1, metadata={"help": "ranks (processes) that share every step: KV pages spread "
                                     "over them, attention merged across them (1: off)"})
    sp_timeout_s: float = field(
        default=120.0, metadata={"help": "seconds a rank may take to answer within a step before "
                                         "the requests in flight fail"})
    sp_start_timeout_s: float = field(
        default=600.0, metadata={"help": "seconds the ranks may take to start (spawn, load the model, "
                                         "join) before start-up fails: apart from sp_timeout_s, so a "
                                         "slow start on a loaded machine is not a failure"})

    def __post_init__(self) -> None:
        _check(isinstance(self.sequence_parallel_size, int) and not isinstance(self.sequence_parallel_size, bool)
               and self.sequence_parallel_size >= 1,
               f"sequence_parallel_size must be an integer >= 1, got {self.sequence_parallel_size!r}")
        _check(self.sp_timeout_s > 0, f"sp_timeout_s must be positive, got {self.sp_timeout_s}")
        _check(self.sp_start_timeout_s > 0, f"sp_start_timeout_s must be positive, got {self.sp_start_timeout_s}")


CONFIG_CLASSES = (ModelLoadConfig, CacheConfig, SchedulerConfig, LookaheadConfig, ParallelConfig)
def _gib_or_auto(value: str) -> float | str:
    return "auto" if value == "auto" else float(value)


_gib_or_auto.__name__ = "GiB (a number, or auto)"  # argparse names the type so in its error
def _tokens_or_auto(value: str) -> int | str:
    return "auto" if value == "auto" else int(value)


_tokens_or_auto.__name__ = "tokens (a number, or auto)"
FLAG_TYPES = {"block_size": int, "rope_scaling": str, "kv_cache_gb": _gib_or_auto,
              "max_num_batched_tokens": _tokens_or_auto}  # fields whose default None means "auto" and whose value is not a float


def resolve_auto(load: ModelLoadConfig, cache: CacheConfig, device_type: str,
                 flash_attn: bool) -> tuple[ModelLoadConfig, CacheConfig]:
    """The "auto" choices made concrete for a device: the dtype (bfloat16 on CUDA, float32 on
    the CPU) and the page size (256 when flash-attn will run: on CUDA, installed, a 16-bit
    dtype and a backend that allows it; else 64). ``kv_cache_gb`` stays None ("auto": the
    engine sizes the pool from the memory the model leaves)."""
    from dataclasses import replace

    dtype = load.dtype if load.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "float32")
    uses_flash = (flash_attn and device_type == "cuda" and dtype != "float32"
                  and load.attention_backend in ("auto", "flash-attn"))
    block = cache.block_size or (FLASH_ATTN_BLOCK_SIZE if uses_flash else DEFAULT_BLOCK_SIZE)
    return replace(load, dtype=dtype), replace(cache, block_size=block)


GPU_BATCHED_TOKENS = 2048
CPU_ACTIVATION_BYTES = 80 << 20  # a CPU prefill chunk's MLP activations (gate, up, their product) at most
CPU_BATCHED_TOKENS = (256, 4096)  # the auto chunk's range on the CPU


def batched_tokens_for(sched: SchedulerConfig, intermediate_size: int, device_type: str) -> SchedulerConfig:
    """``max_num_batched_tokens="auto"`` made concrete: 2048 on a GPU; on the CPU the largest
    power of two in ``CPU_BATCHED_TOKENS`` whose MLP activations (three float32 rows of
    ``intermediate_size`` a token) fit ``CPU_ACTIVATION_BYTES``. A chunk past that only adds to
    the peak RSS and falls out of the caches: a 1B-shaped Q4_K_M model's 4K prefill peaked at
    1.65 GiB with chunks of 2048 and 1.35 GiB with 512, and ran 7-10% faster (Intel Xeon, 2
    cores). SmolLM2-135M takes 4096 (72 MiB): its bf16 8K prefill took 4.70-5.01 s against
    5.07-5.27 s with 2048 (Intel Xeon model 167, 2 threads, alternating, two runs each; 512 was
    ~15% slower than 2048), as vLLM-CPU's own default of 4096 tokens a step; the budget keeps a
    1B Llama at 512 (1024 would be 96 MiB)."""
    from dataclasses import replace

    if sched.max_num_batched_tokens is not None:
        return sched
    if device_type == "cuda":
        return replace(sched, max_num_batched_tokens=GPU_BATCHED_TOKENS)
    low, high = CPU_BATCHED_TOKENS
    chunk = high
    while chunk > low and chunk * intermediate_size * 3 * 4 > CPU_ACTIVATION_BYTES:
        chunk //= 2
    return replace(sched, max_num_batched_tokens=chunk)


def split_engine_kwargs(kwargs: dict[str, Any]) -> tuple[ModelLoadConfig, CacheConfig, SchedulerConfig,
                                                          LookaheadConfig, ParallelConfig]:
    """Route ``LLM(**kwargs)`` keywords to the dataclass that owns each; unknown keys are an
    error. ``lookahead`` may also be a whole ``LookaheadConfig``."""
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("lookahead"), LookaheadConfig):
        given = kwargs.pop("lookahead")
        clash = sorted(k for k in kwargs if k.startswith("lookahead_"))
        if clash:
            raise ConfigError(f"give lookahead options in the LookaheadConfig or as keywords, "
                              f"not both ({', '.join(clash)})")
        kwargs.update({f.name: getattr(given, f.name) for f in fields(LookaheadConfig)})
    known = {f.name: cls for cls in CONFIG_CLASSES for f in fields(cls)}
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    parts: dict[type, dict[str, Any]] = {cls: {} for cls in CONFIG_CLASSES}
    for key, value in kwargs.items():
        parts[known[key]][key] = value
    return tuple(cls(**parts[cls]) for cls in CONFIG_CLASSES)  # type: ignore[return-value]
