"""longctx: a long-context inference engine (paged KV, chunked prefill, Llama-family models).

    from longctx import LLM, SamplingParams
"""

from longctx.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: it pulls in torch and transformers
        from longctx.entrypoints.api import LLM

        return LLM
    raise AttributeError(f"module 'longctx' has no attribute {name!r}")
