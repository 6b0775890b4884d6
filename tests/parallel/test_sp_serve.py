"""`longctx serve --sp 2` end to end: real server processes (tests/test_server.py's
``ServerProcess``) whose engine runs two ranks. Greedy output equals the one-rank engine's,
streamed, concurrent or not; a client that leaves frees its pages on every rank; a full queue
gets 429; SIGTERM drains and exits 0; a rank killed mid-request fails the requests in flight
(503 / an error event) and /health in bounded time, and no rank outlives its server."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest
from test_server import (ENGINE_FLAGS, ServerProcess, _metric, _no_proxy, _sse_events, _wait_for,  # noqa: F401
                         check_sigterm_drain,
                         folder, slow_folder)  # fixtures shared with the one-rank server tests

from longctx import LLM, SamplingParams

NUM_BLOCKS = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--num-blocks") + 1])  # per rank


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    """The one-rank engine with the servers' options: the expected outputs."""
    llm = LLM(folder, block_size=16, num_blocks=256, max_num_batched_tokens=256)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def servers(request, folder, slow_folder, tmp_path_factory) -> dict[str, ServerProcess]:
    """Every server of this module, launched at once (their start-ups overlap)."""
    flags = {
        "sp": (folder, "--sp", "2"),
        # one running slot and one queue place (a third request gets 429); lookahead off, so
        # 3,000 tokens of the slow model take many seconds. The last test kills a rank here.
        "slow": (slow_folder, "--sequence-parallel-size", "2", "--no-lookahead", "--max-num-seqs", "1",
                 "--max-queued-requests", "1", "--sp-timeout-s", "10"),
        "sigterm": (slow_folder, "--sp", "2", "--no-lookahead", "--graceful-shutdown-timeout", "10"),
    }
    launched = {}
    for name, (model, *extra) in flags.items():
        launched[name] = ServerProcess(model, tmp_path_factory.mktemp(f"sp-{name}") / "server.log", *extra)
        request.addfinalizer(launched[name].stop)
    for server in launched.values():
        server.wait_ready(180)
    return launched


def _ranks(server: ServerProcess) -> list[psutil.Process]:
    """The server's worker ranks (spawned children)."""
    kids = psutil.Process(server.proc.pid).children()
    return [p for p in kids if any("spawn_main" in part for part in p.cmdline())]


def _descendants(server: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def _all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> bool:
    """Every process has exited (an orphan's zombie, init's to reap, counts as exited)."""
    def gone(p: psutil.Process) -> bool:
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return _wait_for(lambda: all(gone(p) for p in procs), timeout)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _pages(url: str, kind: str) -> float:
    return _metric(url, f"longctx_kv_pages_{kind}", '{tier="device"}')


# ---------------------------------------------------------------------- the tiny model


def test_server_runs_two_ranks(servers):
    server = servers["sp"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ranks = _ranks(server)
    assert len(ranks) == 1 and ranks[0].is_running()
    # the pool spans both ranks' pages
    assert _pages(server.url, "free") + _pages(server.url, "cached") == 2 * NUM_BLOCKS


def test_completions_equal_the_one_rank_engine(servers, llm, folder):
    client = servers["sp"].client()
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # 360 tokens: two chunks over two ranks
    expected = llm.generate(prompt, _greedy(24))[0].outputs[0]
    out = client.completions.create(model=folder, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 24)
    ids = [5, 17, 42, 99, 120, 7] * 30
    expected = llm.generate({"prompt_token_ids": ids}, _greedy(30))[0].outputs[0]
    chunks = list(client.completions.create(model=folder, prompt=ids, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30
    messages = [{"role": "user", "content": "Hi there! " * 20}]
    expected = llm.chat(messages, _greedy(16))[0].outputs[0].text
    stream = client.chat.completions.create(model=folder, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    seeded = dict(model=folder, prompt="Sample me", max_tokens=20, temperature=0.8, seed=11,
                  extra_body={"ignore_eos": True})
    expected = llm.generate("Sample me", SamplingParams(temperature=0.8, seed=11, max_tokens=20,
                                                       ignore_eos=True))[0].outputs[0].text
    assert client.completions.create(**seeded).choices[0].text == expected


def test_concurrent_streams_each_equal_their_solo_run(servers, llm, folder):
    url = servers["sp"].url
    prompts = [f"Request number {i}: " + "abcdefg" * (5 + 13 * i) for i in range(8)]
    lengths = [12 + 3 * i for i in range(8)]
    expected = [llm.generate(p, _greedy(n))[0].outputs[0].text for p, n in zip(prompts, lengths)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(model=folder, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(all_at_once()) == expected
    assert _pages(url, "used") == 0
    assert _pages(url, "free") + _pages(url, "cached") == 2 * NUM_BLOCKS
    assert httpx.get(url + "/health").status_code == 200


# ---------------------------------------------------------------------- the slow model


LONG = {"prompt": "A long one", "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}


def test_disconnect_mid_stream_frees_kv_on_every_rank(servers):
    url = servers["slow"].url
    aborted = _metric(url, "longctx_requests_finished_total", '{finish_reason="abort"}')
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            for i, _ in enumerate(_sse_events(response)):
                if i == 40:  # 40 tokens and more: pages on both ranks (ids alternate)
                    assert _pages(url, "used") >= 2
                    break
    assert _wait_for(lambda: _pages(url, "used") == 0 and _metric(url, "longctx_num_requests_running") == 0)
    assert _pages(url, "free") + _pages(url, "cached") == 2 * NUM_BLOCKS
    assert _metric(url, "longctx_requests_finished_total", '{finish_reason="abort"}') == aborted + 1
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**LONG, "stream": False}, timeout=1.0)
    assert _wait_for(lambda: _metric(url, "longctx_requests_finished_total",
                                     '{finish_reason="abort"}') == aborted + 2)
    assert _wait_for(lambda: _pages(url, "used") == 0)
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_queue_full_gets_429_and_the_server_recovers(servers):
    url = servers["slow"].url
    short = {"prompt": "wait in line", "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True}
    rejected = _metric(url, "longctx_requests_rejected_total")
    with httpx.Client(timeout=30) as running, httpx.Client(timeout=30) as queued:
        with running.stream("POST", url + "/v1/completions", json=LONG) as first:
            first_events = _sse_events(first)
            next(first_events)  # it holds the only running slot now
            with queued.stream("POST", url + "/v1/completions", json=short) as second:
                assert second.status_code == 200  # waits in the one queue place
                refused = httpx.post(url + "/v1/completions", json={"prompt": "x"})
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "rate_limit_exceeded"
                first.close()  # the running request goes away: the queued one runs
                events = list(_sse_events(second))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert _metric(url, "longctx_requests_rejected_total") == rejected + 1
    assert _wait_for(lambda: _pages(url, "used") == 0)


def test_killed_rank_fails_requests_in_flight_and_health(servers):
    """Runs last on the "slow" server: it leaves it broken."""
    server = servers["slow"]
    url = server.url
    ranks, everything = _ranks(server), _descendants(server)
    assert len(ranks) == 1
    queued: dict = {}

    def queued_request() -> None:  # waits behind the stream (one running slot)
        try:
            queued["response"] = httpx.post(url + "/v1/completions", timeout=60,
                                            json={"prompt": "queued", "max_tokens": 5, "temperature": 0})
        except Exception as err:  # noqa: BLE001
            queued["response"] = err

    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=LONG) as response:
            events = _sse_events(response)
            for _ in range(5):
                next(events)
            waiter = threading.Thread(target=queued_request, daemon=True)
            waiter.start()
            assert _wait_for(lambda: _metric(url, "longctx_num_requests_waiting") == 1)
            start = time.monotonic()
            ranks[0].send_signal(signal.SIGKILL)
            rest = list(events)  # the stream must end, with an error event
            elapsed = time.monotonic() - start
    assert elapsed < 30, f"the stream took {elapsed:.0f} s to end"
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "engine_unavailable" and "SequenceParallelError" in error["message"], error
    assert "rank 1 exited with code -9" in error["message"], error
    waiter.join(30)
    assert isinstance(queued.get("response"), httpx.Response), queued
    assert queued["response"].status_code == 503, queued["response"].text
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "sequence-parallel" in health.json()["error"]["message"]
    again = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=10)
    assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"
    # a broken server still stops on SIGTERM, promptly, and leaves nothing behind
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.output()[-3000:]
    assert _all_gone(everything), [(p.pid, p.cmdline()) for p in everything if p.is_running()]


@pytest.mark.slow  # waits out the grace period (~11 s); the drain: test_server.py; ranks reaped at the end: test_sp_engine.py
def test_sigterm_drains_then_cancels_and_exits_0(servers):
    """As in test_server.py, with two ranks: a short request finishes after SIGTERM, one that
    outlasts the grace period (10 s) gets an error event, the process exits 0, and its rank
    processes are gone."""
    server = servers["sigterm"]
    ranks, everything = _ranks(server), _descendants(server)
    assert len(ranks) == 1
    check_sigterm_drain(server)
    assert _all_gone(everything), [(p.pid, p.cmdline()) for p in everything if p.is_running()]
