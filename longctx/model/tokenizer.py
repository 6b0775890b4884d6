"""Tokenizers through transformers (``AutoTokenizer``), for HF folders and GGUF files.

Owns: loading the tokenizer that belongs to a model, chat templates, and caching the
converted GGUF tokenizer (building it from GGUF metadata takes seconds; the saved copy loads
in well under one).
Never: a hand-written tokenizer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .loader import cache_dir_for

log = logging.getLogger(__name__)


def load_tokenizer(path: Path, use_cache: bool = True):
    """The ``PreTrainedTokenizerFast`` for a resolved model path (folder or ``.gguf``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    saved = cache_dir_for(path) / "tokenizer"
    if use_cache and (saved / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception as err:  # noqa: BLE001 - a broken copy is rebuilt from the GGUF
            log.warning("cached tokenizer in %s is unreadable (%s); rebuilding it", saved, err)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if use_cache:
        try:
            tokenizer.save_pretrained(str(saved))
        except OSError as err:
            log.warning("could not cache the tokenizer in %s: %s", saved, err)
    return tokenizer
