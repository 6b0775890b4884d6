"""The engine on a tiny random Llama: paged KV, chunked prefill, batching, preemption, sampling,
stop rules, streaming and input errors. Greedy tokens are checked against transformers."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import ConfigError
from longctx.engine.scheduler import RequestTooLongError
from tiny_models import hf_greedy, make_engine_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-engine")
    hf = make_engine_checkpoint(folder)
    return str(folder), hf


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 160, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("chunk,block", [(7, 4), (64, 16), (512, 128)])
def test_greedy_matches_transformers(tiny, chunk, block):
    folder, hf = tiny
    prompt = _prompts([300])[0]
    llm = LLM(folder, max_num_batched_tokens=chunk, block_size=block)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0]
    assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert out.finish_reason == "length"


def test_batch_equals_solo_runs(tiny):
    folder, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts([5, 130, 47, 260], seed=3)]
    llm = LLM(folder, max_num_batched_tokens=64, block_size=16)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    solo = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert batch == solo
    llm.clear_prefix_cache()  # cached pages are the only ones still held
    assert llm.engine.kv_usage()["device"]["free"] == llm.engine.kv_usage()["device"]["total"]


def test_latency_mode_batch_equals_solo_runs_and_transformers(tiny):
    """prefill_step_cost cuts prefills into context-dependent chunks and reorders steps; the
    tokens stay the same."""
    folder, hf = tiny
    prompts = _prompts([5, 130, 47, 260], seed=4)
    llm = LLM(folder, max_num_batched_tokens=64, block_size=16, prefill_step_cost=24)
    assert llm.engine.scheduler.context_cost == pytest.approx(
        (64 * (128 + 64) + 3 * 64 * 96) / (2 * 64))  # the tiny model's shape
    batch = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert batch == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_pool_running_dry_preempts_and_still_matches(tiny):
    folder, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts([90, 100, 110, 120], seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(folder, block_size=16, max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # 12 pages of 16 tokens: each request alone fits (<= 10 pages), all four together do not
    tight = LLM(folder, block_size=16, max_num_batched_tokens=64, num_blocks=12)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.stats()["preemptions"] > 0
    assert got == expected
    tight.clear_prefix_cache()
    assert tight.engine.kv_usage()["device"]["free"] == 12


def test_prompt_that_can_never_fit_is_rejected_before_work(tiny):
    folder, _ = tiny
    llm = LLM(folder, block_size=16, num_blocks=4)  # 64 tokens: the model's 1024 are cut to them
    with pytest.raises(RequestTooLongError, match=r"70 tokens but the context window the KV pool holds "
                                                  r"\(the model's is 1024\) is 64 tokens"):
        llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 70}],
                     SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    reserved = LLM(folder, block_size=16, num_blocks=4, max_model_len=64)
    reserved.engine.scheduler.num_reserved_blocks = 1  # (as the CUDA graphs' scratch page takes one)
    with pytest.raises(RequestTooLongError, match="needs 4 KV pages"):
        reserved.generate({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=4))
    with pytest.raises(RequestTooLongError, match="the model's context window is 1024"):
        LLM(folder).generate({"prompt_token_ids": [5] * 1024})


def test_a_temperature_below_the_floor_decodes_greedily(tiny):
    """logits / 1e-39 overflow float32: such a temperature is greedy (it drew garbage before)."""
    folder, hf = tiny
    prompt = _prompts([40], seed=13)[0]
    llm = LLM(folder, block_size=16, lookahead=False)
    tiny_t = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1e-39, max_tokens=12,
                                                                       ignore_eos=True, seed=1))[0]
    assert tiny_t.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_bad_inputs_get_clear_errors(tiny):
    folder, _ = tiny
    llm = LLM(folder)
    with pytest.raises(ValueError, match=r"integers in \[0, 160\)"):
        llm.generate({"prompt_token_ids": [1, 2, 999]})
    with pytest.raises(TypeError, match=r"a SamplingParams or a list of them, got dict \(pass SamplingParams"):
        llm.generate({"prompt_token_ids": [1, 2]}, {"max_tokens": 2})
    with pytest.raises(TypeError, match="got int"):
        llm.generate([{"prompt_token_ids": [1, 2]}], [3])
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(TypeError, match="string or a dict"):
        llm.generate([3.5])
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(folder, block_sise=16)
    with pytest.raises(ConfigError, match="block_size"):
        LLM(folder, block_size=24)


def test_stop_rules(tiny):
    folder, hf = tiny
    prompt = _prompts([40], seed=9)[0]
    llm = LLM(folder)
    free_run = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0]
    # a stop token id: generation ends on it, the token is the last one returned
    stop_id = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_id)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_id,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: first + 1]
    # a stop string: the text ends right before it
    text = free_run.text
    stop = text[3:5]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]


def test_eos_stops_unless_ignored(tiny):
    folder, _ = tiny
    llm = LLM(folder)
    prompt = _prompts([30], seed=2)[0]
    free = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    eos = llm.engine.eos_ids
    assert eos == {2}
    llm.engine.eos_ids = frozenset({free[2]})  # pretend the 3rd token is EOS
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == free[: free.index(free[2]) + 1]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    folder, _ = tiny
    llm = LLM(folder)
    prompt = {"prompt_token_ids": _prompts([25], seed=4)[0]}
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    in_batch = llm.generate([{"prompt_token_ids": [3] * 50}, prompt], [other, params])[1].outputs[0].token_ids
    assert alone == in_batch
    different = llm.generate(prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=16,
                                                    ignore_eos=True))[0].outputs[0].token_ids
    assert different != alone


def test_stream_yields_the_same_text_and_timings(tiny):
    folder, _ = tiny
    llm = LLM(folder, max_num_batched_tokens=32)
    prompt = {"prompt_token_ids": _prompts([100], seed=6)[0]}
    expected = llm.generate(prompt, GREEDY)[0]
    llm.clear_prefix_cache()  # else the stream would start from the cached first page
    progress = []
    deltas = list(llm.stream(prompt, GREEDY, on_prefill_progress=lambda d, t: progress.append((d, t))))
    assert "".join(d.text for d in deltas) == expected.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == expected.outputs[0].token_ids
    assert progress == [(32, 100), (64, 100), (96, 100)]  # the chunks before the sampling one
    final = deltas[-1].output
    assert final is not None and final.finished
    assert final.metrics.time_to_first_token > 0
    assert len(final.metrics.inter_token_latencies) == GREEDY.max_tokens - 1


def test_abandoned_stream_frees_its_pages(tiny):
    folder, _ = tiny
    llm = LLM(folder, block_size=16)
    stream = llm.stream({"prompt_token_ids": _prompts([100])[0]}, GREEDY)
    next(stream)
    assert llm.engine.kv_usage()["device"]["free"] < llm.engine.kv_usage()["device"]["total"]
    stream.close()
    llm.clear_prefix_cache()  # cached pages are the only ones still held
    assert llm.engine.kv_usage()["device"]["free"] == llm.engine.kv_usage()["device"]["total"]
    assert not llm.engine.has_unfinished()


def test_chat_and_text_prompts(tiny):
    folder, _ = tiny
    llm = LLM(folder)
    ids = llm.chat_prompt_ids([{"role": "user", "content": "hi"}])
    assert llm.get_tokenizer().decode(ids) == "<s>user: hi\n<s>assistant: "
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    same = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids
    text = llm.generate("Hello there", GREEDY)[0]
    assert text.prompt == "Hello there" and len(text.prompt_token_ids) == 11
    with pytest.raises(ValueError, match="messages"):
        llm.chat([])


def test_triton_backend_gives_the_same_greedy_tokens(tiny):
    """The engine runs the Triton kernels unchanged (here under the Triton interpreter)."""
    folder, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts([37, 20], seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    torch_llm = LLM(folder, block_size=16, max_num_batched_tokens=16)
    triton_llm = LLM(folder, block_size=16, max_num_batched_tokens=16, attention_backend="triton")
    assert triton_llm.engine.runner.backend.name == "triton"
    expected = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)] == expected


def test_stream_never_emits_text_a_stop_string_later_cuts(tiny):
    """Text that may start a stop string is held back; the streamed pieces add up to the
    final (cut) text exactly."""
    folder, _ = tiny
    llm = LLM(folder)
    prompt = {"prompt_token_ids": _prompts([40], seed=9)[0]}
    text = llm.generate(prompt, GREEDY)[0].outputs[0].text
    stop = text[3:6]  # three characters: the first two arrive a token before the stop completes
    params = SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True)
    deltas = list(llm.stream(prompt, params))
    assert "".join(d.text for d in deltas) == text[: text.find(stop)]
    assert deltas[-1].finish_reason == "stop"
