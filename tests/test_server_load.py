"""A bounded load test of `longctx serve` on loopback: 32 streaming clients, a quarter of them
disconnecting after their first token, with and without one 8 MB prompt sent among them.

The 8 MB prompt must not stall the others: the small requests' p99 time to first token may
be at most twice what it is without it (issue 43: it was 10-25x, the whole prompt being
tokenized on the one tokenizer thread before its length was checked). Nothing may be lost
(every client that stayed gets all its tokens, the large prompt gets its 400) and the KV
pages must all come back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from test_server import ServerProcess, _metric, _no_proxy, _wait_for  # noqa: F401 (_no_proxy: a fixture)
from tiny_models import make_engine_checkpoint

CLIENTS = 32
DISCONNECTING = 8  # every fourth client leaves after its first token
MAX_TOKENS = 8
ROUNDS = 4  # of each kind, alternating, so that a slow patch of the machine hits both kinds;
# 128 small requests a kind, so that p99 is not just the single slowest one (with 2 rounds, one
# run beside two CPU burners and other tests gave 0.36 s alone against 0.83 beside the prompt;
# three runs beside the burners alone, 0.52-0.53 against 0.60-0.74)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The slow test model of test_server (hidden 512, 8 layers, 4K window): a round of 32
    requests takes about a second, so a stall of seconds stands out from the noise."""
    path = tmp_path_factory.mktemp("load-model")
    make_engine_checkpoint(path, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    proc = ServerProcess(str(path), tmp_path_factory.mktemp("load") / "server.log", "--no-lookahead")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


async def _small(client: httpx.AsyncClient, url: str, i: int, leave: bool) -> dict:
    """One streaming request: its time to first token, and (unless it leaves) all its tokens."""
    body = {"prompt": f"Request {i:02d} asks for a few words.", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, tokens, finish = None, "", None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                    if leave:
                        return {"ttft": ttft, "left": True}
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft": ttft, "left": False, "tokens": tokens, "finish": finish, "text": text}


async def _large(client: httpx.AsyncClient, url: str, size: int) -> httpx.Response:
    words = "the quick brown fox jumps over the lazy dog near the river bank ".encode()
    body = b'{"max_tokens": 4, "prompt": "' + (words * (size // len(words)))[:size] + b'"}'
    return await client.post(url + "/v1/completions", content=body,
                             headers={"Content-Type": "application/json"})


async def _round(url: str, with_large: bool) -> tuple[list[dict], httpx.Response | None]:
    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        large = asyncio.ensure_future(_large(client, url, 8_000_000)) if with_large else None
        if large is not None:
            await asyncio.sleep(0.05)  # the large body is on its way when the small ones arrive
        small = [_small(client, url, i, leave=i % (CLIENTS // DISCONNECTING) == 0) for i in range(CLIENTS)]
        results = await asyncio.gather(*small)
        return list(results), (await large if large is not None else None)


def _kv_back_to_zero(url: str) -> bool:
    return _wait_for(lambda: _metric(url, 'longctx_kv_pages_used{tier="device"}') == 0
                     and _metric(url, "longctx_num_requests_running") == 0
                     and _metric(url, "longctx_num_requests_waiting") == 0, timeout=60)


def test_one_8mb_prompt_does_not_stall_32_streaming_clients(server):
    url = server.url
    asyncio.run(_round(url, with_large=False))  # warm-up: first steps, the tokenizer pool's copies
    assert _kv_back_to_zero(url)
    ttfts: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for with_large in (False, True):
            results, large = asyncio.run(_round(url, with_large))
            for r in results:
                assert r["ttft"] is not None
                if not r["left"]:  # nothing lost: every client that stayed got all its tokens
                    assert (r["tokens"], r["finish"]) == (MAX_TOKENS, "length"), r
            ttfts[with_large] += [r["ttft"] for r in results]
            if large is not None:
                error = large.json()["error"]
                assert large.status_code == 400 and error["code"] == "context_length_exceeded", error
                assert error["param"] == "prompt" and "4096 tokens: its first" in error["message"], error
            assert _kv_back_to_zero(url)
    p99 = {k: float(np.percentile(v, 99)) for k, v in ttfts.items()}
    print(f"p99 TTFT of the small requests: {p99[False]:.3f} s alone, {p99[True]:.3f} s beside the 8 MB prompt")
    assert p99[True] <= 2 * p99[False], p99
