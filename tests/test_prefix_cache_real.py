"""The prefix store on the real model: a 6,100-token prompt answered cold, then with its prefix
on the device, on the host tier, and from disk in a new process: greedy tokens identical."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]  # every tier on tiny models: tests/test_prefix_cache.py

LICENSE = Path("/usr/share/common-licenses/GPL-3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
OPTIONS = {"block_size": 64, "max_num_batched_tokens": 2048, "host_cache_gb": 2.0}  # a host tier on the CPU too


def _run(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids


def test_hits_on_every_tier_equal_the_cold_run(tmp_path):
    torch.set_num_threads(2)
    llm = LLM("smollm2-135m", disk_cache_dir=str(tmp_path), **OPTIONS)
    tok = llm.get_tokenizer()
    document = tok.encode(LICENSE.read_text(), add_special_tokens=False)[:6100]
    prompt = document + tok.encode("\n\nQuestion: who may modify the program?\nAnswer:",
                                   add_special_tokens=False)
    full_pages = (len(prompt) - 1) // 64 * 64

    cold = _run(llm, prompt)
    assert llm.cache_stats().hit_tokens == {"device": 0, "host": 0, "disk": 0}

    assert _run(llm, prompt) == cold
    assert llm.cache_stats().hit_tokens["device"] == full_pages

    cache = llm.engine.prefix_cache
    cache.make_room(cache.tree.num_device_pages)  # every cached page to the host tier
    assert cache.tree.num_device_pages == 0 and cache.tree.num_host_pages >= full_pages // 64
    assert _run(llm, prompt) == cold
    assert llm.cache_stats().hit_tokens["host"] == full_pages
    llm.close()  # persists to disk

    script = textwrap.dedent(f"""
        import json, sys, torch
        from longctx import LLM, SamplingParams
        torch.set_num_threads(2)
        llm = LLM("smollm2-135m", disk_cache_dir={str(tmp_path)!r}, **{OPTIONS!r})
        out = llm.generate({{"prompt_token_ids": {prompt!r}}},
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        print(json.dumps({{"tokens": out[0].outputs[0].token_ids,
                          "hits": llm.cache_stats().hit_tokens}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    assert fresh["tokens"] == cold
    assert fresh["hits"] == {"device": 0, "host": 0, "disk": full_pages}
