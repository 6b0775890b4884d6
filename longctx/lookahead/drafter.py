"""Drafting for lookahead decoding: guess a request's next tokens from text it has already seen.

Owns: the n-gram index of a request's tokens (prompt and everything generated), the optional
pool of other requests' outputs on the same document, and turning matches into a
``DraftTree``. Never: torch, model calls, or deciding which guesses are right (``acceptance``).

How a draft is made. The context is the request's last ``k`` tokens, for ``k`` from
``max_context`` down to ``min_context``. Every earlier place where that ``k``-gram ended is an
*occurrence*; the tokens that followed it there are a guess of what follows now. The
continuations of the ``max_occurrences`` best occurrences (longest context first, then the
request's own text before the pool, then most recent first) form a trie, each node counting
the occurrences that pass through it::

    text   ... a b c X Y ... a b c X Z ... b c W ... a b c      (last tokens: a b c)
    k = 3  "a b c" occurred twice  ->  X Y ...,  X Z ...
    k = 2  "b c" adds one more     ->  W ...
    trie   root ─ X (2, k=3) ┬ Y (1, k=3)
                │            └ Z (1, k=3)
                └ W (1, k=2)

The draft keeps the best nodes, best first, a node only after its parent::

    rank(node) = (longest context that led to it, occurrences through it, first seen)

with at most ``max_tokens`` nodes and ``max_branches`` leaves. A child never outranks its
parent (fewer occurrences, no longer context), so the draft is the top of the ranking under
the parent rule. The trie is the subtrie a full n-gram trie would hold under the context, but
only its selected nodes are ever expanded: indexing where each ``k``-gram ends costs one entry
per token and context length, where a stored trie of all ``(k + draft depth)``-grams would
cost that many times the draft depth.

Index layout (``NgramIndex``): ``tokens`` holds segments separated by ``SEPARATOR``; for each
context length, the positions where each n-gram ends. A request's own index is one segment; a
pool document has one segment per published output, so no guess runs across two outputs.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from longctx.lookahead.tree import MAX_NODES, ROOT, DraftTree

SEPARATOR = -1  # never a token id: marks the end of a segment in NgramIndex.tokens
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # odd, so distinct last tokens always hash apart
_UINT64_MASK = (1 << 64) - 1
_MIN_BULK_REINDEX = 1024  # dictionary-indexed tokens that justify a bulk re-index


@dataclass(frozen=True)
class DrafterConfig:
    max_context: int = 4  # longest suffix of the request matched against earlier text
    min_context: int = 1  # shortest suffix tried when no longer one has occurred before
    max_occurrences: int = 64  # continuations merged per proposal (most recent first)

    def __post_init__(self) -> None:
        if not (isinstance(self.min_context, int) and self.min_context >= 1):
            raise ValueError(f"min_context must be an integer >= 1, got {self.min_context!r}")
        if not (isinstance(self.max_context, int) and self.max_context >= self.min_context):
            raise ValueError(f"max_context must be an integer >= min_context "
                             f"({self.min_context}), got {self.max_context!r}")
        if not (isinstance(self.max_occurrences, int) and self.max_occurrences >= 1):
            raise ValueError(f"max_occurrences must be an integer >= 1, "
                             f"got {self.max_occurrences!r}")

    @property
    def context_lengths(self) -> range:
        """Context lengths tried, longest first."""
        return range(self.max_context, self.min_context - 1, -1)


def _check_tokens(tokens: list[int]) -> None:
    if tokens and min(tokens) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(tokens)}")


def _gram_hash(gram: tuple[int, ...]) -> int:
    """The 64-bit polynomial hash ``_bulk_hashes`` computes for every n-gram at once."""
    value = 0
    for token in gram:
        value = (value * _HASH_MULTIPLIER + token) & _UINT64_MASK
    return value


def _bulk_hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    """uint64 [len(tokens) - k + 1]: the hash of the k-gram ending at each position >= k - 1."""
    num_grams = len(tokens) - k + 1
    hashes = tokens[:num_grams].copy()
    for i in range(1, k):
        hashes = hashes * np.uint64(_HASH_MULTIPLIER) + tokens[i:num_grams + i]  # wraps mod 2^64
    return hashes


class _SortedGrams:
    """Where each k-gram of a bulk-built token list ends: ends sorted by (gram hash, position).

    Built with numpy in a few milliseconds for 32K tokens; a lookup is a binary search, and
    candidates are checked against the tokens, so a hash collision costs time, never a match.
    """

    def __init__(self, tokens: np.ndarray, k: int) -> None:
        self.k = k
        hashes = _bulk_hashes(tokens, k)
        order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[order]
        self.ends = order + (k - 1)

    def recent_ends(self, gram: tuple[int, ...], tokens: list[int]) -> Iterator[int]:
        key = _gram_hash(gram)
        bounds = np.array([key, (key + 1) & _UINT64_MASK], dtype=np.uint64)
        low, high = self.hashes.searchsorted(bounds).tolist()
        high = high if key != _UINT64_MASK else len(self.hashes)
        wanted = list(gram)
        for i in range(high - 1, low - 1, -1):
            end = int(self.ends[i])
            if tokens[end - self.k + 1:end + 1] == wanted:
                yield end


class NgramIndex:
    """Token segments and, per context length, where each n-gram ends (see module docstring).

    Tokens are indexed in bulk (``_SortedGrams``, numpy) at construction; tokens added later
    by ``extend`` go to per-length dictionaries until they are as many as the bulk-indexed
    ones, when everything is re-indexed in bulk (amortised O(log n) per token, and the
    dictionaries, ~150 bytes per token and length, never dominate memory). Lookups merge the
    two, most recent first, so an index extended token by token answers as one built at once.
    """

    def __init__(self, config: DrafterConfig, tokens: Sequence[int] = ()) -> None:
        self.config = config
        self.tokens: list[int] = list(tokens)
        self._index_in_bulk()

    def _index_in_bulk(self) -> None:
        as_uint64 = np.array(self.tokens, dtype=np.int64).astype(np.uint64)  # SEPARATOR: 2^64-1
        self._bulk = [_SortedGrams(as_uint64, k) for k in self.config.context_lengths
                      if len(self.tokens) >= k]
        self._num_bulk_tokens = len(self.tokens)
        self._recent: dict[int, dict[tuple[int, ...], list[int]]] = {
            k: {} for k in self.config.context_lengths}

    def start_segment(self) -> None:
        """Later tokens begin a new segment. N-grams across the boundary hold ``SEPARATOR``,
        so they never match a context, and continuations stop at it."""
        if self.tokens:
            self.tokens.append(SEPARATOR)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the current segment and index the n-grams ending at them."""
        _check_tokens(tokens)
        first_new = len(self.tokens)
        self.tokens.extend(tokens)
        for k, ends in self._recent.items():
            self._index_ngrams(k, ends, first_end=max(first_new, k - 1))
        num_recent = len(self.tokens) - self._num_bulk_tokens
        if num_recent >= max(_MIN_BULK_REINDEX, self._num_bulk_tokens):
            self._index_in_bulk()

    def _index_ngrams(self, k: int, ends: dict[tuple[int, ...], list[int]],
                      first_end: int) -> None:
        start = first_end - k + 1
        shifted = [self.tokens[start + i:] for i in range(k)]
        for end, gram in enumerate(zip(*shifted), first_end):
            positions = ends.get(gram)
            if positions is None:
                ends[gram] = [end]
            else:
                positions.append(end)

    def recent_ends(self, gram: tuple[int, ...]) -> Iterator[int]:
        """Where ``gram`` ended, most recent first (its length must be an indexed length)."""
        yield from reversed(self._recent[len(gram)].get(gram, ()))
        for bulk in self._bulk:
            if bulk.k == len(gram):
                yield from bulk.recent_ends(gram, self.tokens)

    def has_continuation(self, end: int) -> bool:
        """Whether a token of the same segment follows position ``end``."""
        return end + 1 < len(self.tokens) and self.tokens[end + 1] != SEPARATOR

    def segments(self) -> list[list[int]]:
        segments, start = [], 0
        for i, token in enumerate(self.tokens + [SEPARATOR]):
            if token == SEPARATOR:
                segments.append(self.tokens[start:i])
                start = i + 1
        return segments


class SharedDraftPool:
    """Outputs of finished requests, per document, for drafters of later requests to consult.

    Bounded: at most ``max_documents`` documents (least recently used evicted whole) and
    ``max_tokens_per_document`` tokens each (oldest outputs dropped first). A document key is
    whatever the engine uses to say two requests read the same text (e.g. a prefix hash).
    """

    def __init__(self, config: DrafterConfig, max_documents: int = 16,
                 max_tokens_per_document: int = 16384) -> None:
        if not (isinstance(max_documents, int) and max_documents >= 1):
            raise ValueError(f"max_documents must be an integer >= 1, got {max_documents!r}")
        if not (isinstance(max_tokens_per_document, int) and max_tokens_per_document >= 1):
            raise ValueError(f"max_tokens_per_document must be an integer >= 1, "
                             f"got {max_tokens_per_document!r}")
        self.config = config
        self.max_documents = max_documents
        self.max_tokens_per_document = max_tokens_per_document
        self._documents: OrderedDict[Hashable, NgramIndex] = OrderedDict()

    def __len__(self) -> int:
        return len(self._documents)

    def document(self, key: Hashable) -> NgramIndex | None:
        """The index of ``key``'s published outputs (marks it recently used), or None."""
        index = self._documents.get(key)
        if index is not None:
            self._documents.move_to_end(key)
        return index

    def add(self, key: Hashable, tokens: list[int]) -> None:
        """Publish one output for ``key``: a new segment, evicting to stay within bounds."""
        _check_tokens(tokens)
        if not tokens:
            return
        index = self._documents.pop(key, None) or NgramIndex(self.config)
        self._documents[key] = index
        index.start_segment()
        index.extend(tokens)
        if len(index.tokens) > self.max_tokens_per_document:
            self._documents[key] = self._newest_outputs(index)
        while len(self._documents) > self.max_documents:
            self._documents.popitem(last=False)

    def _newest_outputs(self, index: NgramIndex) -> NgramIndex:
        """A rebuilt index of the newest whole outputs that fit (at least the newest's tail)."""
        kept: list[list[int]] = []
        room = self.max_tokens_per_document
        for segment in reversed(index.segments()):
            if len(segment) > room:
                if not kept:
                    kept.append(segment[-room:])
                break
            kept.append(segment)
            room -= len(segment) + 1  # the separator before it
        tokens = [token for segment in reversed(kept) for token in [SEPARATOR, *segment]]
        return NgramIndex(self.config, tokens[1:])


# A cursor follows one occurrence down its continuation: (order found, context length that
# matched, the tokens of the index it is in, position of the last token followed so far).
_Cursor = tuple[int, int, list[int], int]


def _group_by_next_token(cursors: list[_Cursor]) -> dict[int, list[_Cursor]]:
    """The cursors advanced by one token, grouped by that token (order kept)."""
    groups: dict[int, list[_Cursor]] = {}
    for order, context_length, tokens, position in cursors:
        following = position + 1
        if following < len(tokens) and tokens[following] != SEPARATOR:
            group = groups.setdefault(tokens[following], [])
            group.append((order, context_length, tokens, following))
    return groups


def _heap_entries(groups: dict[int, list[_Cursor]], parent: int) -> list[tuple]:
    """Heap entries ranked as the module docstring says. Nodes in the heap at once never share
    a cursor, so (context, count, first seen) is unique and later fields never compare."""
    return [(-cursors[0][1], -len(cursors), cursors[0][0], token, parent, cursors)
            for token, cursors in groups.items()]


def _best_first_tree(cursors: list[_Cursor], max_tokens: int, max_branches: int) -> DraftTree:
    """Select the best nodes of the continuation trie, best first, a node after its parent,
    expanding only selected nodes (the trie is never built beyond what the draft can hold)."""
    heap = _heap_entries(_group_by_next_token(cursors), ROOT)
    heapq.heapify(heap)
    token_ids: list[int] = []
    parents: list[int] = []
    has_children: set[int] = set()
    num_leaves = 0
    while heap and len(token_ids) < max_tokens:
        _, _, _, token, parent, node_cursors = heapq.heappop(heap)
        opens_branch = parent == ROOT or parent in has_children
        if opens_branch and num_leaves == max_branches:
            continue
        num_leaves += opens_branch
        has_children.add(parent)
        node = len(token_ids)
        token_ids.append(token)
        parents.append(parent)
        for entry in _heap_entries(_group_by_next_token(node_cursors), node):
            heapq.heappush(heap, entry)
    return DraftTree(token_ids, parents)


class Drafter:
    """One request's drafter: feed it every committed token, ask it for a draft each step.

    ``Drafter(config, prompt)`` indexes the prompt; ``extend(tokens)`` appends committed tokens
    (accepted drafts and bonus tokens, in order); ``propose`` drafts what follows the last
    committed token (the root of the verify step). With a ``pool`` and ``document_key`` it also
    matches other requests' published outputs on the same document, and ``publish()`` adds this
    request's generated tokens to the pool when it finishes.
    """

    def __init__(self, config: DrafterConfig, prompt: list[int],
                 pool: SharedDraftPool | None = None, document_key: Hashable = None) -> None:
        if pool is not None and pool.config != config:
            raise ValueError(f"the shared pool was built for {pool.config}, the drafter uses "
                             f"{config}; give both the same DrafterConfig")
        if pool is not None and document_key is None:
            raise ValueError("a drafter with a shared pool needs the document_key of its text")
        self.config = config
        self.pool = pool
        self.document_key = document_key
        self.num_prompt_tokens = len(prompt)
        self._published = False
        _check_tokens(list(prompt))
        self._index = NgramIndex(config, prompt)

    @property
    def tokens(self) -> list[int]:
        """Prompt and committed tokens, in order (do not modify)."""
        return self._index.tokens

    def extend(self, tokens: list[int]) -> None:
        """Record newly committed tokens (after the prompt, in order)."""
        self._index.extend(list(tokens))

    def propose(self, max_tokens: int, max_branches: int) -> DraftTree:
        """A draft of at most ``max_tokens`` nodes in at most ``max_branches`` branches that
        continues ``tokens``; empty when the recent context never occurred before."""
        if not (isinstance(max_tokens, int) and 0 <= max_tokens <= MAX_NODES):
            raise ValueError(f"max_tokens must be an integer in [0, {MAX_NODES}], "
                             f"got {max_tokens!r}")
        if not (isinstance(max_branches, int) and max_branches >= 1):
            raise ValueError(f"max_branches must be an integer >= 1, got {max_branches!r}")
        if max_tokens == 0:
            return DraftTree.empty()
        return _best_first_tree(self._cursors(), max_tokens, max_branches)

    def _indexes(self) -> list[NgramIndex]:
        shared = self.pool.document(self.document_key) if self.pool is not None else None
        return [self._index] if shared is None else [self._index, shared]

    def _cursors(self) -> list[_Cursor]:
        """Earlier ends of the request's suffixes that have a continuation, best first."""
        tokens, limit = self._index.tokens, self.config.max_occurrences
        indexes = self._indexes()
        found: list[_Cursor] = []
        seen: set[tuple[int, int]] = set()
        for k in self.config.context_lengths:
            if len(tokens) < k:
                continue
            gram = tuple(tokens[-k:])
            for source, index in enumerate(indexes):
                for end in index.recent_ends(gram):
                    if len(found) == limit:
                        return found
                    if (source, end) in seen or not index.has_continuation(end):
                        continue
                    seen.add((source, end))
                    found.append((len(found), k, index.tokens, end))
        return found

    def publish(self) -> None:
        """Give this request's generated tokens to the shared pool (once, when it finishes)."""
        if self.pool is None:
            raise ValueError("this drafter has no shared pool to publish to")
        if self._published:
            raise ValueError("this request's output was already published")
        self._published = True
        self.pool.add(self.document_key, self._index.tokens[self.num_prompt_tokens:])
