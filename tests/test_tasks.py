"""Document tasks (longctx.entrypoints.tasks): splitting at paragraph/sentence/token boundaries, BM25,
documents as text or path, map-reduce summaries and questions sharing the document's prefix.

Fast tests use a character-level tokenizer (one token per character, so token counts are
exact) and a tiny random Llama with a 1,024-token window; the ``model`` tests run the real
SmolLM2 with its window cut to 1,024 tokens so a few thousand tokens of real text take the
map-reduce and retrieval paths cheaply."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams

from longctx.entrypoints import tasks
from tiny_models import make_engine_checkpoint, write_char_tokenizer

LICENSE = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("char-tokenizer")
    write_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tasks")
    make_engine_checkpoint(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder):
    return LLM(tiny_folder, block_size=16, max_num_batched_tokens=256)


def _paragraphs(n: int, width: int = 60) -> str:
    return "\n\n".join(f"Paragraph {i}: " + "x" * (width - 12 - len(str(i))) for i in range(n))


# ---------------------------------------------------------------- splitting


def test_split_cuts_after_whole_paragraphs(char_tokenizer):
    text = _paragraphs(10)  # paragraphs of 60 characters, separated by blank lines
    pieces = tasks.split_text(text, char_tokenizer, 130)
    assert "".join(text[p.start:p.end] for p in pieces) == text
    # two paragraphs and their separators make 124 characters; a third would pass 130
    assert [(p.start, p.end) for p in pieces] == [(0, 124), (124, 248), (248, 372), (372, 496),
                                                  (496, 618)]
    assert all(p.num_tokens <= 130 for p in pieces)
    assert all(text[p.start:p.end].startswith("Paragraph") for p in pieces)


def test_split_cuts_long_paragraph_at_sentences_then_tokens(char_tokenizer):
    sentences = "One two three. Four five six! Seven eight nine? "
    run = "y" * 45
    text = sentences + run
    pieces = tasks.split_text(text, char_tokenizer, 20)
    spans = [text[p.start:p.end] for p in pieces]
    assert spans == ["One two three. ", "Four five six! ", "Seven eight nine? ", "y" * 20, "y" * 20, "y" * 5]
    assert [p.num_tokens for p in pieces] == [15, 15, 18, 20, 20, 5]


def test_split_rejects_non_positive_budget(char_tokenizer):
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        tasks.split_text("text", char_tokenizer, 0)


# ---------------------------------------------------------------- BM25


def test_bm25_ranks_rare_matching_terms_first():
    passages = ["the cat sat on the mat", "the dog barked at the mailman",
                "a cat and a dog", "nothing relevant here"]
    index = tasks.BM25(passages)
    assert index.rank("dog mailman") == [1, 2, 0, 3]
    assert index.rank("cat") == [2, 0, 1, 3]  # the shorter passage with "cat" first
    scores = index.scores("unicorn")
    assert scores == [0.0, 0.0, 0.0, 0.0]
    assert index.rank("unicorn") == [0, 1, 2, 3]  # ties keep document order


def test_bm25_idf_matches_formula():
    index = tasks.BM25(["a b", "a c", "a d"])
    import math

    assert index.idf["a"] == pytest.approx(math.log(1 + 0.5 / 3.5))
    assert index.idf["b"] == pytest.approx(math.log(1 + 2.5 / 1.5))


def test_common_prefix_len():
    assert tasks.common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert tasks.common_prefix_len([[1, 2], [1, 2]]) == 2
    assert tasks.common_prefix_len([[5], [6]]) == 0
    assert tasks.common_prefix_len([]) == 0


# ---------------------------------------------------------------- documents


def test_read_document_from_text_path_and_str_path(tmp_path):
    file = tmp_path / "doc.txt"
    file.write_text("Hello from a file.", encoding="utf-8")
    assert tasks.read_document(file) == "Hello from a file."
    assert tasks.read_document(str(file)) == "Hello from a file."
    assert tasks.read_document("Just text, not a file.") == "Just text, not a file."
    with pytest.raises(ValueError, match="the document is empty"):
        tasks.read_document("  \n ")
    with pytest.raises(ValueError, match="cannot read the document .*missing.txt"):
        tasks.read_document(tmp_path / "missing.txt")
    with pytest.raises(TypeError, match="text or a path, got int"):
        tasks.read_document(3)


# ---------------------------------------------------------------- summarize and ask, tiny model


def test_summarize_fitting_document_is_one_pass(tiny_llm):
    seen = []
    result = tasks.summarize(tiny_llm, "A short note about cats.", max_tokens=8,
                             on_progress=lambda *a: seen.append(a))
    assert not result.map_reduce
    assert (result.num_pieces, result.num_levels, len(result.steps)) == (1, 1, 1)
    assert result.steps[0].source == (0, len("A short note about cats."))
    assert result.text == result.steps[0].text
    assert result.prompt_tokens == result.steps[0].prompt_tokens
    assert all(stage == "prefill" for stage, _, _ in seen)


def test_summarize_past_the_window_maps_then_combines(tiny_llm):
    text = _paragraphs(60)  # 3,700 characters = tokens; the window is 1,024
    seen = []
    result = tasks.summarize(tiny_llm, text, max_tokens=24, on_progress=lambda *a: seen.append(a))
    assert result.map_reduce
    pieces = result.pieces
    assert result.num_pieces == len(pieces) >= 4
    assert pieces[0].source[0] == 0 and pieces[-1].source[1] == len(text)
    assert all(a.source[1] == b.source[0] for a, b in zip(pieces, pieces[1:]))
    assert all(p.prompt_tokens + 24 <= 1024 for p in pieces)
    combines = [s for s in result.steps if s.level >= 1]
    assert combines and combines[-1].level == result.num_levels - 1
    assert len([s for s in combines if s.level == result.num_levels - 1]) == 1
    assert result.text == result.steps[-1].text
    assert result.completion_tokens == sum(s.completion_tokens for s in result.steps)
    assert ("pieces", 0, len(pieces)) in seen and ("pieces", len(pieces), len(pieces)) in seen
    assert ("combine level 1", 0, len([s for s in combines if s.level == 1])) in seen


def test_summarize_refuses_summaries_too_long_for_the_window(tiny_llm):
    with pytest.raises(ValueError, match="max_tokens=400 is too long for the 1024-token window"):
        tasks.summarize(tiny_llm, _paragraphs(60), max_tokens=400)


def test_combine_packing_takes_at_least_two_per_group():
    assert tasks._pack([10, 10, 10, 10, 10], 25) == [(0, 2), (2, 4), (4, 5)]
    assert tasks._pack([30, 30, 5], 25) == [(0, 2), (2, 3)]
    assert tasks._pack([1, 1, 1], 100) == [(0, 3)]


def test_ask_shares_the_whole_document_prefix(tiny_llm):
    doc = _paragraphs(8)
    questions = ["What is in paragraph 3?", "How many paragraphs?", "Why x?"]
    result = tasks.ask(tiny_llm, doc, questions, max_tokens=6)
    assert result.retrieval is None
    assert [a.question for a in result.answers] == questions
    assert all(a.excerpts is None for a in result.answers)
    # one token per character: the common prefix runs through the document and the lead-in
    lead_in = tasks.QUESTION_INSTRUCTIONS.split("{")[0]
    assert result.document_tokens == len(doc)
    assert result.shared_prefix_tokens >= len(doc) + len(lead_in)
    assert result.prompt_tokens == sum(a.prompt_tokens for a in result.answers)


def test_ask_one_document_prefill_with_the_prefix_cache(tiny_llm):
    doc = _paragraphs(10, width=70)
    before = tiny_llm.cache_stats()
    result = tasks.ask(tiny_llm, doc, [f"Question number {i}?" for i in range(5)], max_tokens=4)
    after = tiny_llm.cache_stats()
    computed = after.computed_prompt_tokens - before.computed_prompt_tokens
    shared, bs = result.shared_prefix_tokens, 16
    suffixes = sum(a.prompt_tokens - shared for a in result.answers)
    assert computed <= shared + suffixes + 5 * bs  # the document once, then each question's tail
    hits = sum(after.hit_tokens.values()) - sum(before.hit_tokens.values())
    assert hits >= 5 * (shared // bs * bs - bs)


def test_ask_past_the_window_retrieves_with_bm25(tiny_llm):
    paragraphs = [f"Section {i}: " + "filler words here. " * 8 for i in range(40)]
    paragraphs[27] = "Section 27: the zebra password is stored in the vault. " + "filler. " * 6
    doc = "\n\n".join(paragraphs)  # about 7,000 characters
    result = tasks.ask(tiny_llm, doc, ["Where is the zebra password?", "What is filler?"], max_tokens=8)
    assert result.retrieval == "bm25"
    assert result.shared_prefix_tokens == 0 or result.shared_prefix_tokens < len(doc)
    zebra = result.answers[0]
    assert any("zebra password" in doc[a:b] for a, b in zebra.excerpts)
    assert zebra.excerpts == sorted(zebra.excerpts)
    assert all(a.prompt_tokens + 8 <= 1024 for a in result.answers)


def test_ask_rejects_bad_questions(tiny_llm):
    with pytest.raises(ValueError, match="questions must be a non-empty list"):
        tasks.ask(tiny_llm, "doc", [])
    with pytest.raises(ValueError, match="questions must be a non-empty list"):
        tasks.ask(tiny_llm, "doc", ["ok", "  "])


def test_task_params_keeps_sampling_and_sets_length():
    params = tasks.task_params(SamplingParams(temperature=0.7, seed=3, max_tokens=5), 40)
    assert (params.temperature, params.seed, params.max_tokens) == (0.7, 3, 40)
    assert tasks.task_params(None, 12).greedy


# ---------------------------------------------------------------- the command line


def test_summarize_and_ask_commands(tiny_folder, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(_paragraphs(40))  # 2,478 characters = tokens; the window is 1,024
    common = ["--model", tiny_folder, "--max-tokens", "8"]
    summary = subprocess.run([sys.executable, "-m", "longctx", "summarize", str(doc), *common],
                             capture_output=True, text=True, timeout=300)
    assert summary.returncode == 0, summary.stderr[-2000:]
    assert re.search(r"2478 document tokens, \d+ pieces, \d+ levels", summary.stderr)
    answers = subprocess.run([sys.executable, "-m", "longctx", "ask", str(doc), "Why?", "How?",
                              "--json", *common], capture_output=True, text=True, timeout=300)
    assert answers.returncode == 0, answers.stderr[-2000:]
    result = json.loads(answers.stdout)
    assert [a["question"] for a in result["answers"]] == ["Why?", "How?"]
    assert result["retrieval"] == "bm25"
    missing = subprocess.run([sys.executable, "-m", "longctx", "ask", str(tmp_path / "nope.txt"), "Q"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "cannot read the document" in missing.stderr


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def real_llm():
    torch.set_num_threads(2)
    return LLM("smollm2-135m", max_model_len=1024)


@pytest.mark.model
def test_real_summary_past_the_window_is_map_reduce(real_llm):
    text = LICENSE.read_text()[:9000]  # about 2,000 tokens; the window is 1,024
    result = tasks.summarize(real_llm, text, max_tokens=32)
    assert result.map_reduce and result.document_tokens > 1800
    assert result.num_pieces >= 3 and result.num_levels >= 2
    pieces = result.pieces
    assert pieces[0].source[0] == 0 and pieces[-1].source[1] == len(text)
    assert all(p.text and p.prompt_tokens + 32 <= 1024 for p in pieces)
    final = result.steps[-1]
    assert final.level == result.num_levels - 1 and final.text == result.text
    assert len(result.text.split()) >= 5


@pytest.mark.model
def test_real_ask_five_questions_one_document_prefill(real_llm):
    doc = LICENSE.read_text()[:3000]  # about 650 tokens
    questions = ["What is the name of this license?", "Who published it?",
                 "Can the license document be changed?", "What is the purpose of the license?",
                 "Who may copy the license?"]
    before = real_llm.cache_stats()
    result = tasks.ask(real_llm, doc, questions, max_tokens=16)
    after = real_llm.cache_stats()
    assert result.retrieval is None and len(result.answers) == 5
    assert all(a.text for a in result.answers)
    assert result.shared_prefix_tokens >= result.document_tokens  # the document is all shared
    computed = after.computed_prompt_tokens - before.computed_prompt_tokens
    shared = result.shared_prefix_tokens
    suffixes = sum(a.prompt_tokens - shared for a in result.answers)
    assert computed <= shared + suffixes + 5 * 64  # one document prefill + each question's tail
    assert computed < 2 * result.document_tokens
    assert sum(after.hit_tokens.values()) - sum(before.hit_tokens.values()) >= 5 * (shared - 2 * 64)


@pytest.mark.model
def test_real_ask_past_the_window_uses_bm25_excerpts(real_llm):
    text = LICENSE.read_text()
    result = tasks.ask(real_llm, text, ["What is Installation Information for a User Product?"],
                       max_tokens=16)
    assert result.retrieval == "bm25" and result.document_tokens > 7000
    excerpts = result.answers[0].excerpts
    assert any('"Installation Information" for a User Product means' in text[a:b] for a, b in excerpts)
    assert result.answers[0].prompt_tokens + 16 <= 1024
