"""int8 KV pages (``kv_cache_dtype="int8"``) through the whole engine on a tiny random Llama:
the write path's error bound, page bytes on every tier, chunked prefill and paged decode close
to float pages, lookahead, the prefix store (device, host and disk after a restart) giving the
same tokens as a cold run, the padded graph path, and the clear errors.

Tolerances: a value read back from an int8 page is off by at most one quantisation step of its
page's final scale (``amax / 127``; half a step when written once, another half per rescale).
Log-probabilities with int8 pages stay within 0.05 of float pages' on this model (measured:
see the assertion messages); the real model's agreement is in ``test_int8_kv_real.py``."""

from __future__ import annotations

import struct

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import CacheConfig
from longctx.kernels import kv_quant, reference
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv.formats import FloatPages, Int8Pages
from longctx.model.config import ModelConfig
from tiny_models import random_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = random_tokens(150, seed=5)


def slots_of(blocks: list[int], start: int, count: int, block_size: int) -> torch.Tensor:
    return torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count)])


@pytest.mark.parametrize("chunks", [[37], [5, 20, 1, 1, 30], [1] * 9])
def test_write_int8_stays_within_a_step_of_the_final_scale(chunks):
    gen = torch.Generator().manual_seed(len(chunks))
    nb, bs, heads, dim = 7, 16, 3, 8
    cache = torch.randint(-127, 127, (nb, bs, heads, dim), generator=gen, dtype=torch.int8)  # garbage
    scale = torch.rand(nb, heads, generator=gen) * 5  # stale scales of an earlier owner
    blocks, truth, pos = [5, 2, 6, 0], {}, 0
    for i, n in enumerate(chunks):
        x = torch.randn(n, heads, dim, generator=gen) * (1 + i)  # later chunks larger: rescales
        slots = slots_of(blocks, pos, n, bs)
        kv_quant.write_int8(cache, scale, x, slots)
        truth.update({int(s): row for s, row in zip(slots, x)})
        pos += n
    slots = torch.tensor(sorted(truth))
    got = kv_quant.dequantize_rows(cache, scale, slots)
    want = torch.stack([truth[int(s)] for s in slots])
    page_scale = scale[slots // bs][:, :, None]
    amax = torch.zeros(nb, heads)
    for s, row in truth.items():
        amax[s // bs] = torch.maximum(amax[s // bs], row.abs().amax(-1))
    touched = sorted({s // bs for s in truth})
    assert torch.allclose(scale[touched], amax[touched] / 127)  # the scale is the page's amax / 127
    rescales = len(chunks)
    assert ((got - want).abs() <= page_scale * 0.5 * (1 + rescales) + 1e-6).all()
    assert ((got - want).abs() <= page_scale).float().mean() > 0.99


def test_write_int8_with_the_sequences_first_rows_as_starts_equals_the_default():
    gen = torch.Generator().manual_seed(0)
    a = torch.zeros(6, 8, 2, 4, dtype=torch.int8), torch.zeros(6, 2)
    b = a[0].clone(), a[1].clone()
    first = torch.randn(11, 2, 4, generator=gen)
    second = torch.randn(3 + 9, 2, 4, generator=gen) * 2
    for cache, scale in (a, b):
        kv_quant.write_int8(cache, scale, first[:5], slots_of([1, 3], 0, 5, 8))
        kv_quant.write_int8(cache, scale, first[5:], slots_of([4, 0], 0, 6, 8))
    s2 = torch.cat([slots_of([1, 3], 5, 3, 8), slots_of([4, 0], 6, 9, 8)])
    kv_quant.write_int8(*a, second, s2)  # default: every page change
    kv_quant.write_int8(*b, second, s2, torch.tensor([0, 3]))  # the sequences' first rows only
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_int8_attention_reads_what_was_written():
    """reference.paged_attention over int8 pages equals it over the dequantised pages, and is
    close to attention over the float rows."""
    gen = torch.Generator().manual_seed(1)
    nb, bs, hkv, dim = 9, 8, 2, 16
    k, v = torch.randn(29, hkv, dim, generator=gen), torch.randn(29, hkv, dim, generator=gen)
    kc, vc = torch.zeros(nb, bs, hkv, dim, dtype=torch.int8), torch.zeros(nb, bs, hkv, dim, dtype=torch.int8)
    ks, vs = torch.zeros(nb, hkv), torch.zeros(nb, hkv)
    fk, fv = torch.zeros(nb, bs, hkv, dim), torch.zeros(nb, bs, hkv, dim)
    slots = slots_of([4, 1, 7, 2], 0, 29, bs)
    reference.write_kv(kc, vc, k, v, slots, ks, vs)
    reference.write_kv(fk, fv, k, v, slots)
    q = torch.randn(3, hkv * 3, dim, generator=gen)
    table = torch.tensor([[4, 1, 7, 2]], dtype=torch.int32)
    args = (table, torch.tensor([29], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    got, _ = reference.paged_attention(q, kc, vc, *args, k_scale=ks, v_scale=vs)
    deq, _ = reference.paged_attention(q, kv_quant.dequantize(kc, ks), kv_quant.dequantize(vc, vs), *args)
    exact, _ = reference.paged_attention(q, fk, fv, *args)
    assert torch.allclose(got, deq, atol=1e-6)
    assert (got - exact).abs().max() < 0.03


def test_int8_pages_take_about_a_quarter_of_the_bytes():
    model = ModelConfig("llama", vocab_size=100, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
    fp32, int8 = FloatPages(model, torch.float32).page_bytes(64), Int8Pages(model, torch.float32).page_bytes(64)
    assert int8 / fp32 == pytest.approx((64 * 64 + 4) / (64 * 64 * 4))  # values + one scale per head
    assert int8 / fp32 <= 0.3


def test_a_page_round_trips_through_its_bytes():
    model = ModelConfig("llama", vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    pool = DeviceKVPool(Int8Pages(model, torch.float32), 5, 8, "cpu")
    gen = torch.Generator().manual_seed(2)
    for k, v, ks, vs in pool.caches:
        for c, s in ((k, ks), (v, vs)):
            c.copy_(torch.randint(-127, 128, c.shape, generator=gen, dtype=torch.int8))
            s.copy_(torch.rand(s.shape, generator=gen))
    pages = pool.read_pages([3, 1])
    assert pages.dtype == torch.uint8 and tuple(pages.shape) == (2, *pool.page_shape)
    other = DeviceKVPool(Int8Pages(model, torch.float32), 5, 8, "cpu")
    other.write_pages([0, 4], pages)
    for c1, c2 in zip(pool.caches, other.caches):
        for a, b in zip(c1, c2):  # values and scales
            assert torch.equal(a[[3, 1]], b[[0, 4]])


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'bfloat16', 'int8', got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")


def prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    return [entry[t] for t, entry in zip(ids[1:], out.prompt_logprobs[1:])]


@pytest.fixture(scope="module")
def float_run(tiny_engine_folder):
    llm = LLM(tiny_engine_folder, block_size=16, max_num_batched_tokens=32, lookahead=False)
    tokens = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    logprobs = prompt_logprobs(llm, PROMPT + tokens)
    llm.close()
    return tokens, logprobs


def test_int8_pages_stay_close_to_float_pages(tiny_engine_folder, float_run):
    """Chunks of 32 tokens: every chunk after the first reads earlier ones from int8 pages."""
    tokens, want = float_run
    llm = LLM(tiny_engine_folder, block_size=16, max_num_batched_tokens=32, lookahead=False, kv_cache_dtype="int8",
              enable_prefix_caching=False)
    assert llm.engine.kv.format.name == "int8" and llm.engine.kv.layers[0][0].dtype == torch.int8
    got = prompt_logprobs(llm, PROMPT + tokens)
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < 0.05, diff
    assert diff > 0  # the pages really are int8
    mine = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    assert sum(a == b for a, b in zip(mine, tokens)) >= len(tokens) // 2, (mine, tokens)


def test_int8_with_lookahead_and_the_padded_graph_path(tiny_engine_folder):
    """Lookahead verify steps write drafts to int8 pages and move accepted rows (requantised,
    and their exact-tail rows moved); the padded CUDA-graph step runs the same code eagerly on
    the CPU. What a query sees exact depends on its position only, so both give plain int8
    decoding's tokens, and its log-probabilities to 3e-5 (seen 1.0e-5: rejected drafts may
    have raised a page's scale; without the exact tail the gap was 4.3e-5)."""
    repetitive = (PROMPT[:40] * 4)[:150]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    def run(llm):
        out = llm.generate({"prompt_token_ids": repetitive}, params)[0]
        lps = [lp[t] for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
        llm.close()
        return out.outputs[0].token_ids, lps, out.metrics.num_accepted_tokens

    want, want_lp, _ = run(LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", lookahead=False))
    looked = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", lookahead=True)
    looked.engine.capture_step_graphs(4, capture=False, max_draft=looked.engine.lookahead.config.lookahead_max_tokens)
    got, got_lp, accepted = run(looked)
    assert accepted > 0  # drafts were accepted (and moved)
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 3e-5


def test_a_bf16_model_on_the_tiles_refills_its_first_pages_after_an_int8_prefix_hit(tiny_engine_folder,
                                                                                     monkeypatch):
    """A bfloat16 model whose products run on the AMX tiles (from 65 rows here) asks the paged
    backend for its attention rows rounded for the o projection; the first pages' refill after
    a prefix hit on int8 pages runs the model through a backend of its own, which is never
    asked (``hands_rounded_rows``): the hit gives the cold run's tokens."""
    from longctx.kernels import cpu_amx

    if not cpu_amx.available():
        pytest.skip(f"the AMX products are {cpu_amx.status()}")
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "65")
    llm = LLM(tiny_engine_folder, dtype="bfloat16", block_size=128, kv_cache_dtype="int8", lookahead=False,
              max_num_batched_tokens=256)
    o_proj = llm.engine.model.layers[0].self_attn.o_proj
    assert o_proj.method.takes_rounded(o_proj, 128)  # a first page of 128 rows would be asked
    prompt = random_tokens(300, seed=11)
    cold = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids == cold
    assert llm.cache_stats().hit_tokens["device"] >= 256
    llm.close()


def test_int8_prefix_hits_on_every_tier_give_the_cold_tokens(tiny_engine_folder, tmp_path):
    """A hit on each tier gives the cold run's tokens and log-probabilities (to 2e-5; seen
    ~1e-6): the int8 pages come back as written, and the first page's exact rows, which the
    exact tail needs and no tier stores, are recomputed from its tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(llm):
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
        return out.token_ids, [lp[t] for t, lp in zip(out.token_ids, out.logprobs)]

    def same(got, want):
        assert got[0] == want[0]
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 2e-5

    cold = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", enable_prefix_caching=False, lookahead=False)
    want = run(cold)
    cold.close()
    disk = str(tmp_path / "kv")
    # a small device pool and a host tier: the first document's pages are evicted to the host
    llm = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", lookahead=False, num_blocks=24,
              host_cache_gb=0.01, disk_cache_dir=disk)
    same(run(llm), want)
    same(run(llm), want)  # a device-tier hit
    assert llm.cache_stats().hit_tokens["device"] > 0
    llm.generate({"prompt_token_ids": random_tokens(300, seed=9)}, GREEDY)  # pushes PROMPT's pages out
    same(run(llm), want)
    assert llm.cache_stats().hit_tokens["host"] > 0
    llm.close()  # persists to disk
    again = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", lookahead=False, disk_cache_dir=disk)
    same(run(again), want)
    assert again.cache_stats().hit_tokens["disk"] >= 128
    again.close()
    # float pages never take int8 files: another key
    other = LLM(tiny_engine_folder, block_size=16, lookahead=False, disk_cache_dir=disk)
    other.generate({"prompt_token_ids": PROMPT}, GREEDY)
    assert other.cache_stats().hit_tokens["disk"] == 0
    other.close()


def test_an_old_disk_file_is_a_miss(tiny_engine_folder, tmp_path):
    disk = str(tmp_path / "kv")
    llm = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", lookahead=False, disk_cache_dir=disk)
    want = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    llm.close()
    files = sorted((tmp_path / "kv").rglob("*.kvpage"))
    assert files
    for f in files:  # rewrite as version 1 (same bytes, old magic)
        data = f.read_bytes()
        f.write_bytes(b"LCKVPAGE1\n" + data[len(b"LCKVPAGE2\n"):])
    again = LLM(tiny_engine_folder, block_size=16, kv_cache_dtype="int8", lookahead=False, disk_cache_dir=disk)
    assert again.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == want
    stats = again.cache_stats()
    assert stats.hit_tokens["disk"] == 0 and stats.disk_misses.get("old", 0) >= 1, stats
    again.close()


def test_int8_with_sequence_parallelism_equals_one_process(tiny_engine_folder):
    """Two ranks, each holding its share of the int8 pages, give one process's int8 tokens and
    log-probabilities: chunked prefill (each rank quantises the rows of its pages; a chunk's
    own new tokens are read back as stored, as one process reads them), the exact tail (each
    query's own page exact, from a copy of the tail's rows on every rank), paged decode over
    both ranks' pages, lookahead (accepted drafts moved across ranks and requantised there)
    and a host-tier hit (pages travel as their int8 bytes with their scales). Float pages move
    the log-probabilities by far more than the ranks may (2e-5), so a rank path that read
    float K/V, or missed the tail, would fail."""
    repetitive = (PROMPT[:40] * 4)[:150]
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, repetitive, random_tokens(90, seed=3))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    def chosen(outs):
        return [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    opts = dict(block_size=16, max_num_batched_tokens=32, lookahead=True)
    # the same pages and tiers as the ranks below hold together (batching and chunks follow
    # the prefix cache, and int8 rounding follows them at ~5e-4)
    one = LLM(tiny_engine_folder, **opts, kv_cache_dtype="int8", num_blocks=40, host_cache_gb=0.01)
    outs = one.generate(prompts, params)
    want, want_lp = [o.outputs[0].token_ids for o in outs], chosen(outs)
    one.close()
    floats = LLM(tiny_engine_folder, **opts, enable_prefix_caching=False)
    float_outs = floats.generate(prompts, params)
    floats.close()
    float_gap = max(abs(a - b) for w, f, wl, fl in zip(want, [o.outputs[0].token_ids for o in float_outs],
                                                        want_lp, chosen(float_outs))
                    for x, y, a, b in zip(w, f, wl, fl) if x == y)
    assert float_gap > 2e-4  # seen: 8e-4
    sp = LLM(tiny_engine_folder, **opts, kv_cache_dtype="int8", sequence_parallel_size=2, num_blocks=20,
             host_cache_gb=0.01)  # 20 pages per rank: two 300-token prompts push PROMPT's out
    try:
        assert sp.engine.kv.format.name == "int8" and sp.engine.kv.local.layers[0][0].dtype == torch.int8
        outs = sp.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        gap = max(abs(a - b) for got, w in zip(chosen(outs), want_lp) for a, b in zip(got, w))
        assert gap < 2e-5, (gap, float_gap)  # seen: 5e-7
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # drafts were accepted and moved
        for seed in (9, 10):
            sp.generate({"prompt_token_ids": random_tokens(300, seed=seed)}, GREEDY)
        assert sp.generate(prompts[0], params)[0].outputs[0].token_ids == want[0]
        assert sp.cache_stats().hit_tokens["host"] > 0
    finally:
        sp.close()


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_write_gives_the_torch_writes_bytes(seed):
    """``kv_quant.write_int8_kv`` on the CPU (one C call for K and V) against ``write_int8``:
    the same int8 values and scales, bit for bit, over steps that start pages, raise scales of
    pages already holding values (requantised), and write a shared scratch page twice."""
    from longctx.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip(f"the CPU kernels are {cpu_decode.status()}")
    gen = torch.Generator().manual_seed(seed)
    nb, bs, heads, dim = 12, 8, 3, 16
    torch_side = [torch.randint(-127, 128, (nb, bs, heads, dim), generator=gen, dtype=torch.int8) for _ in range(2)]
    torch_side += [torch.rand(nb, heads, generator=gen) for _ in range(2)]
    c_side = [t.clone() for t in torch_side]
    tables, lengths = [[3, 7, 1], [5, 0], [9, 2, 4]], [0, 0, 0]
    for step in range(6):
        slots, starts = [], []
        for table, n in zip(tables, (13, 1, 4) if step % 2 == 0 else (1, 3, 1)):
            pos = lengths[tables.index(table)]
            if pos + n > len(table) * bs:
                continue
            starts.append(len(slots))
            slots += [table[p // bs] * bs + p % bs for p in range(pos, pos + n)]
            lengths[tables.index(table)] = pos + n
        starts.append(len(slots))
        slots += [11 * bs + 1, 11 * bs + 1]  # scratch: written twice, not a fresh page
        slots_t, starts_t = torch.tensor(slots), torch.tensor(starts)
        scale_up = 1 + step  # later rows larger: pages holding values get their scales raised
        k = torch.randn(len(slots), heads, dim, generator=gen) * scale_up
        v = torch.randn(len(slots), heads, dim, generator=gen) * scale_up
        plan = kv_quant.plan_write(slots_t, bs, starts_t)
        kv_quant.write_int8(torch_side[0], torch_side[2], k, plan)
        kv_quant.write_int8(torch_side[1], torch_side[3], v, plan)
        assert cpu_decode.write_int8_kv(*c_side, k, v, slots_t, starts_t)  # the C kernel ran
        for a, b in zip(torch_side, c_side):
            assert torch.equal(a, b), step


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_turning_q_k_v_matches_the_products(tokens, dtype):
    """``kv_quant.turn_qkv`` (q, k and v through the rotation; one product when they are one
    qkv buffer's consecutive heads, as the model hands them over) and ``turn`` back: the same
    as ``x @ R`` and ``x @ R.T`` in float32, contiguous, in the input's dtype; for separate
    tensors, for the views of one buffer, and for the views in another order."""
    r = kv_quant.rotation(64)
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15 * 64, generator=gen).to(dtype)
    views = (qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64), qkv[:, 768:].view(tokens, 3, 64))
    swapped = (views[0], views[2], views[1])  # k after v: not the one-product layout
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for q, k, v in (views, swapped, tuple(x.clone() for x in views)):
        got = kv_quant.turn_qkv(q, k, v, r)
        for x, y in zip(got, (q, k, v)):
            assert x.dtype == dtype and x.shape == y.shape and x.is_contiguous()
            torch.testing.assert_close(x.float(), y.float() @ r, **tol)
        back = kv_quant.turn(got[0], r, back=True)
        torch.testing.assert_close(back.float(), q.float(), **tol)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_the_rotation_is_orthogonal_and_leaves_attention_unchanged(head_dim):
    """int8 pages hold k @ R and v @ R, queries are rotated alike and outputs rotated back:
    in float arithmetic the same attention (Hadamard for powers of two, a seeded random
    rotation otherwise); and it spreads a large key channel over all of them."""
    r = kv_quant.rotation(head_dim)
    assert torch.allclose(r @ r.T, torch.eye(head_dim), atol=1e-6)
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(20, 2, head_dim, generator=gen) for _ in range(3))
    k[:, :, 3] *= 30  # an outlier channel
    plain = reference.attention(q, k, v)[0]
    rotated = reference.attention(q @ r, k @ r, v @ r)[0] @ r.T
    assert torch.allclose(plain, rotated, atol=1e-4)
    assert (k @ r).abs().amax() < 0.5 * k.abs().amax()
