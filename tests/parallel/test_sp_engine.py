"""``LLM(sequence_parallel_size=N)`` on a tiny random Llama: the N ranks give exactly the
tokens of one rank (batched, chunked, with and without lookahead, seeded sampling, stop
strings, streaming, preemption, every prefix-store tier, summarize/ask), are started once and
never outlive the engine, and a rank that dies or hangs fails the engine with
``SequenceParallelError`` in bounded time.

Only one sequence-parallel LLM may exist in a process at a time (it owns the default process
group): every test closes its own before the next starts (``_no_process_group_left``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from tiny_models import make_engine_checkpoint

from longctx import LLM, SamplingParams
from longctx.engine.sp import SequenceParallelError

BLOCK = 16
VOCAB = 160  # tiny_models.BASE
TESTS = Path(__file__).resolve().parents[1]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def _repetitive(n: int, period: int, seed: int) -> list[int]:
    """``n`` ids repeating a random block of ``period``: the drafter finds continuations."""
    base = _tokens(period, seed)
    return (base * (n // period + 1))[:n]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts(ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ids]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-sp-engine")
    make_engine_checkpoint(path)
    return str(path)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """Each test starts and ends with no sequence-parallel LLM alive in this process."""
    assert not dist.is_initialized(), "a sequence-parallel LLM of an earlier test was not closed"
    yield
    assert not dist.is_initialized(), "this test left a sequence-parallel LLM open"


@contextmanager
def _llm(folder: str, sp: int, **kw):
    llm = LLM(folder, **{"block_size": BLOCK, "max_num_batched_tokens": 64,
                         "sequence_parallel_size": sp, **kw})
    try:
        yield llm
    finally:
        llm.close()


def _gone(pid: int, zombie_is_gone: bool) -> bool:
    """The process ``pid`` no longer runs. A zombie has exited but was not reaped: that counts
    only where its parent is not ours to blame (an orphan, reparented to init)."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return True
    return zombie_is_gone and status == psutil.STATUS_ZOMBIE


def _wait(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _python(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter that imports from the tests folder too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


# ---------------------------------------------------------------------- batches

MIXED = [_repetitive(30, 10, seed=1), _repetitive(200, 23, seed=2), _repetitive(333, 37, seed=3),
         _repetitive(517, 41, seed=4)]
MIXED_TOKENS = 24
_one_rank: dict[tuple, list] = {}


def _one_rank_outputs(folder: str, chunk: int, lookahead: bool) -> list:
    """The mixed batch on one rank with the same engine options (computed once per options)."""
    key = (chunk, lookahead)
    if key not in _one_rank:
        with _llm(folder, 1, max_num_batched_tokens=chunk, lookahead=lookahead) as llm:
            _one_rank[key] = llm.generate(_prompts(MIXED), _greedy(MIXED_TOKENS))
    return _one_rank[key]


# two ranks with lookahead in 64-token chunks and without in 256; three (an uneven split of the
# chunks) with lookahead and 64-token chunks; the rest under -m slow
@pytest.mark.parametrize("sp,chunk,lookahead", [
    pytest.param(sp, chunk, lookahead, id=f"{sp}-{chunk}-{'lookahead' if lookahead else 'no-lookahead'}",
                 marks=() if (chunk == 64 and lookahead) or (sp, chunk, lookahead) == (2, 256, False) else pytest.mark.slow)
    for sp in (2, 3) for chunk in (64, 256) for lookahead in (True, False)])
def test_mixed_batch_equals_one_rank(folder, sp, chunk, lookahead):
    expected = _one_rank_outputs(folder, chunk, lookahead)
    with _llm(folder, sp, max_num_batched_tokens=chunk, lookahead=lookahead) as llm:
        engine = llm.engine
        assert len(llm.engine.worker_pids()) == sp - 1
        assert engine.kv.num_blocks == sp * engine.kv.local.num_blocks  # pages of every rank
        outs = llm.generate(_prompts(MIXED), _greedy(MIXED_TOKENS))
        assert _ids(outs) == _ids(expected)
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in expected]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        accepted = [o.metrics.num_accepted_tokens for o in outs]
        if lookahead:  # drafts were verified across the ranks, and some were right
            assert sum(accepted) > 0 and accepted == [o.metrics.num_accepted_tokens for o in expected]
        else:
            assert accepted == [0, 0, 0, 0]
        assert not engine.has_unfinished()
        llm.clear_prefix_cache()  # cached pages are the only ones still held
        assert engine.kv_usage()["device"]["free"] == engine.kv_usage()["device"]["total"]


# ---------------------------------------------------------------------- one engine, many uses


@pytest.fixture(scope="module")
def one_rank(folder):
    """The single-process reference, with the options of ``TestOneEngine``'s engines."""
    with _llm(folder, 1) as llm:
        yield llm


@pytest.fixture(scope="class", params=[2, 3], ids=["sp2", "sp3"])
def sp_llm(request, folder):
    """One sequence-parallel engine per world size for all of ``TestOneEngine``."""
    assert not dist.is_initialized()
    with _llm(folder, request.param) as llm:
        llm.started_pids = list(llm.engine.worker_pids())
        yield llm


class TestOneEngine:
    """Several uses of one sequence-parallel engine per world size (started once per class
    parameter, closed when the class is done, before any other test runs)."""

    @pytest.fixture(autouse=True)
    def _no_process_group_left(self):  # the class's engine stays open between its tests
        yield

    def test_seeded_sampling_equals_one_rank(self, sp_llm, one_rank):
        prompts = _prompts([_tokens(40, seed=10), _tokens(150, seed=11), _repetitive(90, 9, seed=12)])
        params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2, 3)]
        got = _ids(sp_llm.generate(prompts, params))
        assert got == _ids(one_rank.generate(prompts, params))
        assert got == _ids(sp_llm.generate(prompts, params))  # the seed decides, not the run
        other = [SamplingParams(temperature=0.8, seed=s + 100, max_tokens=20, ignore_eos=True) for s in (1, 2, 3)]
        assert _ids(sp_llm.generate(prompts, other)) != got

    def test_stop_strings_equal_one_rank(self, sp_llm, one_rank):
        prompt = {"prompt_token_ids": _tokens(120, seed=20)}
        free = one_rank.generate(prompt, _greedy(30))[0].outputs[0]
        assert sp_llm.generate(prompt, _greedy(30))[0].outputs[0].text == free.text
        stop = free.text[6:8]  # two characters: two tokens of the char tokenizer
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop, "\x7f\x7f"])
        out = sp_llm.generate(prompt, params)[0].outputs[0]
        ref = one_rank.generate(prompt, params)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
        assert out.finish_reason == "stop" and out.text == free.text[: free.text.find(stop)]
        streamed = list(sp_llm.stream(prompt, params))
        assert "".join(d.text for d in streamed) == out.text
        assert streamed[-1].finish_reason == "stop"

    def test_stream_and_prefill_progress(self, sp_llm, one_rank):
        prompt = {"prompt_token_ids": _tokens(300, seed=30)}  # new to both engines: no cache hit
        expected = one_rank.generate(prompt, _greedy(16))[0].outputs[0]
        progress = []
        deltas = list(sp_llm.stream(prompt, _greedy(16), on_prefill_progress=lambda d, t: progress.append((d, t))))
        assert "".join(d.text for d in deltas) == expected.text
        assert [t for d in deltas for t in d.token_ids] == expected.token_ids
        assert progress == [(64, 300), (128, 300), (192, 300), (256, 300)]  # the chunks before sampling
        final = deltas[-1].output
        assert final is not None and final.finished and final.outputs[0].text == expected.text
        again = sp_llm.generate(prompt, _greedy(16))[0].outputs[0]  # from the prefix store now
        assert again.text == expected.text
        # generate reports progress too, per request
        seen = []
        prompts = _prompts([_tokens(130, seed=31), _tokens(70, seed=32)])
        sp_llm.generate(prompts, _greedy(4), on_prefill_progress=lambda d, t: seen.append((d, t)))
        for total in (130, 70):
            done = [d for d, t in seen if t == total]
            assert done and done == sorted(done) and len(set(done)) == len(done) and done[-1] < total

    def test_summarize_and_ask_equal_one_rank(self, sp_llm, one_rank):
        short = "A short note about cats and the dogs that chase them."
        got, ref = sp_llm.summarize(short, max_tokens=12), one_rank.summarize(short, max_tokens=12)
        assert not got.map_reduce and got.text == ref.text
        long = "\n\n".join(f"Paragraph {i}: " + "lorem ipsum " * 6 for i in range(20))  # > the window
        got, ref = sp_llm.summarize(long, max_tokens=12), one_rank.summarize(long, max_tokens=12)
        assert got.map_reduce and got.num_pieces == ref.num_pieces >= 2
        assert [s.text for s in got.steps] == [s.text for s in ref.steps] and got.text == ref.text
        doc = "\n\n".join(f"Section {i}: the value of item {i} is {i * 7}." for i in range(12))
        questions = ["What is item 3?", "How many sections?", "Which is last?"]
        got, ref = sp_llm.ask(doc, questions, max_tokens=8), one_rank.ask(doc, questions, max_tokens=8)
        assert [a.text for a in got.answers] == [a.text for a in ref.answers]
        assert got.shared_prefix_tokens == ref.shared_prefix_tokens > len(doc)

    def test_ranks_start_once_and_stay(self, sp_llm):
        pids = sp_llm.engine.worker_pids()
        assert pids == sp_llm.started_pids and len(pids) == sp_llm.sequence_parallel_size - 1
        for i in range(10):
            out = sp_llm.generate({"prompt_token_ids": _tokens(20 + 9 * i, seed=40 + i)}, _greedy(3))
            assert len(out[0].outputs[0].token_ids) == 3
            assert sp_llm.engine.worker_pids() == pids
        me = os.getpid()
        children = {p.pid for p in psutil.Process(me).children()}
        for pid in pids:
            proc = psutil.Process(pid)
            assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            assert proc.ppid() == me and pid in children


# ---------------------------------------------------------------------- the prefix store

DOC = _tokens(200, seed=1)  # 12 full pages of 16 and a partial one
QUESTION = _tokens(9, seed=2)


@pytest.fixture(scope="module")
def cold(folder):
    """Tokens of a cold single-process run (no prefix store)."""
    with _llm(folder, 1, enable_prefix_caching=False) as llm:
        return {"doc": _ids(llm.generate({"prompt_token_ids": DOC}, _greedy(10)))[0],
                "question": _ids(llm.generate({"prompt_token_ids": DOC + QUESTION}, _greedy(10)))[0]}


def _one(llm, prompt: list[int]) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, _greedy(10))[0].outputs[0].token_ids


def test_device_tier_hit_under_sp(folder, cold):
    with _llm(folder, 2) as llm:
        assert _one(llm, DOC) == cold["doc"]
        assert _one(llm, DOC + QUESTION) == cold["question"]
        stats = llm.cache_stats()
        assert stats.hit_tokens == {"device": 12 * BLOCK, "host": 0, "disk": 0}
        assert stats.computed_prompt_tokens == stats.prompt_tokens - 12 * BLOCK


def test_host_tier_hit_under_sp(folder, cold):
    # 10 pages per rank, 20 in all: the document (13 pages) and another (13) do not both fit
    with _llm(folder, 2, num_blocks=10, host_cache_gb=2.0) as llm:
        assert llm.engine.kv_usage()["device"]["total"] == 20
        assert _one(llm, DOC) == cold["doc"]
        _one(llm, _tokens(200, seed=9))  # pushes the document's pages (from both ranks) to the host
        assert llm.engine.prefix_cache.tree.num_host_pages >= 12 - (20 - 13 - 1)
        assert _one(llm, DOC + QUESTION) == cold["question"]  # pages copied back to their ranks
        hits = llm.cache_stats().hit_tokens
        assert hits["host"] > 0 and hits["device"] + hits["host"] == 12 * BLOCK


READ_DISK = """
import json, sys
from longctx import LLM, SamplingParams

def main():
    folder, runs = sys.argv[1], json.loads(sys.argv[2])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    report = []
    for disk, sp, prompt in runs:
        llm = LLM(folder, block_size=16, max_num_batched_tokens=64, sequence_parallel_size=sp,
                  disk_cache_dir=disk)
        ids = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        report.append({"ids": ids, "hits": llm.cache_stats().hit_tokens})
        llm.close()
    print(json.dumps(report))

if __name__ == "__main__":
    main()
"""


def test_disk_tier_pages_cross_between_rank_counts_and_processes(folder, cold, tmp_path):
    """Pages written by two ranks are read by a one-rank engine in another process, and pages
    written by one rank by a two-rank engine there."""
    dirs = {sp: tmp_path / f"written-by-sp{sp}" for sp in (1, 2)}
    for sp, disk in dirs.items():
        with _llm(folder, sp, disk_cache_dir=str(disk)) as llm:
            assert _one(llm, DOC) == cold["doc"]
        assert len(list(disk.glob("*/*.kvpage"))) == 13  # 200 prompt + 9 computed output tokens
    runs = [[str(dirs[2]), 1, DOC + QUESTION], [str(dirs[1]), 2, DOC + QUESTION]]
    done = _python(READ_DISK, folder, json.dumps(runs), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for got in report:
        assert got["ids"] == cold["question"]
        assert got["hits"] == {"device": 0, "host": 0, "disk": 12 * BLOCK}


# ---------------------------------------------------------------------- preemption


@pytest.mark.parametrize("sp", [2, 3])
def test_preemption_under_sp_equals_one_rank(folder, sp):
    prompts = _prompts([_tokens(n, seed=50 + n) for n in (90, 100, 110, 120)])
    params = _greedy(40)
    with _llm(folder, 1) as roomy:
        expected = _ids(roomy.generate(prompts, params))
    # 12 pages of 16 tokens over the ranks: each request alone fits (<= 10 pages), not all four
    with _llm(folder, sp, num_blocks=12 // sp) as tight:
        assert tight.engine.kv_usage()["device"]["total"] == 12
        got = _ids(tight.generate(prompts, params))
        assert tight.engine.stats()["preemptions"] > 0
        assert got == expected
        tight.clear_prefix_cache()
        assert tight.engine.kv_usage()["device"]["free"] == 12


# ---------------------------------------------------------------------- no orphan ranks


def test_close_ends_and_reaps_the_ranks(folder):
    llm = LLM(folder, block_size=BLOCK, sequence_parallel_size=3)
    pids = llm.engine.worker_pids()
    assert len(pids) == 2 and all(not _gone(p, zombie_is_gone=False) for p in pids)
    llm.generate({"prompt_token_ids": _tokens(50, seed=60)}, _greedy(3))
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 10
    assert _wait(lambda: all(_gone(p, zombie_is_gone=False) for p in pids), 5), \
        [(p, psutil.Process(p).status()) for p in pids if psutil.pid_exists(p)]
    llm.close()  # twice is harmless
    with pytest.raises(SequenceParallelError, match="shut down"):
        llm.generate({"prompt_token_ids": _tokens(50, seed=60)}, _greedy(3))


EXIT_WITHOUT_CLOSE = """
import os, sys, time
from longctx import LLM, SamplingParams

def main():
    llm = LLM(sys.argv[1], block_size=16, sequence_parallel_size=2)
    llm.generate({"prompt_token_ids": [5] * 40}, SamplingParams(temperature=0.0, max_tokens=3))
    print("PIDS", *llm.engine.worker_pids(), flush=True)
    if sys.argv[2] == "hang":  # wait to be killed
        time.sleep(600)
    # else: the interpreter exits with the LLM open

if __name__ == "__main__":
    main()
"""


def _ranks_printed(line: str) -> list[int]:
    assert line.startswith("PIDS"), line
    return [int(p) for p in line.split()[1:]]


def test_engine_process_ending_leaves_no_ranks(folder):
    """Two engine processes that never call close(): one exits normally (atexit, finalizers),
    one is killed with SIGKILL (nothing runs: only the ranks' watch on their parent). Both
    start at once, so their start-ups overlap."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    script = textwrap.dedent(EXIT_WITHOUT_CLOSE)
    procs = {how: subprocess.Popen([sys.executable, "-c", script, folder, how], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE if how == "exit" else subprocess.DEVNULL,
                                   text=True, env=env)
             for how in ("exit", "hang")}
    try:
        exiting, killed = procs["exit"], procs["hang"]
        pids = _ranks_printed(killed.stdout.readline())  # blocks until its engine runs
        assert len(pids) == 1 and not _gone(pids[0], zombie_is_gone=False)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        # orphans now (their zombies are init's to reap): they must have exited
        assert _wait(lambda: all(_gone(p, zombie_is_gone=True) for p in pids), 5), \
            [(p, psutil.Process(p).status()) for p in pids if psutil.pid_exists(p)]
        out, err = exiting.communicate(timeout=120)
        assert exiting.returncode == 0, err[-3000:]
        pids = _ranks_printed(out.strip().splitlines()[-1])
        assert len(pids) == 1
        assert _wait(lambda: all(_gone(p, zombie_is_gone=True) for p in pids), 5), \
            [(p, psutil.Process(p).status()) for p in pids if psutil.pid_exists(p)]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------- failed ranks


def _bounded(llm, call, timeout: float):
    """``call()`` in a thread: (its exception or None, seconds taken). Past ``timeout`` the
    test fails; the ranks are killed first so that the stuck call (and the test) can end."""
    box: dict = {}

    def run() -> None:
        start = time.monotonic()
        try:
            call()
            box["error"] = None
        except BaseException as err:  # noqa: BLE001
            box["error"] = err
        box["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for pid in llm.engine.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        thread.join(30)
        pytest.fail(f"the call still blocked after {timeout:.0f} s (sp_timeout_s="
                    f"{llm.configs[-1].sp_timeout_s}); it ended only once every rank was killed, "
                    f"with {box.get('error')!r}")
    return box["error"], box["elapsed"]


def _expect_failure(llm, call, what: str, within: float) -> tuple[SequenceParallelError, float]:
    """``call`` fails with a ``SequenceParallelError`` naming ``what`` within ``within`` s, the
    failed request is gone, and every later call fails at once with the same error. Returns
    the error and the seconds it took."""
    error, took = _bounded(llm, call, within + 30)
    assert isinstance(error, SequenceParallelError), repr(error)
    assert took < within, f"the failure took {took:.1f} s to surface"
    message = str(error)
    assert "sequence-parallel rank failed" in message and what in message, message
    assert not llm.engine.has_unfinished()  # the failed request was aborted
    for later in (lambda: llm.generate({"prompt_token_ids": [7] * 40}, _greedy(2)),
                  lambda: list(llm.stream({"prompt_token_ids": [7] * 40}, _greedy(2)))):
        again, elapsed = _bounded(llm, later, 30)
        assert isinstance(again, SequenceParallelError) and str(again) == message, repr(again)
        assert elapsed < 1.0
    return error, took


def _close_promptly(llm) -> None:
    pids = llm.engine.worker_pids()
    error, elapsed = _bounded(llm, llm.close, 30)
    assert error is None and elapsed < 15, (error, elapsed)
    assert _wait(lambda: all(_gone(p, zombie_is_gone=False) for p in pids), 5)


FAILURE_TIMEOUT_S = 8.0
DEATH_NOTICED_S = 4.0  # a dead rank is noticed at once, not when sp_timeout_s runs out


def _failing_llm(folder: str, sp: int, **kw) -> LLM:
    return LLM(folder, **{"block_size": BLOCK, "max_num_batched_tokens": 64, "sequence_parallel_size": sp,
                          "sp_timeout_s": FAILURE_TIMEOUT_S, **kw})


def test_rank_killed_between_requests(folder):
    llm = _failing_llm(folder, 2)
    try:
        prompt = {"prompt_token_ids": _tokens(150, seed=70)}
        llm.generate(prompt, _greedy(4))
        victim = llm.engine.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        assert _wait(lambda: _gone(victim, zombie_is_gone=True), 5)
        _expect_failure(llm, lambda: llm.generate(prompt, _greedy(20)), "rank 1 exited with code -9", DEATH_NOTICED_S)
    finally:
        _close_promptly(llm)


def test_rank_killed_between_two_steps_of_a_request(folder):
    llm = _failing_llm(folder, 3)
    try:
        victim = llm.engine.worker_pids()[1]  # rank 2

        def kill_after_first_chunk(done: int, total: int) -> None:
            if done == 64:
                os.kill(victim, signal.SIGKILL)
                _wait(lambda: _gone(victim, zombie_is_gone=True), 5)

        prompt = {"prompt_token_ids": _tokens(300, seed=71)}
        _expect_failure(llm, lambda: llm.generate(prompt, _greedy(20), on_prefill_progress=kill_after_first_chunk),
                        "rank 2 exited with code -9", DEATH_NOTICED_S)
    finally:
        _close_promptly(llm)


def test_rank_killed_inside_a_step(folder):
    """The rank dies while rank 0 is in the middle of a step's layers (between two layers'
    exchanges of the second prefill chunk): that step raises."""
    llm = _failing_llm(folder, 2)
    try:
        victim = llm.engine.worker_pids()[0]
        attention = llm.engine.runner.executor.attention
        forward, calls = attention.forward, []

        def dying_forward(layer_idx, *args, **kwargs):
            calls.append(layer_idx)
            if len(calls) == 4:  # the second step (two layers each), before its layer 1
                os.kill(victim, signal.SIGKILL)
                _wait(lambda: _gone(victim, zombie_is_gone=True), 5)
            return forward(layer_idx, *args, **kwargs)

        attention.forward = dying_forward
        prompt = {"prompt_token_ids": _tokens(300, seed=72)}
        _expect_failure(llm, lambda: llm.generate(prompt, _greedy(20)), "rank 1 exited with code -9", DEATH_NOTICED_S)
        assert calls == [0, 1, 0, 1]
    finally:
        _close_promptly(llm)


def test_hung_rank_trips_the_timeout(folder):
    """A rank that stops answering (alive, SIGSTOP) between requests: the next step fails once
    ``sp_timeout_s`` (3 s) has passed, not never."""
    llm = _failing_llm(folder, 2, sp_timeout_s=3)
    victim = llm.engine.worker_pids()[0]
    try:
        llm.generate({"prompt_token_ids": _tokens(100, seed=73)}, _greedy(3))
        os.kill(victim, signal.SIGSTOP)
        error, took = _expect_failure(
            llm, lambda: llm.generate({"prompt_token_ids": _tokens(100, seed=74)}, _greedy(20)), "", 25)
        assert "exited" not in str(error)  # nobody died: the exchange timed out
        assert took >= 2.5
    finally:
        try:
            os.kill(victim, signal.SIGKILL)  # works on a stopped process; ends the hang if any
        except ProcessLookupError:
            pass
        _close_promptly(llm)


def test_rank_killed_while_another_thread_generates(folder):
    """The failure reaches a ``generate`` running in another thread, which returns."""
    llm = _failing_llm(folder, 2, max_num_batched_tokens=16, lookahead=False)
    try:
        started = threading.Event()

        def kill_soon() -> None:
            assert started.wait(60)
            os.kill(llm.engine.worker_pids()[0], signal.SIGKILL)

        killer = threading.Thread(target=kill_soon, daemon=True)
        killer.start()
        _expect_failure(llm, lambda: llm.generate({"prompt_token_ids": _tokens(900, seed=75)}, _greedy(100),
                                                  on_prefill_progress=lambda d, t: started.set()),
                        "rank 1 exited with code -9", DEATH_NOTICED_S)
        killer.join(5)
    finally:
        _close_promptly(llm)


def test_start_up_has_its_own_deadline(folder, monkeypatch):
    """Issue 43 item 12: the ranks' start (spawn, imports, model, rendezvous) runs under
    ``sp_start_timeout_s``, not the step's ``sp_timeout_s`` (which bounded the rendezvous: under
    CPU contention the start failed with gloo's "Wait timeout"); once started, the groups time
    out as a step does. A 2 s step deadline is less than a worker's start takes here."""
    from longctx.engine import sp

    seen = []
    real = sp.init_distributed

    def spy(rank, world, init_method, backend=None, timeout_s=600.0, local_rank=None):
        seen.append(timeout_s)
        return real(rank, world, init_method, backend, timeout_s, local_rank)

    deadlines = []
    real_deadlines = sp.step_deadlines
    monkeypatch.setattr(sp, "init_distributed", spy)
    monkeypatch.setattr(sp, "step_deadlines", lambda t, group: (deadlines.append(t), real_deadlines(t, group)))
    llm = LLM(folder, block_size=BLOCK, max_num_batched_tokens=64, sequence_parallel_size=2, sp_timeout_s=2.0,
              sp_start_timeout_s=300.0)
    try:
        assert seen == [300.0]  # rank 0 joined under the start-up's deadline
        assert deadlines == [2.0]  # then the step's
        out = llm.generate({"prompt_token_ids": _tokens(40, seed=71)}, _greedy(4))[0].outputs[0]
        assert len(out.token_ids) == 4
    finally:
        llm.close()
