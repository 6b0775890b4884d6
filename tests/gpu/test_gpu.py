"""On a GPU: the Triton kernels (and flash-attn, when installed) against kernels/reference.py
in fp16 and bf16; the engine against HF transformers in bf16; CUDA graphs on and off giving
the same tokens; and a decode step that never synchronises with the host except for its one
download of tokens (``torch.cuda.set_sync_debug_mode("error")``).

Tolerances. Kernels: the error against an fp32 reference at most twice that of the same
computation by the reference in the kernel's dtype, plus a small floor (flash-attn's rule).
Engine vs HF: in fp32 greedy tokens identical; in bf16 both compute with different kernels, so
greedy runs may part where two tokens are nearly tied: at the first difference HF must rate
our token within 0.5 logits of its own (and in its top 3)."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.kernels import reference

DEV = torch.device("cuda") if torch.cuda.is_available() else None
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def paged_case(dtype, q_lens, ctx_lens, group, head_dim, block_size=16, tree=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    blocks = [-(-c // block_size) for c in ctx_lens]
    nb = sum(blocks) + 2
    k = torch.randn(nb, block_size, hkv, head_dim, generator=gen)
    v = torch.randn(nb, block_size, hkv, head_dim, generator=gen)
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    taken = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[taken:taken + n].to(torch.int32)
        taken += n
    q = torch.randn(sum(q_lens), hkv * group, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return [t.to(DEV) for t in (q.to(dtype), k.to(dtype), v.to(dtype), table, ctx, cu)], tree


def check_kernel(fn, args, tree_mask=None):
    q, k, v, table, ctx, cu = args
    out, _ = fn(q, k, v, table, ctx, cu, tree_mask=tree_mask)
    ref32, _ = reference.paged_attention(q.float(), k.float(), v.float(), table, ctx, cu, tree_mask=tree_mask)
    ref_lo, _ = reference.paged_attention(q, k, v, table, ctx, cu, tree_mask=tree_mask)
    err = (out.float() - ref32).abs().max().item()
    base = (ref_lo.float() - ref32).abs().max().item()
    assert err <= 2 * base + 1e-3, (err, base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (128, 8), (256, 1)])
@pytest.mark.parametrize("q_lens,ctx_lens", [((1, 1, 1), (37, 1000, 4099)),  # decode
                                             ((5, 300), (5, 811))])  # prefill chunks, one after a prefix
def test_triton_paged_attention_against_reference(dtype, head_dim, group, q_lens, ctx_lens):
    from longctx.kernels import triton_attention

    args, _ = paged_case(dtype, q_lens, ctx_lens, group, head_dim)
    check_kernel(triton_attention.paged_attention, args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_verify_with_a_tree_mask(dtype):
    from longctx.kernels import triton_attention
    from longctx.lookahead.tree import tree_ancestor_words

    parents = [-1, 0, 1, -1, 3]  # two branches
    words = tree_ancestor_words(parents)
    args, _ = paged_case(dtype, (6, 1), (506, 77), 4, 128)
    mask = torch.tensor(words + [1], dtype=torch.int64, device=DEV)
    check_kernel(triton_attention.paged_attention, args, tree_mask=mask)


def test_flash_attn_backend_against_triton():
    flash_attn = pytest.importorskip("flash_attn")
    from longctx.attention import AttentionMetadata, FlashAttnBackend
    from longctx.kernels import triton_attention

    args, _ = paged_case(torch.bfloat16, (1, 1), (300, 1500), 4, 128, block_size=256)
    q, k, v, table, ctx, cu = args
    backend = FlashAttnBackend(128, triton_attention, flash_attn)
    new_k = torch.zeros(2, 2, 128, dtype=torch.bfloat16, device=DEV)
    slots = torch.tensor([int(table[0, 299 // 256]) * 256 + 299 % 256,
                          int(table[1, 1499 // 256]) * 256 + 1499 % 256], device=DEV)
    new_k.copy_(k.view(-1, 2, 128)[slots])
    new_v = v.view(-1, 2, 128)[slots].clone()
    meta = AttentionMetadata([1, 1], [300, 1500], cu, ctx, table, slots, None, [(k, v)],
                             max_query_len=1, max_context_len=1500,
                             cu_seqlens_k=torch.tensor([0, 300, 1800], dtype=torch.int32, device=DEV))
    out = backend.run(0, q, new_k, new_v, backend.plan(meta))
    expected, _ = triton_attention.paged_attention(q, k, v, table, ctx, cu)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def prompts():
    """Real text (this repository's docs) cut to 50, 700 and 2,100 tokens: random ids make
    near-ties that any two kernels may break differently."""
    from pathlib import Path

    from longctx.model.loader import resolve_model
    from longctx.model.tokenizer import load_tokenizer

    docs = Path(__file__).resolve().parents[2] / "docs"
    text = "\n".join(p.read_text() for p in sorted(docs.glob("*.md")))
    ids = load_tokenizer(resolve_model("smollm2-135m")).encode(text, add_special_tokens=False)
    assert len(ids) > 2100
    return [ids[:n] for n in (50, 700, 2100)]


def hf_model(dtype):
    transformers = pytest.importorskip("transformers")
    from longctx.model.loader import resolve_model

    path = resolve_model("smollm2-135m")
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, **kwargs).to(DEV).eval()


def greedy_pair(llm, hf, prompt: list[int]) -> tuple[list[int], list[int]]:
    """32 greedy tokens from the engine and from HF for the same prompt."""
    ours = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    ids = torch.tensor([prompt], device=DEV)
    theirs = hf.generate(ids, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
    return ours, theirs[0, len(prompt):].tolist()


def test_engine_fp32_equals_hf(prompts):
    """float32 on the GPU (Triton in IEEE fp32, no TF32): greedy tokens identical to HF's."""
    hf = hf_model(torch.float32)
    with LLM(dtype="float32", device="cuda", lookahead=False) as llm:
        for prompt in prompts:
            ours, theirs = greedy_pair(llm, hf, prompt)
            assert ours == theirs


@torch.no_grad()
def test_engine_bf16_follows_hf(prompts):
    """bfloat16: both sides round differently, so greedy runs may part where two tokens are
    nearly tied. Where ours first differs from HF's, HF's own logits (teacher-forced on the
    common prefix) must rate our token within 0.5 of its choice and among its top 3."""
    hf = hf_model(torch.bfloat16)
    with LLM(dtype="bfloat16", device="cuda", lookahead=False) as llm:
        for prompt in prompts:
            ours, theirs = greedy_pair(llm, hf, prompt)
            if ours == theirs:
                continue
            i = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            logits = hf(torch.tensor([prompt + ours[:i]], device=DEV)).logits[0, -1].float()
            gap = (logits[theirs[i]] - logits[ours[i]]).item()
            assert gap <= 0.5 and ours[i] in logits.topk(3).indices.tolist(), (len(prompt), i, gap)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cuda_graphs_on_and_off_give_the_same_tokens(prompts, kv_cache_dtype):
    """bf16 pages: the same tokens. int8 pages: graphs and eager may part where two tokens are
    nearly tied (H100, 2026-11-26: the 50-token prompt at token 30 with lookahead, the
    700-token one at token 25 without, with the int8 write by the Triton kernels and by the
    torch form alike; cause not pinned down, likely that a graph's attention is planned for the
    captured extents and so tiles keys differently, which moves the bf16 rounding of
    p * V scale). Where they first differ, eager's own top 5 must hold the graph's token within
    0.5 nats of eager's choice."""
    batch = [{"prompt_token_ids": p} for p in prompts]
    eager = LLM(device="cuda", enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    outs = [o.outputs[0] for o in eager.generate(batch, SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5))]
    expected = [o.token_ids for o in outs]
    eager.close()
    graphed = LLM(device="cuda", kv_cache_dtype=kv_cache_dtype)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.graphs  # captured
    got = [o.outputs[0].token_ids for o in graphed.generate(batch, GREEDY)]
    assert graphs.num_replays > 0
    graphed.close()
    if kv_cache_dtype == "auto":
        assert got == expected
        return
    for out, mine in zip(outs, got):
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, mine)) if a != b), None)
        if first is not None:
            step = out.logprobs[first]
            assert mine[first] in step, (first, step)
            assert step[out.token_ids[first]] - step[mine[first]] < 0.5, (first, step)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_decode_step_never_syncs_but_for_its_download(prompts, kv_cache_dtype):
    llm = LLM(device="cuda", lookahead=False, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, GREEDY)
    while any(r.num_pending > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills done
    packer = engine.runner.packer
    original = packer.download

    def download(values):  # the one allowed sync: the sampled tokens
        torch.cuda.set_sync_debug_mode("default")
        try:
            return original(values)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    packer.download = download
    torch.cuda.set_sync_debug_mode("error")
    try:
        updates = engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(updates) == len(prompts) and all(len(u.new_token_ids) == 1 for u in updates)
    llm.close()
