"""bfloat16 KV pages under a float32 model (``kv_cache_dtype="bfloat16"``) through the whole
engine on a tiny random Llama: the pages hold the float32 rows rounded to bfloat16 (exactly:
layer 0's rows do not depend on earlier pages), half the bytes; prompt log-probabilities near
float pages'; and with the rest of the engine (lookahead with the padded graph path, prefix
hits on the device, host and disk tiers, two sequence-parallel ranks) the tokens and
log-probabilities of one plain bfloat16-page run.

Tolerances: bfloat16 keeps 8 significant bits (relative rounding <= 2^-9); on this model the
prompt log-probabilities move by 6.3e-4 from float pages' (bound 0.02). Runs that compute the
same rows another way (a prefix hit's suffix in other chunks, drafts verified many rows at a
time, two ranks' partial sums) differ from the cold run in float32's last bits, and a last bit
can carry a value across a bfloat16 rounding boundary: one bfloat16 step where float pages
differ by one float32 step. Seen: tier hits 2e-5 (bound 1e-4), drafts 4.7e-5 (2e-4), two ranks
8.3e-5 (5e-4); float pages 4.8e-7 for the drafts. Tokens must be equal everywhere.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import CacheConfig, ConfigError
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv.formats import Bf16Pages, FloatPages, check_kv_format, kv_format
from tiny_models import random_tokens

PROMPT = random_tokens(150, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
OPTS = dict(block_size=16, max_num_batched_tokens=32)


def chosen(outs) -> list[list[float]]:
    return [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]


def prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    return [entry[t] for t, entry in zip(ids[1:], out.prompt_logprobs[1:])]


def test_the_format_stores_bfloat16_in_half_the_bytes():
    cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
    half, full = Bf16Pages(cfg, torch.float32), FloatPages(cfg, torch.float32)
    assert half.page_bytes(16) * 2 == full.page_bytes(16)
    assert half.page_layout(16)[1] == torch.bfloat16 and half.row_dtype == torch.bfloat16
    assert half.cache_key == "torch.bfloat16" != full.cache_key
    pool = DeviceKVPool(half, 4, 4, "cpu")
    rows = torch.randn(16, 2, 16, generator=torch.Generator().manual_seed(0))
    for layer in pool.caches:
        assert layer[0].dtype == torch.bfloat16
        half.write_rows(layer, 0, rows, torch.arange(16), list(range(16)))
        assert torch.equal(half.read_rows(layer, 0, torch.arange(16)), rows.to(torch.bfloat16))
    pages = pool.read_pages([2, 0])
    assert pages.dtype == torch.bfloat16 and pages[0].numel() * 2 == half.page_bytes(4)
    assert type(kv_format(CacheConfig(kv_cache_dtype="bfloat16"), cfg, torch.float32)) is Bf16Pages


def test_bfloat16_pages_under_float32_compute_are_for_the_cpu():
    cache = CacheConfig(kv_cache_dtype="bfloat16")
    check_kv_format(cache, torch.float32, "cpu")
    check_kv_format(cache, torch.bfloat16, "cuda")  # a bf16 model's own pages
    with pytest.raises(ConfigError, match="kv_cache_dtype='bfloat16' under float32 compute is for the CPU"):
        check_kv_format(cache, torch.float32, "cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'bfloat16', 'int8', got 'fp16'"):
        CacheConfig(kv_cache_dtype="fp16")


@pytest.fixture(scope="module")
def float_pages(tiny_engine_folder):
    llm = LLM(tiny_engine_folder, **OPTS, lookahead=False, enable_prefix_caching=False)
    tokens = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    logprobs = prompt_logprobs(llm, PROMPT + tokens)
    layer0 = [t[:10].clone() for t in llm.engine.kv.layers[0][:2]]
    llm.close()
    return tokens, logprobs, layer0


def test_pages_hold_the_float_rows_rounded_and_stay_close(tiny_engine_folder, float_pages):
    """Chunks of 32 tokens, so every chunk after the first reads earlier ones from bfloat16 pages.
    Layer 0's K and V come from the embeddings alone: its pages are float pages' rounded."""
    tokens, want, float_layer0 = float_pages
    llm = LLM(tiny_engine_folder, **OPTS, lookahead=False, enable_prefix_caching=False, kv_cache_dtype="bfloat16")
    assert llm.engine.kv_dtype == torch.bfloat16 and llm.engine.dtype == torch.float32
    got = prompt_logprobs(llm, PROMPT + tokens)
    for mine, theirs in zip(llm.engine.kv.layers[0][:2], float_layer0):  # the same pages: one request each
        assert torch.equal(mine[:10], theirs.to(torch.bfloat16))
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert 0 < diff < 0.02, diff  # the pages really are bfloat16, and near float32's (seen 6.3e-4)
    llm.close()


def test_lookahead_and_the_padded_graph_path_give_plain_bfloat16_decoding(tiny_engine_folder):
    """Same tokens, log-probabilities to 2e-4: a draft's K/V come from a many-row product whose
    float32 sums may differ from a decode step's in the last bit, and a last bit can carry a
    value across a bfloat16 rounding boundary (seen 4.7e-5; float pages 4.8e-7, bfloat16 pages
    against float pages 1e-3 and more: a path that wrote float32 rows would fail)."""
    repetitive = (PROMPT[:40] * 4)[:150]

    def run(llm):
        out = llm.generate({"prompt_token_ids": repetitive}, LOGPROBS)
        llm.close()
        return out[0].outputs[0].token_ids, chosen(out)[0], out[0].metrics.num_accepted_tokens

    want, want_lp, _ = run(LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="bfloat16", lookahead=False))
    looked = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="bfloat16", lookahead=True)
    looked.engine.capture_step_graphs(4, capture=False, max_draft=looked.engine.lookahead.config.lookahead_max_tokens)
    got, got_lp, accepted = run(looked)
    assert accepted > 0  # drafts were accepted (their rows moved within the bfloat16 pages)
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 2e-4


def test_prefix_hits_on_every_tier_and_two_ranks_give_the_cold_tokens(tiny_engine_folder, tmp_path):
    """A hit on the device, host and disk tiers, and two sequence-parallel ranks (chunked
    prefill, decode over both ranks' pages, lookahead, a host hit), give one process's cold
    bfloat16 tokens; float pages never take the bfloat16 pages' disk files (another key)."""
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, (PROMPT[:40] * 4)[:150], random_tokens(90, seed=3))]
    cold = LLM(tiny_engine_folder, **OPTS, kv_cache_dtype="bfloat16", enable_prefix_caching=False, lookahead=True)
    outs = cold.generate(prompts, LOGPROBS)
    want, want_lp = [o.outputs[0].token_ids for o in outs], chosen(outs)
    cold.close()
    floats = LLM(tiny_engine_folder, **OPTS, enable_prefix_caching=False, lookahead=True)
    float_outs = floats.generate(prompts, LOGPROBS)
    floats.close()
    float_gap = max(abs(a - b) for w, f, wl, fl in zip(want, [o.outputs[0].token_ids for o in float_outs],
                                                        want_lp, chosen(float_outs))
                    for x, y, a, b in zip(w, f, wl, fl) if x == y)
    assert float_gap > 0, float_gap  # what a run that read float32 K/V would be off by

    def same(outs, which=range(3), tol=1e-4):
        assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in which]
        gap = max(abs(a - b) for got, i in zip(chosen(outs), which) for a, b in zip(got, want_lp[i]))
        assert gap < tol, (gap, float_gap)

    disk = str(tmp_path / "kv")
    llm = LLM(tiny_engine_folder, **OPTS, kv_cache_dtype="bfloat16", lookahead=True, num_blocks=24,
              host_cache_gb=0.01, disk_cache_dir=disk)
    same(llm.generate(prompts[:1], LOGPROBS), [0])
    same(llm.generate(prompts[:1], LOGPROBS), [0])
    assert llm.cache_stats().hit_tokens["device"] > 0
    llm.generate({"prompt_token_ids": random_tokens(300, seed=9)}, GREEDY)  # pushes PROMPT's pages out
    same(llm.generate(prompts[:1], LOGPROBS), [0])
    assert llm.cache_stats().hit_tokens["host"] > 0
    llm.close()  # persists to disk
    again = LLM(tiny_engine_folder, **OPTS, kv_cache_dtype="bfloat16", lookahead=True, disk_cache_dir=disk)
    same(again.generate(prompts[:1], LOGPROBS), [0])
    assert again.cache_stats().hit_tokens["disk"] >= 128
    again.close()
    other = LLM(tiny_engine_folder, **OPTS, lookahead=False, disk_cache_dir=disk)
    other.generate(prompts[0], GREEDY)
    assert other.cache_stats().hit_tokens["disk"] == 0
    other.close()

    sp = LLM(tiny_engine_folder, **OPTS, kv_cache_dtype="bfloat16", lookahead=True, sequence_parallel_size=2,
             num_blocks=20, host_cache_gb=0.01)
    try:
        assert sp.engine.kv.local.layers[0][0].dtype == torch.bfloat16
        outs = sp.generate(prompts, LOGPROBS)
        same(outs, tol=5e-4)
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        for seed in (9, 10):
            sp.generate({"prompt_token_ids": random_tokens(300, seed=seed)}, GREEDY)
        same(sp.generate(prompts[:1], LOGPROBS), [0], tol=5e-4)
        assert sp.cache_stats().hit_tokens["host"] > 0
    finally:
        sp.close()
