"""Prompt tokenizing for the server: off the event loop, on a small pool, and bounded by the
context window before the whole prompt is read.

Owns: the pool's threads (each with its own copy of the tokenizer: a tokenizer is not safe to
share across threads), and the length probe.
Never: HTTP, the engine, or what a request may ask for beyond its length.

The length probe. A prompt of a few megabytes takes seconds to tokenize, and most of it would be
thrown away: the window holds a few thousand tokens. So a prompt longer than ``4 x window`` bytes
is probed first: its leading ``P`` bytes are tokenized, with ``P`` doubling from ``4 x window``,
until the probe holds more than ``window + PROBE_MARGIN`` tokens (the prompt is refused: a
prefix of text never has more tokens than the whole, up to the one piece the cut may split; the
margin covers that piece) or the prompt is read to its end. The work is then bounded by the
window, not by the body: for an 8 MB prompt and an 8K window, tens of kilobytes are tokenized.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

POOL_THREADS = 2  # one long prompt being tokenized leaves a thread for the others
PROBE_MARGIN = 64  # tokens a cut through the probe's last piece may add to the prefix's count
PROBE_BYTES_PER_TOKEN = 4  # the first probe's bytes per window token (most text: 3-5 per token)


class PromptTooLong(ValueError):
    """A prompt whose leading ``probe_bytes`` bytes alone are ``probe_tokens`` tokens, more than
    the window: the whole prompt is longer still."""

    def __init__(self, probe_bytes: int, probe_tokens: int, total_bytes: int, window: int) -> None:
        self.probe_bytes, self.probe_tokens = probe_bytes, probe_tokens
        super().__init__(f"the prompt is longer than the model's context window of {window} tokens: its "
                         f"first {probe_bytes} bytes (of {total_bytes}) alone are {probe_tokens} tokens")


class PromptTokenizer:
    """``await encode(text)`` / ``await chat(messages)`` on ``threads`` worker threads."""

    def __init__(self, tokenizer: Any, window: int, threads: int = POOL_THREADS) -> None:
        self._source, self.window = tokenizer, window
        self._local = threading.local()
        self._copy_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="longctx-tokenize")
        self.num_probed = 0  # prompts that took the length probe (tests read it)

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:  # deepcopy reads the source; one thread at a time
                tok = self._local.tokenizer = copy.deepcopy(self._source)
        return tok

    async def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(tokenizer)`` on a pool thread, with that thread's own tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(self._tokenizer()))

    async def encode(self, text: str) -> list[int]:
        """The prompt's ids (no special tokens added); ``PromptTooLong`` past the window."""
        return await self.run(lambda tok: self._encode(tok, text))

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template's ids for ``messages``. The probe runs on the messages' contents
        joined (the template holds each of them), with one more token of margin per message."""
        def work(tok: Any) -> list[int]:
            joined = "\n".join(str(m.get("content") or "") for m in messages)
            self._probe(tok, joined, margin=PROBE_MARGIN + len(messages))
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        return await self.run(work)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ pool threads

    def _encode(self, tok: Any, text: str) -> list[int]:
        self._probe(tok, text, margin=PROBE_MARGIN)
        return list(tok.encode(text, add_special_tokens=False))

    def _probe(self, tok: Any, text: str, margin: int) -> None:
        """Raise ``PromptTooLong`` when a prefix of ``text`` already exceeds the window."""
        data = text.encode("utf-8", "surrogatepass")
        size = PROBE_BYTES_PER_TOKEN * self.window
        if len(data) <= size:
            return
        self.num_probed += 1
        while size < len(data):
            head = data[:size].decode("utf-8", "ignore")  # a cut inside a character drops it
            count = len(tok.encode(head, add_special_tokens=False))
            if count > self.window + margin:
                raise PromptTooLong(size, count, len(data), self.window)
            size *= 2
