"""Document tasks on top of ``LLM``: summarize and ask, at any document length.

Owns: reading a document given as text or as a path; cutting text into window-sized pieces at
paragraph, then sentence, then token boundaries; the task prompts; map-reduce summaries; BM25
retrieval for questions about documents longer than the window; the result dataclasses.
Never: model math, scheduling or caching. It drives the engine only through ``LLM.generate``
and reads the window (``engine.max_model_len``), the page size and whether the prefix cache is
on.

Prompts put the document first and the instruction or question last, inside one user message
of the chat template, so every question about a document shares the document's token prefix:

    <system> <user: DOCUMENT \\n\\n Answer this question about the text above: Q1> <assistant>
    <system> <user: DOCUMENT \\n\\n Answer this question about the text above: Q2> <assistant>
    |<----------------- common token prefix (KV pages shared) ----------------->|

Requests admitted in the same step do not share each other's prefill, so when the prefix
cache is on, the common prefix is prefilled once on its own (one new token) before the
questions run together as one batch.

    summarize(llm, "report.txt")             # a path or the text itself
    ask(llm, text, ["Who signed it?", "When does it end?"])
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

from longctx.sampling_params import SamplingParams

Document = Union[str, "os.PathLike[str]"]
MAX_DOCUMENT_BYTES = 64 << 20  # a document file larger than this is refused (~16M tokens)


class Text(str):
    """A document given as text: never read as a file name, whatever it says (batch jobs mark
    their ``document`` fields so; ``document_path`` is the way to name a file)."""
ProgressFn = Callable[[str, int, int], None]  # (stage, done, total)

SUMMARY_TOKENS = 256  # default length of each summary
ANSWER_TOKENS = 128  # default length of each answer
MARGIN_TOKENS = 16  # slack for tokens that merge differently where texts are joined
SUMMARY_INSTRUCTIONS = "Summarize the text above in a few sentences."
PIECE_INSTRUCTIONS = ("The text above is part {index} of {count} of a longer document. "
                      "Summarize this part in a few sentences.")
COMBINE_HEADER = "Summaries of consecutive parts of one document:"
COMBINE_INSTRUCTIONS = "Combine the summaries above into one summary. {instructions}"
QUESTION_INSTRUCTIONS = "Answer this question about the text above: {question}"
EXCERPTS_HEADER = "Excerpts from a longer document:"
EXCERPT_SEPARATOR = "\n\n[...]\n\n"
MAX_EXCERPT_TOKENS = 512  # retrieval pieces: at most this long, and at most a quarter of the room

PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")
WORD = re.compile(r"\w+")


# ---------------------------------------------------------------- results

@dataclass
class SummaryStep:
    """One model call of a summary. Level 0 summarizes the document (one piece, or each piece
    of a long one); level k > 0 combines summaries of level k - 1."""

    level: int
    index: int  # position within its level
    source: tuple[int, int]  # level 0: [start, end) characters of the document; else [first, end) of level k - 1
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    time_to_first_token: float | None
    latency_s: float


@dataclass
class SummaryResult:
    text: str
    map_reduce: bool  # the document did not fit the window: pieces were summarized, then combined
    num_pieces: int
    num_levels: int
    steps: list[SummaryStep]  # every model call, level by level
    document_tokens: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float

    @property
    def pieces(self) -> list[SummaryStep]:
        return [s for s in self.steps if s.level == 0]


@dataclass
class Answer:
    question: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    time_to_first_token: float | None
    latency_s: float
    excerpts: list[tuple[int, int]] | None  # retrieval: [start, end) characters of the document used


@dataclass
class AskResult:
    answers: list[Answer]
    retrieval: str | None  # None: the whole document was in every prompt; "bm25": excerpts ranked by BM25
    document_tokens: int
    shared_prefix_tokens: int  # prompt tokens common to every question (prefilled once with the cache on)
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float


@dataclass(frozen=True)
class Piece:
    """A slice ``text[start:end]`` of a source text, and its length in tokens."""

    start: int
    end: int
    num_tokens: int


# ---------------------------------------------------------------- documents

def read_document(document: Document) -> str:
    """The text of ``document``: a path object, a one-line string naming an existing file (read
    as UTF-8; not a ``Text``), or else the text itself. A path must be a regular file of at most
    ``MAX_DOCUMENT_BYTES`` (a FIFO or a device would block or never end)."""
    if isinstance(document, os.PathLike) or (not isinstance(document, Text) and _names_file(document)):
        text = _read_file(Path(document))
    elif isinstance(document, str):
        text = document
    else:
        raise TypeError(f"a document must be text or a path, got {type(document).__name__}")
    if not text.strip():
        raise ValueError("the document is empty")
    return text


def _read_file(path: Path) -> str:
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"cannot read the document {path}: not a regular file")
            if st.st_size > MAX_DOCUMENT_BYTES:
                raise ValueError(f"cannot read the document {path}: {st.st_size} bytes, more than the "
                                 f"{MAX_DOCUMENT_BYTES} a document may have")
            data = f.read(MAX_DOCUMENT_BYTES + 1)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise ValueError(f"cannot read the document {path}: it grew past {MAX_DOCUMENT_BYTES} bytes")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the document {path}: {err}") from err


def _names_file(value: object) -> bool:
    return isinstance(value, str) and "\n" not in value and len(value) < 4096 and os.path.isfile(value)


# ---------------------------------------------------------------- splitting

def split_text(text: str, tokenizer: Any, max_tokens: int) -> list[Piece]:
    """Cut ``text`` into consecutive pieces of at most about ``max_tokens`` tokens each (tokens
    where two units are joined may merge, so a piece can come out a few tokens shorter or longer
    than the sum of its units). Cuts fall after paragraphs where possible, else after sentences,
    else between tokens. The pieces cover the text exactly."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    pieces: list[Piece] = []
    start = end = used = 0
    for unit_start, unit_end, n in _units(text, tokenizer, max_tokens):
        if used and used + n > max_tokens:
            pieces.append(_piece(text, start, end, tokenizer))
            start, used = unit_start, 0
        end, used = unit_end, used + n
    if end > start:
        pieces.append(_piece(text, start, end, tokenizer))
    return pieces


def _piece(text: str, start: int, end: int, tokenizer: Any) -> Piece:
    return Piece(start, end, count_tokens(tokenizer, text[start:end]))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _units(text: str, tokenizer: Any, max_tokens: int):
    """(start, end, tokens) of paragraphs; sentences of paragraphs that are too long; token
    windows of sentences that are still too long."""
    for p_start, p_end in _spans(text, 0, len(text), PARAGRAPH_END):
        n = count_tokens(tokenizer, text[p_start:p_end])
        if n <= max_tokens:
            yield p_start, p_end, n
            continue
        for s_start, s_end in _spans(text, p_start, p_end, SENTENCE_END):
            n = count_tokens(tokenizer, text[s_start:s_end])
            if n <= max_tokens:
                yield s_start, s_end, n
            else:
                yield from _token_windows(text, s_start, s_end, tokenizer, max_tokens)


def _spans(text: str, start: int, end: int, separator: re.Pattern) -> list[tuple[int, int]]:
    """``text[start:end]`` cut after each match of ``separator`` (the separator stays with the
    span before it)."""
    cuts = [m.end() for m in separator.finditer(text, start, end) if start < m.end() < end]
    bounds = [start, *cuts, end]
    return list(zip(bounds, bounds[1:]))


def _token_windows(text: str, start: int, end: int, tokenizer: Any, max_tokens: int):
    enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
    starts = [start + s for s, _ in enc["offset_mapping"]]
    bounds = [start, *starts[max_tokens::max_tokens], end]
    for a, b in zip(bounds, bounds[1:]):
        yield a, b, count_tokens(tokenizer, text[a:b])


# ---------------------------------------------------------------- BM25

def _terms(text: str) -> list[str]:
    return [w.lower() for w in WORD.findall(text)]


class BM25:
    """Okapi BM25 over a fixed list of passages: words are lowercased ``\\w+`` runs; k1 = 1.5,
    b = 0.75, idf = ln(1 + (N - df + 0.5) / (df + 0.5)) (never negative)."""

    def __init__(self, passages: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.counts = [Counter(_terms(p)) for p in passages]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.avg_length = (sum(self.lengths) / len(self.lengths) if self.lengths else 0.0) or 1.0
        df = Counter(t for c in self.counts for t in c)
        n = len(self.counts)
        self.idf = {t: math.log(1 + (n - k + 0.5) / (k + 0.5)) for t, k in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = set(_terms(query))
        out = []
        for counts, length in zip(self.counts, self.lengths):
            norm = self.k1 * (1 - self.b + self.b * length / self.avg_length)
            out.append(sum(self.idf[t] * counts[t] * (self.k1 + 1) / (counts[t] + norm)
                           for t in terms if t in counts))
        return out

    def rank(self, query: str) -> list[int]:
        """Passage indices, best first (ties: earlier passage first)."""
        scores = self.scores(query)
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


# ---------------------------------------------------------------- prompts and generation

def document_prompt(document: str, instruction: str) -> str:
    """The user message of a task: the document first, the instruction last."""
    return f"{document.strip()}\n\n{instruction}"


def prompt_ids(llm: Any, content: str, chat: bool = True) -> list[int]:
    """Token ids of ``content`` as one user message of the model's chat template (plain text
    when ``chat`` is off or the tokenizer has no template)."""
    tokenizer = llm.get_tokenizer()
    if chat and getattr(tokenizer, "chat_template", None):
        return llm.chat_prompt_ids([{"role": "user", "content": content}])
    return tokenizer.encode(content, add_special_tokens=False)


def common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


def generate_sharing_prefixes(llm: Any, prompts: Sequence[list[int]],
                              params: SamplingParams | Sequence[SamplingParams],
                              keys: Sequence[Hashable] | None = None) -> tuple[list[Any], dict]:
    """``llm.generate`` over token-id prompts, after prefilling once the common prefix of each
    set of prompts with the same key (all one set without ``keys``) when the prefix cache is on
    and the prefix spans at least one KV page. Returns the outputs and each key's prefix length."""
    keys = list(keys) if keys is not None else [None] * len(prompts)
    groups: dict[Hashable, list[list[int]]] = {}
    for key, prompt in zip(keys, prompts):
        groups.setdefault(key, []).append(prompt)
    shared = {key: common_prefix_len(g) if len(g) > 1 else 0 for key, g in groups.items()}
    engine = llm.engine
    if engine.has_prefix_cache:
        warm = [groups[k][0][:n] for k, n in shared.items() if n >= engine.block_size]
        if warm:
            llm.generate([{"prompt_token_ids": p} for p in warm],
                         SamplingParams(temperature=0.0, max_tokens=1))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outputs, shared


def usage(output: Any) -> dict:
    """Text, token counts, finish reason and timings of one ``RequestOutput``."""
    m, out = output.metrics, output.outputs[0]
    return {"text": out.text.strip(), "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "time_to_first_token": m.time_to_first_token,
            "latency_s": (m.finished_time or time.perf_counter()) - m.arrival_time}


# A summary or answer that a small model lets run into a loop repeats whole sentences; a mild
# frequency penalty (OpenAI's rule: over the output only) stops that without discouraging the
# document's own words, as a repetition penalty over the prompt would. Measured on the default
# model's GPL summary (`make run`): 0.3 repeats no sentence; 0.2 and 0 repeat one; a
# repetition_penalty of 1.1 drifted off the document (see docs/guide.md).
TASK_FREQUENCY_PENALTY = 0.3


def task_params(sampling_params: SamplingParams | None, max_tokens: int) -> SamplingParams:
    """``sampling_params`` (greedy with ``TASK_FREQUENCY_PENALTY`` when None) with
    ``max_tokens`` in place of its own."""
    default = SamplingParams(temperature=0.0, frequency_penalty=TASK_FREQUENCY_PENALTY)
    return replace(sampling_params or default, max_tokens=max_tokens)


def _room(llm: Any, content_without_text: str, max_tokens: int) -> int:
    """Tokens left for text in a prompt whose other parts are ``content_without_text``, with
    ``max_tokens`` new tokens and a margin."""
    overhead = len(prompt_ids(llm, content_without_text))
    return llm.engine.max_model_len - overhead - max_tokens - MARGIN_TOKENS


def _fits(llm: Any, ids: list[int], max_tokens: int) -> bool:
    return len(ids) + max_tokens <= llm.engine.max_model_len


def _report(on_progress: ProgressFn | None, stage: str, done: int, total: int) -> None:
    if on_progress is not None:
        on_progress(stage, done, total)


# ---------------------------------------------------------------- summarize

def summarize(llm: Any, document: Document, *, instructions: str | None = None,
              max_tokens: int = SUMMARY_TOKENS, sampling_params: SamplingParams | None = None,
              on_progress: ProgressFn | None = None) -> SummaryResult:
    """Summarize a document (text or path). One pass when it fits the window with its prompt
    and ``max_tokens`` new tokens; otherwise pieces are summarized as one batch and the summaries
    combined, level by level, until one remains. ``on_progress(stage, done, total)`` hears
    prefill tokens of a one-pass summary, then pieces and combine calls."""
    start = time.perf_counter()
    text = read_document(document)
    params = task_params(sampling_params, max_tokens)
    instructions = instructions or SUMMARY_INSTRUCTIONS
    tokenizer = llm.get_tokenizer()
    ids = prompt_ids(llm, document_prompt(text, instructions))
    if _fits(llm, ids, max_tokens):
        out = llm.generate({"prompt_token_ids": ids}, params,
                           on_prefill_progress=lambda d, t: _report(on_progress, "prefill", d, t))[0]
        steps = [SummaryStep(0, 0, (0, len(text)), **usage(out))]
        return _summary_result(steps, False, count_tokens(tokenizer, text), start)
    steps = _summarize_pieces(llm, text, params, on_progress)
    level = 0
    while True:
        below = [s for s in steps if s.level == level]
        combined = _combine(llm, below, level + 1, instructions, params, on_progress)
        steps += combined
        level += 1
        if len(combined) == 1:
            return _summary_result(steps, True, count_tokens(tokenizer, text), start)


def _summarize_pieces(llm: Any, text: str, params: SamplingParams,
                      on_progress: ProgressFn | None) -> list[SummaryStep]:
    room = _room(llm, document_prompt("", PIECE_INSTRUCTIONS.format(index=999, count=999)),
                 params.max_tokens)
    if room < 2 * (params.max_tokens + MARGIN_TOKENS):
        raise ValueError(f"max_tokens={params.max_tokens} is too long for the "
                         f"{llm.engine.max_model_len}-token window: a piece and two summaries must "
                         f"fit in it; lower max_tokens")
    pieces = split_text(text, llm.get_tokenizer(), room)
    prompts = [prompt_ids(llm, document_prompt(
        text[p.start:p.end], PIECE_INSTRUCTIONS.format(index=i + 1, count=len(pieces))))
        for i, p in enumerate(pieces)]
    _report(on_progress, "pieces", 0, len(pieces))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _report(on_progress, "pieces", len(pieces), len(pieces))
    return [SummaryStep(0, i, (p.start, p.end), **usage(o)) for i, (p, o) in enumerate(zip(pieces, outs))]


def _combine_content(summaries: Sequence[str], first: int, instructions: str) -> str:
    parts = "\n\n".join(f"Part {first + i + 1}: {s}" for i, s in enumerate(summaries))
    return f"{COMBINE_HEADER}\n\n{parts}\n\n{COMBINE_INSTRUCTIONS.format(instructions=instructions)}"


def _combine(llm: Any, below: list[SummaryStep], level: int, instructions: str,
             params: SamplingParams, on_progress: ProgressFn | None) -> list[SummaryStep]:
    """One level of combining: the summaries of ``below`` packed into as few prompts as fit."""
    tokenizer = llm.get_tokenizer()
    room = _room(llm, _combine_content([], 0, instructions), params.max_tokens)
    # a summary can re-encode to more tokens than were generated; clipped to half the room,
    # any two fit one prompt
    texts = [_clip(tokenizer, s.text, room // 2 - MARGIN_TOKENS) for s in below]
    sizes = [count_tokens(tokenizer, f"Part {s.index + 1}: {t}\n\n") for s, t in zip(below, texts)]
    groups = _pack(sizes, room)
    prompts = [prompt_ids(llm, _combine_content(texts[a:b], a, instructions)) for a, b in groups]
    stage = f"combine level {level}"
    _report(on_progress, stage, 0, len(groups))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _report(on_progress, stage, len(groups), len(groups))
    return [SummaryStep(level, i, g, **usage(o)) for i, (g, o) in enumerate(zip(groups, outs))]


def _clip(tokenizer: Any, text: str, max_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def _pack(sizes: Sequence[int], room: int) -> list[tuple[int, int]]:
    """Consecutive [first, end) ranges of ``sizes`` each summing to at most ``room``; every range
    takes at least two items while two are left, so each level at least halves."""
    groups, first, used = [], 0, 0
    for i, n in enumerate(sizes):
        if i - first >= 2 and used + n > room:
            groups.append((first, i))
            first, used = i, 0
        used += n
    groups.append((first, len(sizes)))
    return groups


def _summary_result(steps: list[SummaryStep], map_reduce: bool, document_tokens: int,
                    start: float) -> SummaryResult:
    return SummaryResult(
        text=steps[-1].text, map_reduce=map_reduce, num_pieces=sum(s.level == 0 for s in steps),
        num_levels=steps[-1].level + 1, steps=steps, document_tokens=document_tokens,
        prompt_tokens=sum(s.prompt_tokens for s in steps),
        completion_tokens=sum(s.completion_tokens for s in steps),
        elapsed_s=time.perf_counter() - start)


# ---------------------------------------------------------------- ask

def ask(llm: Any, document: Document, questions: str | Sequence[str], *,
        max_tokens: int = ANSWER_TOKENS, sampling_params: SamplingParams | None = None) -> AskResult:
    """Answer questions about one document (text or path), as one batch. When the document
    fits the window every prompt holds all of it and they share its prefix; otherwise each
    question gets the document's pieces that BM25 ranks most relevant to it, in document order,
    as many as fit (``retrieval == "bm25"``, ``Answer.excerpts`` names them)."""
    start = time.perf_counter()
    text = read_document(document)
    questions = _check_questions(questions)
    params = task_params(sampling_params, max_tokens)
    prompts = [prompt_ids(llm, document_prompt(text, QUESTION_INSTRUCTIONS.format(question=q)))
               for q in questions]
    retrieval, excerpts = None, [None] * len(questions)
    if not all(_fits(llm, p, max_tokens) for p in prompts):
        retrieval = "bm25"
        prompts, excerpts = _retrieval_prompts(llm, text, questions, max_tokens)
    outs, shared = generate_sharing_prefixes(llm, prompts, params)
    answers = [Answer(question=q, excerpts=e, **usage(o)) for q, e, o in zip(questions, excerpts, outs)]
    return AskResult(
        answers=answers, retrieval=retrieval, document_tokens=count_tokens(llm.get_tokenizer(), text),
        shared_prefix_tokens=shared[None], prompt_tokens=sum(a.prompt_tokens for a in answers),
        completion_tokens=sum(a.completion_tokens for a in answers), elapsed_s=time.perf_counter() - start)


def _check_questions(questions: str | Sequence[str]) -> list[str]:
    questions = [questions] if isinstance(questions, str) else list(questions)
    if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise ValueError("questions must be a non-empty list of non-empty strings")
    return [q.strip() for q in questions]


def _excerpts_content(context: str, question: str) -> str:
    return f"{EXCERPTS_HEADER}\n\n{context}\n\n{QUESTION_INSTRUCTIONS.format(question=question)}"


def _retrieval_prompts(llm: Any, text: str, questions: list[str],
                       max_tokens: int) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    tokenizer = llm.get_tokenizer()
    rooms = [_room(llm, _excerpts_content("", q), max_tokens) for q in questions]
    piece_tokens = min(MAX_EXCERPT_TOKENS, min(rooms) // 4)
    if piece_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for excerpts in the "
                         f"{llm.engine.max_model_len}-token window; lower max_tokens")
    pieces = split_text(text, tokenizer, piece_tokens)
    index = BM25([text[p.start:p.end] for p in pieces])
    separator = count_tokens(tokenizer, EXCERPT_SEPARATOR)
    prompts, excerpts = [], []
    for question, room in zip(questions, rooms):
        chosen = _select(pieces, index.rank(question), room, separator)
        context = EXCERPT_SEPARATOR.join(text[pieces[i].start:pieces[i].end].strip() for i in chosen)
        prompts.append(prompt_ids(llm, _excerpts_content(context, question)))
        excerpts.append([(pieces[i].start, pieces[i].end) for i in chosen])
    return prompts, excerpts


def _select(pieces: Sequence[Piece], ranking: Sequence[int], room: int, separator: int) -> list[int]:
    """Pieces in ranking order while they fit ``room`` tokens; returned in document order."""
    chosen, used = [], 0
    for i in ranking:
        cost = pieces[i].num_tokens + separator
        if used + cost <= room:
            chosen.append(i)
            used += cost
    return sorted(chosen)
