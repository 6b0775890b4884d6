"""Incremental detokenization: a request's output text, one token at a time.

Owns: text equal to ``tokenizer.decode(ids, skip_special_tokens=...)`` after every token, at a
cost per token that does not grow with the output. As in vLLM (prefix/read offsets), only a
window is decoded: the new tokens, after a few context tokens whose text is already known.
While the text ends in U+FFFD (a multi-byte character split across tokens) the tokens stay in
the window, so a later token can complete the character.
Never: stop strings, or what is handed out when (the engine does that).

The window is only used for tokenizers whose decoding is provably local: a ``tokenizers``
backend (directly or through transformers' stock ``decode``, with no tokenization-space
cleanup) whose decoder is made of ByteLevel, Fuse, Replace, Metaspace, ByteFallback and
Strip (no stripping at the end), or has no decoder. Any other tokenizer gets ``Detokenizer``:
a full decode per token, as before. Should the window ever disagree with what it was built on
(its text no longer starts with the context's text), the request decodes in full until its
text is clean again.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

# Decoders whose output, for tokens after a context, is the text of those tokens in the whole
# sequence (given the context rules in ``IncrementalDetokenizer._advance``).
_LOCAL = frozenset({"ByteLevel", "Fuse", "Replace", "Metaspace", "ByteFallback", "Strip"})
# Decoders that treat the first token (or the start of the text) specially: a window needs at
# least one context token with text. The others (ByteLevel, Fuse, Replace) need none.
_NEEDS_CONTEXT = frozenset({"Metaspace", "ByteFallback", "Strip"})

_NORMAL, _DROPPED, _BYTE = 0, 1, 2
_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Full decode per token: the fallback, for tokenizers the window cannot be proved for."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # == tokenizer.decode(token_ids, skip_special_tokens=...)

    def add(self, token_id: int) -> str:
        """Append one token; the text of all tokens so far (it may end in U+FFFD)."""
        self.token_ids.append(token_id)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.text


@dataclass
class _Plan:
    """What the window needs to know about one tokenizer (shared by its requests)."""

    backend: Any  # tokenizers.Tokenizer
    skip_special_tokens: bool
    special: frozenset[str]  # contents of the special added tokens
    needs_context: bool
    byte_fallback: bool
    kinds: dict[int, int] = field(default_factory=dict)  # token id -> _NORMAL/_DROPPED/_BYTE

    def kind(self, token_id: int) -> int:
        k = self.kinds.get(token_id)
        if k is None:
            token = self.backend.id_to_token(token_id)
            if token is None or (self.skip_special_tokens and token in self.special):
                k = _DROPPED  # decode leaves it out
            elif self.byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                k = _BYTE  # (a false positive only widens the window)
            else:
                k = _NORMAL
            self.kinds[token_id] = k
        return k


class IncrementalDetokenizer(Detokenizer):
    """Decodes a window of the last tokens instead of all of them (see the module docstring)."""

    def __init__(self, tokenizer: Any, plan: _Plan):
        super().__init__(tokenizer, plan.skip_special_tokens)
        self._plan = plan
        self._ids: list[int] = []  # the tokens decode keeps (skipped and unknown ids dropped)
        self._start = 0  # the window is _ids[_start:]; _ids[_start:_read] is its context
        self._read = 0  # _ids[:_read] decode to _stable, which ends in a complete character
        self._prefix = ""  # decode(_ids[_start:_read])
        self._stable = ""
        self._synced = True  # False: decoding all of _ids until the text is clean again

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        plan = self._plan
        kind = plan.kind(token_id)
        if kind == _DROPPED:
            return self.text
        ids = self._ids
        ids.append(token_id)
        if self._synced:
            window = plan.backend.decode(ids[self._start:], skip_special_tokens=False)
            if window.startswith(self._prefix):
                delta = window[len(self._prefix):]
                if kind == _BYTE or delta.endswith(_REPLACEMENT):
                    # maybe a character split across tokens, or a run of byte-fallback tokens
                    # (decoded as a whole: all U+FFFD unless all valid) that may go on: keep
                    # the tokens in the window
                    self.text = self._stable + delta
                    return self.text
                if delta:
                    self._stable += delta
                self.text = self._stable
                self._advance()
                return self.text
            self._synced = False
        self.text = plan.backend.decode(ids, skip_special_tokens=False)
        if kind != _BYTE and not self.text.endswith(_REPLACEMENT):
            self._stable, self._synced = self.text, True
            self._advance()
        return self.text

    def _advance(self) -> None:
        """All of ``_ids`` is stable: the next window starts after it, with as little context as
        the decoder needs: none, or the last tokens from one that is not a byte-fallback token
        and whose text is not empty (Metaspace and Strip treat the start of the text apart,
        ByteFallback joins runs of byte tokens)."""
        plan, ids = self._plan, self._ids
        end = self._read = len(ids)
        if not plan.needs_context:
            self._start, self._prefix = end, ""
            return
        start = end - 1
        while start > 0:
            if not plan.byte_fallback or plan.kind(ids[start]) != _BYTE:
                prefix = plan.backend.decode(ids[start:end], skip_special_tokens=False)
                if prefix:
                    self._start, self._prefix = start, prefix
                    return
            start -= 1
        self._start, self._prefix = 0, self._stable  # back to the first token: all of it


def _decoder_types(state: dict | None) -> list[str]:
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [t for d in state.get("decoders", []) for t in _decoder_types(d)]
    if state.get("type") == "Strip" and state.get("stop", 0):
        return ["Strip(stop)"]  # stripping the end of the text: not local
    return [str(state.get("type"))]


def _backend_of(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` is exactly ``tokenizer.decode``, or None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    try:  # transformers 5
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Base
    except ImportError:  # transformers 4
        from transformers import PreTrainedTokenizerFast as Base
    cls = type(tokenizer)
    if not isinstance(tokenizer, Base) or cls.decode is not Base.decode or cls._decode is not Base._decode:
        return None  # a subclass with its own decoding
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers 5 skips the cleanup for BPE models unless forced; otherwise it rewrites
        # " ." to "." and the like across token boundaries: not local
        flag = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        if not (hasattr(tokenizer, flag) and not getattr(tokenizer, flag)
                and type(backend.model).__name__ == "BPE"):
            return None
    return backend


def _make_plan(tokenizer: Any, skip_special_tokens: bool) -> _Plan | None:
    try:
        backend = _backend_of(tokenizer)
    except ImportError:
        return None
    if backend is None:
        return None
    decoder = backend.decoder
    types = _decoder_types(None if decoder is None else json.loads(decoder.__getstate__()))
    if not set(types) <= _LOCAL:
        return None
    special = frozenset(t.content for t in backend.get_added_tokens_decoder().values() if t.special)
    # no decoder: tokens are joined with spaces, which a context token puts in the window
    needs_context = decoder is None or bool(set(types) & _NEEDS_CONTEXT)
    return _Plan(backend, skip_special_tokens, special, needs_context, "ByteFallback" in types)


_PLANS: "weakref.WeakKeyDictionary[Any, dict[bool, _Plan | None]]" = weakref.WeakKeyDictionary()


def plan_for(tokenizer: Any, skip_special_tokens: bool = True) -> _Plan | None:
    """The window plan for ``tokenizer`` (cached per tokenizer), or None: decode in full."""
    try:
        plans = _PLANS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return _make_plan(tokenizer, skip_special_tokens)
    if skip_special_tokens not in plans:
        plans[skip_special_tokens] = _make_plan(tokenizer, skip_special_tokens)
    return plans[skip_special_tokens]


def make_detokenizer(tokenizer: Any, token_ids: Iterable[int] = (),
                     skip_special_tokens: bool = True) -> Detokenizer:
    """A detokenizer for one request, already fed ``token_ids``: incremental where the
    tokenizer allows it, else a full decode per token."""
    plan = plan_for(tokenizer, skip_special_tokens)
    detok = (Detokenizer(tokenizer, skip_special_tokens) if plan is None
             else IncrementalDetokenizer(tokenizer, plan))
    for token_id in token_ids:
        detok.add(token_id)
    return detok
