"""longctx: a long-context inference engine (paged KV, chunked prefill, Llama-family models).

    from longctx import LLM, SamplingParams
"""

import os as _os
import sys as _sys


def _unshadow_top_level_kernels() -> None:
    """Take a source checkout's root off sys.path.

    The checkout's kernels/ folder installs as longctx.kernels, but a root on sys.path
    (python -m ... or python -c run from the checkout, which prepend the current folder)
    makes it importable as top-level ``kernels`` too, and that name belongs to the PyPI
    package transformers imports (transformers 5.25 needs it: hub_kernels does
    ``from kernels import CUDAProperties``). Nothing of ours imports from the root itself:
    longctx and its subpackages resolve through their installed (or editable) locations,
    so dropping the root only stops the shadowing. An installed wheel has no kernels/
    beside longctx/ and is left alone.
    """
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not (_os.path.isfile(_os.path.join(root, "kernels", "__init__.py"))
            and _os.path.isfile(_os.path.join(root, "pyproject.toml"))):
        return

    def is_root(entry: str) -> bool:
        try:
            return _os.path.samefile(entry or _os.curdir, root)
        except (OSError, TypeError, ValueError):
            return False

    _sys.path[:] = [entry for entry in _sys.path if not is_root(entry)]
    ours = _os.path.join(root, "kernels")
    early = _sys.modules.get("kernels")
    if early is not None and _os.path.dirname(getattr(early, "__file__", None) or "") == ours:
        del _sys.modules["kernels"]  # imported as top-level before us: let the real one load


_unshadow_top_level_kernels()
_huge_pages_set_here = False  # whether the import below set THP_MEM_ALLOC_ENABLE


def _huge_pages_for_large_tensors() -> None:
    """Have torch's CPU allocator advise the kernel to back each block of 2 MiB or more with
    transparent huge pages (its ``THP_MEM_ALLOC_ENABLE``: madvise MADV_HUGEPAGE), on Linux,
    unless the user set that variable or ``LONGCTX_HUGE_PAGES=0``. torch reads the variable
    once, at its first CPU allocation, so it is set at import, before the engine allocates
    anything (a process that made CPU tensors before importing longctx keeps 4 KiB pages). Why:
    a decode step streams every weight once, and on 4 KiB pages each 4 KiB of that stream needs
    a TLB entry. Measured on an Intel Xeon (family 6 model 167, 2 threads): the int8 block
    product of a [8192, 2048] matrix with one row of x 19.6-20.1 -> 21.6-22.9 GB/s, and the 1B
    int8 model's decode at 4K 66.7-69.9 -> 62.1-64.9 ms a token (docs/kernels.md). Weights read
    from a memory-mapped file (GGUF blocks, the weight caches) are page cache and keep its
    pages."""
    global _huge_pages_set_here
    if (_sys.platform.startswith("linux") and _os.environ.get("LONGCTX_HUGE_PAGES", "1") != "0"
            and "THP_MEM_ALLOC_ENABLE" not in _os.environ):
        _os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        _huge_pages_set_here = True  # (the benchmarks start their peers without it)


_huge_pages_for_large_tensors()

from longctx.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: it pulls in torch and transformers
        from longctx.entrypoints.api import LLM

        return LLM
    raise AttributeError(f"module 'longctx' has no attribute {name!r}")
