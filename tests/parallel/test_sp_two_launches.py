"""Issue 43 item 13: sequence parallelism over two ``torchrun`` launches, as over two machines,
on one host: each launch is a node (``--nnodes 2 --nproc-per-node 1``) and they meet over a TCP
rendezvous on 127.0.0.1; the ranks exchange over gloo (the torchrun path has no shared-memory
board), and the only link between the launches is the network. Both tests run under ``-m slow``
(torchrun's ranks on one launch: test_sp_torchrun.py, in the default run).

* ``generate`` with the c10d rendezvous (docs/parallel.md's recipe; either launch may become
  rank 0): the text of one process.
* ``serve`` with the static rendezvous (``--node-rank 0`` is rank 0, the server): a completion
  equals one process's; a launch that stops answering mid-request turns ``/health`` 503 (its
  heartbeat, through the rendezvous store); once killed, the request in flight ends with an
  error event, new requests get 503, and the server still stops on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_server import ENGINE_FLAGS, _no_proxy, _wait_for, slow_folder  # noqa: F401 (fixtures)
from test_sp_liveness import _drain, _healthy_throughout, _unhealthy_within
from tiny_models import make_engine_checkpoint

from longctx import LLM, SamplingParams
from longctx.parallel.liveness import BEAT_STALE_S

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
THREADS = ["--num-threads", "1"]  # each launch thinks it has the host to itself: two ranks, two cores
START_S = 300  # both launches up (the machine may be busy)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(rendezvous: list[str], command: list[str], log: Path) -> subprocess.Popen:
    """One torchrun launch of one rank (a "machine"), its output into ``log``."""
    return subprocess.Popen([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", *rendezvous,
                             "-m", "longctx.entrypoints.torchrun", *command],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """A launch: its torchrun agent and the rank it started (in a session of its own)."""
    try:
        agent = psutil.Process(proc.pid)
        return [agent, *agent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow  # ranks from a rendezvous in the environment: test_sp_torchrun.py (torchrun's variables)
def test_two_launches_generate_the_one_process_text(tmp_path):
    make_engine_checkpoint(tmp_path)
    command = ["generate", PROMPT, "--model", str(tmp_path), "--block-size", "16", "--max-num-batched-tokens",
               "64", "--max-tokens", "12", "--ignore-eos", *THREADS]
    done = subprocess.run([sys.executable, "-m", "longctx.entrypoints.cli", *command], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = done.stdout.strip()
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    logs = [tmp_path / f"launch{n}.log" for n in (0, 1)]
    launches = [_launch(rendezvous, command, log) for log in logs]
    try:
        codes = [p.wait(START_S) for p in launches]
    finally:
        for p in launches:
            _kill(_tree(p))
    outputs = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "\n=====\n".join(o[-3000:] for o in outputs)
    printed = [o for o in outputs if expected in o.splitlines()]
    assert len(printed) == 1 and len(expected) > 0, outputs  # rank 0 printed it, the other rank nothing


LONG = {"prompt": "A long one", "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}


def _server_url(launch: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert launch.poll() is None, log.read_text(errors="replace")[-3000:]
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
        if found:
            try:
                if httpx.get(found.group(1) + "/health", timeout=5).status_code == 200:
                    return found.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    pytest.fail(f"the server did not come up in {START_S} s:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.mark.slow  # waits out heartbeats (~35 s); dead and hung ranks: test_sp_failures.py, test_sp_liveness.py
def test_lost_launch_fails_the_request_and_health(slow_folder, tmp_path):
    expected = LLM(slow_folder, block_size=16, num_blocks=256, max_num_batched_tokens=256, lookahead=False)
    try:
        text = expected.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    finally:
        expected.close()
    port = _free_port()
    command = ["serve", "--model", slow_folder, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
               *ENGINE_FLAGS, *THREADS, "--no-lookahead", "--max-num-seqs", "1", "--sp-timeout-s", "100"]
    logs = [tmp_path / f"launch{n}.log" for n in (0, 1)]
    launches = [_launch(["--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port)],
                        command, logs[n]) for n in (0, 1)]
    everything: list[psutil.Process] = []
    try:
        url = _server_url(launches[0], logs[0])
        everything = _tree(launches[0]) + _tree(launches[1])
        out = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": PROMPT, "max_tokens": 16,
                                                                     "temperature": 0, "ignore_eos": True})
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == text, out.text
        _healthy_throughout(url, BEAT_STALE_S + 2)  # the other launch's heartbeats arrive

        second = _tree(launches[1])
        assert len(second) == 2, second  # the agent and its rank
        events: list[str] = []
        with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            reader = threading.Thread(target=_drain, args=(response, events), daemon=True)
            reader.start()
            assert _wait_for(lambda: len(events) >= 5, 60)
            second[1].send_signal(signal.SIGSTOP)  # the rank stops answering: the step waits for it
            _, message = _unhealthy_within(url, BEAT_STALE_S + 15)
            assert message.startswith("sequence-parallel rank 1 has sent no heartbeat for "), message
            assert reader.is_alive()  # the request is still waiting (sp_timeout_s is 100 s)
            killed = time.monotonic()
            _kill(second)  # the "machine" is gone
            reader.join(60)
            ended = time.monotonic() - killed
        assert not reader.is_alive() and ended < 30, f"the stream did not end within {ended:.0f} s"
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "SequenceParallelError" in error["message"], error
        again = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        launches[0].send_signal(signal.SIGTERM)  # the broken server still stops
        launches[0].wait(60)
    finally:
        for p in launches:
            _kill(_tree(p))
        for p in launches:
            p.wait(30)
    gone, alive = psutil.wait_procs(everything, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
