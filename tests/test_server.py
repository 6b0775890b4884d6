"""`longctx serve` end to end: real server processes on 127.0.0.1 with the tiny model, spoken
to over HTTP with the `openai` client and httpx. Greedy output must equal `LLM.generate` on
the same model; bad input must get a 4xx in OpenAI's error shape, never a 5xx."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from longctx import LLM, SamplingParams
from longctx.engine.output_processor import partial_stop_len
from longctx.entrypoints.server.engine_loop import EngineLoop
from tiny_models import make_engine_checkpoint

ENGINE_FLAGS = ["--block-size", "16", "--num-blocks", "256", "--max-num-batched-tokens", "256"]
API_KEY = "test-key-123"


class ServerProcess:
    """``python -m longctx serve`` on 127.0.0.1, port chosen by the OS (read from its log)."""

    def __init__(self, folder: str, log_path: Path, *flags: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LONGCTX_API_KEY"}
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "longctx", "serve", "--model", folder, "--host", "127.0.0.1",
             "--port", "0", "--log-level", "warning", *ENGINE_FLAGS, *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.url = self._ready_url(timeout)

    def _ready_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.output())
            if found:
                try:
                    if httpx.get(found.group(1) + "/health", timeout=2).status_code == 200:
                        return found.group(1)
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _no_proxy():
    """Requests go straight to 127.0.0.1, whatever proxy the environment names."""
    with pytest.MonkeyPatch.context() as patch:
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            patch.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-serve")
    make_engine_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory) -> str:
    """A bigger random model with a 4K window (about 6 ms a token on 2 CPU cores, 100 times the
    tiny one) for tests that need a request to still be running a few seconds later."""
    path = tmp_path_factory.mktemp("slow-serve")
    make_engine_checkpoint(path, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    return str(path)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(folder, block_size=16, num_blocks=256, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def servers(request, folder, slow_folder, tmp_path_factory) -> dict[str, ServerProcess]:
    """Every server this module needs, launched at once so that their start-ups (mostly
    imports) overlap."""
    flags = {
        "plain": (folder,),
        # the slow model, lookahead off (a random model repeats itself, and accepted drafts
        # would make the long requests of these tests short): 3,000 tokens take ~20 s
        "slow": (slow_folder, "--no-lookahead"),
        # API key on; one running slot and one queue place, so a third request gets 429
        "strict": (slow_folder, "--no-lookahead", "--api-key", API_KEY, "--max-num-seqs", "1",
                   "--max-queued-requests", "1"),
        # a grace period a short request finishes in on a loaded machine (its 40 tokens took
        # over 3 s beside other CPU-bound jobs) and the long one (4,000 tokens, ~25 s) outlasts
        "sigterm": (slow_folder, "--no-lookahead", "--graceful-shutdown-timeout", "10"),
    }
    launched = {}
    for name, (model, *extra) in flags.items():
        launched[name] = ServerProcess(model, tmp_path_factory.mktemp(name) / "server.log", *extra)
        request.addfinalizer(launched[name].stop)
    for server in launched.values():
        server.wait_ready()
    return launched


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["plain"]


@pytest.fixture(scope="module")
def strict_server(servers) -> ServerProcess:
    return servers["strict"]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def _sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


# ---------------------------------------------------------------------- happy paths


def test_health_models_and_metrics(server, folder):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models").status_code == 200  # no API key set: none needed
    models = server.client().models.list()
    assert [m.id for m in models] == [folder]
    assert server.client().models.retrieve(folder).id == folder
    text = httpx.get(server.url + "/metrics").text
    for name in ("longctx_time_to_first_token_seconds_bucket", "longctx_inter_token_latency_seconds_bucket",
                 "longctx_e2e_request_latency_seconds_bucket", "longctx_num_requests_running",
                 "longctx_num_requests_waiting", 'longctx_kv_pages_used{tier="device"}',
                 'longctx_kv_pages_free{tier="device"}', 'longctx_kv_pages_cached{tier="device"}',
                 'longctx_prefix_cache_hit_tokens{tier="device"}', 'longctx_lookahead_tokens{kind="accepted"}',
                 "longctx_lookahead_verify_steps"):
        assert name in text


def test_completions_equal_llm_generate(server, llm, folder):
    client = server.client()
    expected = llm.generate("Hello there", _greedy(24))[0].outputs[0]
    out = client.completions.create(model=folder, prompt="Hello there", max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (11, 24, 35)
    # a token-id prompt, streamed, with usage at the end
    ids = [5, 17, 42, 99, 120, 7]
    expected = llm.generate({"prompt_token_ids": ids}, _greedy(20))[0].outputs[0]
    chunks = list(client.completions.create(model=folder, prompt=ids, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_equals_llm_chat(server, llm, folder):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    expected = llm.chat(messages, _greedy(16))[0]
    out = client.chat.completions.create(model=folder, messages=messages, max_completion_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=folder, messages=messages, max_tokens=16,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_spanning_tokens_is_never_streamed(server, llm, folder):
    free_text = llm.generate("Stop me", _greedy(30))[0].outputs[0].text
    stop = free_text[6:8]  # two characters: two tokens of the char tokenizer
    expected = free_text[: free_text.find(stop)]
    pieces = [c.choices[0].text for c in server.client().completions.create(
        model=folder, prompt="Stop me", max_tokens=30, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True})]
    assert "".join(pieces) == expected
    out = server.client().completions.create(model=folder, prompt="Stop me", max_tokens=30,
                                             temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"


def test_concurrent_streams_each_equal_their_solo_run(server, llm, folder):
    prompts = [f"Request number {i}: " + "abc" * i for i in range(10)]
    lengths = [12 + 3 * i for i in range(10)]
    expected = [llm.generate(p, _greedy(n))[0].outputs[0].text for p, n in zip(prompts, lengths)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(model=folder, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(all_at_once()) == expected
    assert _metric(server.url, 'longctx_kv_pages_used{tier="device"}') == 0


def test_penalties_and_min_p_equal_llm_generate(server, llm, folder):
    client = server.client()
    fields = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4, "min_p": 0.05}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **fields)
    expected = llm.generate("Hello there", params)[0].outputs[0].text
    assert expected != llm.generate("Hello there", _greedy(24))[0].outputs[0].text  # they matter
    out = client.completions.create(model=folder, prompt="Hello there", max_tokens=24, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=0.4,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05})
    assert out.choices[0].text == expected
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, **fields)
    out = client.completions.create(model=folder, prompt="Hello there", max_tokens=24, temperature=0.8,
                                    seed=5, presence_penalty=0.5, frequency_penalty=0.4,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05})
    assert out.choices[0].text == llm.generate("Hello there", sampled)[0].outputs[0].text


def _check_top(chosen: str, logprob: float, top: list[tuple[str, float]]) -> None:
    """A greedy token's entry: a log-probability, the top list most likely first, the chosen
    token first in it."""
    assert logprob <= 0
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True)
    assert chosen in [t for t, _ in top]
    assert top[0] == (chosen, logprob)


def test_chat_logprobs_with_the_openai_client(server, llm, folder):
    client = server.client()
    messages = [{"role": "user", "content": "Say something."}]
    out = client.chat.completions.create(model=folder, messages=messages, max_completion_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                 logprobs=3))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    for item, token_id, entry in zip(content, expected.token_ids, expected.logprobs):
        assert item.token == tokenizer.decode([token_id])
        assert bytes(item.bytes) == item.token.encode("utf-8")
        assert len(item.top_logprobs) == 3
        _check_top(item.token, item.logprob, [(t.token, t.logprob) for t in item.top_logprobs])
        assert item.logprob == pytest.approx(entry[token_id], abs=1e-4)
    # streamed: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model=folder, messages=messages, max_completion_tokens=12,
                                                 temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs
                for item in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]
    # logprobs without top_logprobs: the chosen tokens only; not asked: none
    out = client.chat.completions.create(model=folder, messages=messages, max_completion_tokens=4,
                                         temperature=0, logprobs=True)
    assert all(item.top_logprobs == [] and item.logprob <= 0 for item in out.choices[0].logprobs.content)
    out = client.chat.completions.create(model=folder, messages=messages, max_completion_tokens=4)
    assert out.choices[0].logprobs is None


def test_completion_logprobs_with_the_openai_client(server, folder):
    client = server.client()
    out = client.completions.create(model=folder, prompt="Hello there", max_tokens=10, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # the top 2, and the chosen token if not among them
        _check_top(token, logprob, list(top.items()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    # sampled: the chosen token need not be on top, but it is always in the dict
    out = client.completions.create(model=folder, prompt="Hello there", max_tokens=10, temperature=1.0,
                                    seed=3, logprobs=1, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and max(top.values()) >= logprob
    # streamed: offsets continue across chunks
    chunks = list(client.completions.create(model=folder, prompt="Hello there", max_tokens=10, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    whole = client.completions.create(model=folder, prompt="Hello there", max_tokens=10, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [t for s in streamed for t in s.tokens] == whole.tokens
    assert [o for s in streamed for o in s.text_offset] == whole.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == whole.token_logprobs


# ---------------------------------------------------------------------- robustness


def test_disconnect_mid_stream_aborts_and_frees_kv(servers):
    url = servers["slow"].url
    aborted = _metric(url, "longctx_requests_finished_total", '{finish_reason="abort"}')
    body = {"prompt": "A long one", "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for i, _ in enumerate(_sse_events(response)):
                if i == 5:
                    assert _metric(url, 'longctx_kv_pages_used{tier="device"}') > 0
                    break
    assert _wait_for(lambda: _metric(url, 'longctx_kv_pages_used{tier="device"}') == 0
                     and _metric(url, "longctx_num_requests_running") == 0)
    assert _metric(url, "longctx_requests_finished_total", '{finish_reason="abort"}') == aborted + 1
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    assert _wait_for(lambda: _metric(url, "longctx_requests_finished_total",
                                     '{finish_reason="abort"}') == aborted + 2)
    assert _wait_for(lambda: _metric(url, 'longctx_kv_pages_used{tier="device"}') == 0)


BAD_REQUESTS = [
    # (route, body (dict, or raw bytes), status, param, words the message must contain)
    ("completions", b'{"prompt": "x", "max_tokens": ', 400, None, "not valid JSON"),
    ("completions", b'["not", "an", "object"]', 400, None, "JSON object"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("completions", {"prompt": 3.5}, 400, "prompt", "token ids"),
    ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completions", {"prompt": [1, 2, 500]}, 400, "prompt", "[0, 160)"),
    ("completions", {"max_tokens": 4}, 400, "prompt", "required"),
    ("completions", {"prompt": "x", "n": 2}, 400, "n", "only n=1"),
    ("completions", {"prompt": "x", "stop": 7}, 400, "stop", "stop must be"),
    ("completions", {"prompt": "x", "stop": [f"s{i}" for i in range(2000)]}, 400, "stop",
     "stop has 2000 strings; at most 64"),
    ("completions", {"prompt": "x", "stop": ["y" * 4000]}, 400, "stop", "4000 characters; at most 1024"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", "valid integer"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty",
     "less than or equal to 2"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty",
     "greater than or equal to -2"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ("completions", {"prompt": "x", "repetition_penalty": "1.2"}, 400, "repetition_penalty", "valid number"),
    ("completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream: true"),
    ("completions", {"prompt": "x" * 2000}, 400, "prompt", "2000 tokens"),
    ("completions", {"prompt": "x" * 1000, "max_tokens": 100}, 400, "max_tokens", "1100 tokens"),
    ("completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate"),
    ("completions", b'{"prompt": "a", "stop": ["x\\udc00"]}', 400, "stop", "lone surrogate"),
    ("completions", b'{"prompt": "a", "temperature": 1e999}', 400, "temperature", "finite number"),
    ("completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature", "finite number"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "messages[0].content", "lone surrogate"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "user"),
    ("chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, 400,
     "messages[0].content", "only text"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     400, "max_completion_tokens", "greater than or equal to 1"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "needs logprobs: true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 21}, 400, "top_logprobs", "less than or equal to 20"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400,
     "logprobs", "valid boolean"),
]


@pytest.mark.parametrize("route,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_a_clear_4xx(server, route, body, status, param, words):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(f"{server.url}/v1/{route}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["code"], error  # (some were null)
    assert error["param"] == param
    assert words in error["message"], error["message"]


def test_huge_body_unknown_route_and_openai_errors(server, folder):
    huge = json.dumps({"prompt": "a" * (9 << 20)}).encode()
    response = httpx.post(server.url + "/v1/completions", content=huge,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    response = httpx.get(server.url + "/v1/nothing-here")
    assert response.status_code == 404 and "no route" in response.json()["error"]["message"]
    client = server.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.chat.completions.create(model=folder, messages=[{"role": "user", "content": "y" * 1100}])
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key(strict_server, slow_folder):
    url = strict_server.url
    assert httpx.get(url + "/health").status_code == 200  # open without a key
    assert httpx.get(url + "/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(url + "/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        strict_server.client("wrong").completions.create(model=slow_folder, prompt="x", max_tokens=2)
    out = strict_server.client(API_KEY).completions.create(model=slow_folder, prompt="x", max_tokens=2)
    assert out.usage.completion_tokens <= 2


def test_api_description_is_behind_the_key(strict_server, server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(strict_server.url + path).status_code == 401, path
        assert httpx.get(strict_server.url + path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert httpx.get(server.url + path).status_code == 200  # no key set: open, as before


@pytest.mark.parametrize("host, key, warns", [
    ("0.0.0.0", "", True), ("::", "", True), ("192.168.1.5", "", True), ("example.org", "", True),
    ("127.0.0.1", "", False), ("::1", "", False), ("localhost", "", False), ("0.0.0.0", "k", False)])
def test_a_public_bind_without_a_key_is_warned_about(host, key, warns):
    from longctx.entrypoints.server.launch import exposure_warning

    line = exposure_warning(host, key)
    assert (line is not None) == warns
    if warns:
        assert host in line and "--api-key" in line


def test_queue_full_gets_429_and_the_server_recovers(strict_server):
    url, auth = strict_server.url, {"Authorization": f"Bearer {API_KEY}"}
    long_body = {"prompt": "hold the slot", "max_tokens": 3000, "temperature": 0, "stream": True,
                 "ignore_eos": True}
    short_body = {"prompt": "wait in line", "max_tokens": 5, "temperature": 0, "stream": True,
                  "ignore_eos": True}
    with httpx.Client(timeout=30, headers=auth) as running, httpx.Client(timeout=30, headers=auth) as queued:
        with running.stream("POST", url + "/v1/completions", json=long_body) as first:
            first_events = _sse_events(first)  # kept: dropping the iterator closes the stream
            next(first_events)  # it holds the only running slot now
            with queued.stream("POST", url + "/v1/completions", json=short_body) as second:
                assert second.status_code == 200  # accepted: waits in the one queue place
                refused = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=auth)
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "rate_limit_exceeded"
                assert refused.headers["retry-after"] == "1"
                assert httpx.get(url + "/health").status_code == 200
                first.close()  # the running request goes away: the queued one runs
                events = list(_sse_events(second))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=auth, timeout=30)
    assert ok.status_code == 200
    assert _metric(url, "longctx_requests_rejected_total") == 1


def test_sigterm_drains_then_cancels_and_exits_0(servers):
    """After SIGTERM a short request still finishes; one that outlasts the grace period (10 s
    here; 4,000 tokens take the slow model about 25 s) ends with an error event; the process
    exits with code 0."""
    check_sigterm_drain(servers["sigterm"])


def check_sigterm_drain(server: "ServerProcess") -> None:
    """SIGTERM while a short and a long stream run: the short one ends normally, the long one
    with a ``server_shutting_down`` error event, and the process exits with code 0."""
    url = server.url + "/v1/completions"
    short = {"prompt": "last words", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True,
             "stream_options": {"include_usage": True}}
    long = {**short, "prompt": "never finishes", "max_tokens": 4000}
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b, \
            a.stream("POST", url, json=long) as long_response, \
            b.stream("POST", url, json=short) as short_response:
        long_events, short_events = _sse_events(long_response), _sse_events(short_response)
        next(long_events), next(short_events)
        server.proc.send_signal(signal.SIGTERM)
        short_rest, long_rest = list(short_events), list(long_events)
    assert server.proc.wait(30) == 0, server.output()[-3000:]
    assert short_rest[-1] == "[DONE]"  # ran to its end after the signal
    assert json.loads(short_rest[-3])["choices"][0]["finish_reason"] == "length"
    assert json.loads(short_rest[-2])["usage"]["completion_tokens"] == 40
    assert long_rest[-1] == "[DONE]"
    assert json.loads(long_rest[-2])["error"]["code"] == "server_shutting_down"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_cli_errors_are_one_line_exit_2(server, folder):
    port = server.url.rsplit(":", 1)[1]
    for flags, words in ((["--port", port], "Address already in use"),
                         (["--max-queued-requests", "-1"], "max_queued_requests must be >= 0")):
        done = subprocess.run([sys.executable, "-m", "longctx", "serve", "--model", folder, *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("longctx: error: ")
        assert words in done.stderr


# ---------------------------------------------------------------------- in process


def test_partial_stop_len():
    assert partial_stop_len("hello wor", ("world",)) == 3
    assert partial_stop_len("hello", ("world",)) == 0
    assert partial_stop_len("ab", ("abc", "bx")) == 2
    assert partial_stop_len("a", ("abc",)) == 1
    assert partial_stop_len("abc", ("abc",)) == 0  # a whole stop string is the engine's to cut
    assert partial_stop_len("abc", ()) == 0


def test_engine_failure_gives_503_and_unhealthy(folder):
    """A step that raises fails the requests in flight with a 503 naming the cause; /health
    turns 503 and new requests are refused rather than queued forever."""
    from fastapi.testclient import TestClient

    from longctx.config import split_engine_kwargs
    from longctx.engine.llm_engine import LLMEngine
    from longctx.entrypoints.server.app import create_app
    from longctx.entrypoints.server.config import ServerConfig
    from longctx.entrypoints.server.metrics import ServerMetrics

    engine = LLMEngine(*split_engine_kwargs({"model": folder, "block_size": 16, "num_blocks": 64}))

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.step = broken_step
    app = create_app(EngineLoop(engine, ServerMetrics(), 4), ServerConfig().resolved(folder))
    with TestClient(app) as client:  # in process: no socket at all
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert response.status_code == 503
        assert "simulated device failure" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        again = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"
