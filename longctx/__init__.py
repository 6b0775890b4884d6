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

from longctx.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: it pulls in torch and transformers
        from longctx.entrypoints.api import LLM

        return LLM
    raise AttributeError(f"module 'longctx' has no attribute {name!r}")
