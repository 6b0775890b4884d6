"""The disk KV tier when the disk misbehaves (issue 43), on a tiny random Llama and on bare
stores: a page file that blocks (a FIFO, a stalled mount) costs one deadline and never hangs
a request, /health or shutdown; pages are authenticated (HMAC under a key outside the folder),
so a page rewritten with a fresh hash is not served; one bad page quarantines the rest of its
chain, so one run repairs a folder damaged throughout; and the size budget holds across
processes and is enforced when a store opens the folder.

Deadlines in these tests are seconds and the bounds they are checked against are a minute:
what is checked is that nothing waits on the disk without end, not how fast it gives up."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.cache.radix_tree import page_hashes
from longctx.config import CacheConfig, ConfigError
from longctx.kv import disk_store
from longctx.kv.disk_store import DiskKVStore
from test_server import _wait_for
from tiny_models import random_tokens

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
DOC = random_tokens(200, seed=1, high=160)  # 12 full pages of 16
QUESTION = random_tokens(9, seed=2, high=160)
SHAPE = (2, 2, 4, 1, 3)  # bare stores' pages
HANG_S = 60.0  # what would count as a hang


def _llm(folder, **kw):
    return LLM(folder, **{"block_size": BLOCK, "max_num_batched_tokens": 64, **kw})


def _ids(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids


def _store(folder, budget=1 << 20, **kw):
    return DiskKVStore(folder, budget, SHAPE, torch.float32, **kw)


def _key(i) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _page(value) -> torch.Tensor:
    return torch.full(SHAPE, float(value))


@pytest.fixture(scope="module")
def cold(tiny_engine_folder):
    llm = LLM(tiny_engine_folder, block_size=BLOCK, enable_prefix_caching=False)
    return _ids(llm, DOC + QUESTION)


@pytest.fixture
def persisted(tiny_engine_folder, tmp_path):
    """A disk tier holding DOC's pages (and the page its output ends), and DOC's page keys."""
    llm = _llm(tiny_engine_folder, disk_cache_dir=str(tmp_path))
    _ids(llm, DOC)
    llm.close()
    return str(tmp_path), page_hashes(DOC, llm.engine.prefix_cache.extra_key, BLOCK)


# ---------------------------------------------------------------------- deadlines


def test_a_fifo_in_a_pages_place_is_a_miss_and_the_engine_closes(tiny_engine_folder, cold, persisted):
    """A FIFO opens without blocking and is refused as not a regular file: a miss, at once
    (it used to block the read, the request and ``close`` for good)."""
    folder, keys = persisted
    llm = _llm(tiny_engine_folder, disk_cache_dir=folder)
    fifo = llm.engine.prefix_cache.disk.path(keys[3])
    fifo.unlink()
    os.mkfifo(fifo, 0o600)
    out = {}

    def run():
        out["ids"] = _ids(llm, DOC + QUESTION)
        llm.close()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_S)
    if worker.is_alive():  # a reader blocked in the FIFO: free it so the test can end
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        worker.join(HANG_S)
        pytest.fail(f"a FIFO page file held the request for more than {HANG_S:g} s")
    assert out["ids"] == cold
    stats = llm.cache_stats()
    assert stats.hit_tokens["disk"] == 3 * BLOCK and stats.disk_misses == {"special": 1}
    assert stat.S_ISREG(os.lstat(fifo).st_mode)  # quarantined, removed, and the page written anew


def test_a_read_stuck_past_the_deadline_is_a_timeout_and_nothing_waits_for_it(
        tiny_engine_folder, cold, persisted, monkeypatch):
    """A read that never returns (a stalled network mount) is a miss after ``disk_timeout_s``;
    the tier reports itself stalled and refuses the disk at once while the read is stuck, so
    the request and ``close`` go on; once the read returns the tier is back, degraded."""
    folder, keys = persisted
    llm = _llm(tiny_engine_folder, disk_cache_dir=folder, disk_timeout_s=2)
    engine = llm.engine
    stuck = engine.prefix_cache.disk.path(keys[3])
    gate = threading.Event()
    read = disk_store.read_regular_file

    def stalled_mount(path, max_bytes):
        if path == stuck:
            gate.wait(HANG_S)
        return read(path, max_bytes)

    monkeypatch.setattr(disk_store, "read_regular_file", stalled_mount)
    began = time.monotonic()
    try:
        ids = _ids(llm, DOC + QUESTION)
        llm.close()  # its writes are refused at once: the tier is stalled
        elapsed = time.monotonic() - began
        during = engine.disk_state()
    finally:
        gate.set()
    assert ids == cold and elapsed < HANG_S / 2
    assert during["state"] == "stalled" and during["stuck_io"] == 1 and during["timeouts"] == 1
    stats = llm.cache_stats()
    assert stats.hit_tokens["disk"] == 3 * BLOCK and stats.disk_misses["timeout"] == 1
    assert stats.disk_quarantined == 9  # the page that timed out and the 8 chained after it in the read
    assert _wait_for(lambda: engine.disk_state()["stuck_io"] == 0, HANG_S)
    assert engine.disk_state()["state"] == "degraded"


def test_health_and_metrics_show_the_disk_tier(tiny_engine_folder, tmp_path):
    """/health carries the disk tier's state and stays 200 while it is stalled (a cache tier:
    its misses are recomputed); /metrics has its gauges; requests are served meanwhile."""
    from fastapi.testclient import TestClient

    from longctx.config import split_engine_kwargs
    from longctx.engine.llm_engine import LLMEngine
    from longctx.entrypoints.server.app import create_app
    from longctx.entrypoints.server.config import ServerConfig
    from longctx.entrypoints.server.engine_loop import EngineLoop
    from longctx.entrypoints.server.metrics import ServerMetrics
    from longctx.kv.disk_io import DiskTimeout

    engine = LLMEngine(*split_engine_kwargs({"model": tiny_engine_folder, "block_size": 16, "num_blocks": 64,
                                             "disk_cache_dir": str(tmp_path), "disk_timeout_s": 1}))
    app = create_app(EngineLoop(engine, ServerMetrics(), 4), ServerConfig().resolved(tiny_engine_folder))
    io = engine.prefix_cache.disk.io
    gate = threading.Event()
    try:
        with TestClient(app) as client:
            assert client.get("/health").json()["disk"]["state"] == "ok"
            op = io.start(gate.wait, HANG_S)  # an operation on a mount that stopped answering
            with pytest.raises(DiskTimeout):
                io.wait(op)
            health = client.get("/health")
            assert health.status_code == 200
            assert {k: health.json()["disk"][k] for k in ("state", "stuck_io", "timeouts")} == {
                "state": "stalled", "stuck_io": 1, "timeouts": 1}
            assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 200
            text = client.get("/metrics").text
            assert 'longctx_disk_tier_state{state="stalled"} 1.0' in text
            assert 'longctx_disk_tier_state{state="ok"} 0.0' in text
            assert "longctx_disk_io_stuck 1.0" in text and "longctx_disk_io_timeouts 1.0" in text
            gate.set()
            assert _wait_for(lambda: client.get("/health").json()["disk"]["state"] == "degraded", HANG_S)
    finally:
        gate.set()
        engine.close()


def test_disk_timeout_must_be_positive():
    for bad in (0, -1.0, float("inf"), "10"):
        with pytest.raises(ConfigError, match="disk_timeout_s must be a positive number"):
            CacheConfig(disk_timeout_s=bad)
    assert CacheConfig().disk_timeout_s == 10.0


# ---------------------------------------------------------------------- authentication


def _old_format_file(key: str, payload: bytes, shape=SHAPE) -> bytes:
    """A page as version 2 stored it: protected by a plain SHA-256 that anyone can recompute."""
    header = json.dumps({"key": key, "dtype": "float32", "shape": list(shape), "nbytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return b"LCKVPAGE2\n" + struct.pack("<I", len(header)) + header + payload


def _plain_hash_file(key: str, payload: bytes, shape=SHAPE) -> bytes:
    """A page in today's layout whose HMAC slot holds a plain SHA-256: forged without the key."""
    header = json.dumps({"key": key, "dtype": "float32", "shape": list(shape), "nbytes": len(payload)}).encode()
    body = struct.pack("<I", len(header)) + header + payload
    return disk_store.MAGIC + hashlib.sha256(disk_store.MAGIC + body).digest() + body


def test_a_page_rewritten_without_the_key_is_not_served(tmp_path):
    store = _store(tmp_path)
    key, forged = _key(0), _page(7).numpy().tobytes()
    store.write(key, _page(1))
    store.path(key).write_bytes(_old_format_file(key, forged))  # the old layout, hash recomputed
    assert store.read(key) is None
    store.write(key, _page(1))
    store.path(key).write_bytes(_plain_hash_file(key, forged))
    assert store.read(key) is None
    store.write(key, _page(1))
    store.write(_key(1), _page(7))
    os.replace(store.path(_key(1)), store.path(key))  # a genuine page under another page's name
    assert store.read(key) is None
    assert store.misses == {"old": 1, "checksum": 1, "header": 1}
    assert not store.path(key).exists()


def test_a_forged_page_never_reaches_a_request(tiny_engine_folder, cold, persisted):
    folder, keys = persisted
    llm = _llm(tiny_engine_folder, disk_cache_dir=folder)
    store = llm.engine.prefix_cache.disk
    zeros = torch.zeros(store.page_shape).numpy().tobytes()  # (float32 KV)
    store.path(keys[5]).write_bytes(_plain_hash_file(keys[5], zeros, store.page_shape))
    store.path(keys[8]).write_bytes(_old_format_file(keys[8], zeros, store.page_shape))
    assert _ids(llm, DOC + QUESTION) == cold
    stats = llm.cache_stats()
    assert stats.hit_tokens["disk"] == 5 * BLOCK and stats.disk_misses == {"checksum": 1}


def test_a_key_file_others_can_read_or_inside_the_cache_is_refused(tmp_path):
    key = tmp_path / "disk.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match=r"can be read or changed by other users \(mode 0644\): chmod 600"):
        _store(tmp_path / "kv", key_file=str(key))
    key.chmod(0o600)
    (tmp_path / "kv").mkdir()
    inside = tmp_path / "kv" / "disk.key"
    inside.write_bytes(os.urandom(32))
    inside.chmod(0o600)
    with pytest.raises(ConfigError, match="is inside disk_cache_dir"):
        _store(tmp_path / "kv", key_file=str(inside))
    short = tmp_path / "short.key"
    short.write_bytes(b"secret")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="holds 6 bytes; a key needs at least 32"):
        _store(tmp_path / "kv", key_file=str(short))
    mine = _store(tmp_path / "kv", key_file=str(key))
    mine.write(_key(0), _page(1))
    assert torch.equal(_store(tmp_path / "kv", key_file=str(key)).read(_key(0)), _page(1))
    assert _store(tmp_path / "kv").read(_key(0)) is None  # the default key is another key


def test_a_bad_key_file_is_one_line_from_the_engine(tiny_engine_folder, tmp_path):
    key = tmp_path / "disk.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o640)
    with pytest.raises(ConfigError) as info:
        _llm(tiny_engine_folder, disk_cache_dir=str(tmp_path / "kv"), disk_cache_key_file=str(key))
    assert "\n" not in str(info.value) and "chmod 600" in str(info.value)


def test_the_default_key_is_made_once_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = _store(tmp_path / "kv")
    key = tmp_path / "config" / "longctx" / "disk-cache.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    assert len(key.read_bytes()) == 32
    first.write(_key(0), _page(3))
    assert torch.equal(_store(tmp_path / "kv").read(_key(0)), _page(3))  # the next store reads it back


# ---------------------------------------------------------------------- damaged files and chains


def test_a_folder_damaged_throughout_is_repaired_in_one_run(tiny_engine_folder, cold, persisted):
    """Every page of the document damaged: the read stops at the first, quarantines the pages
    chained after it, and the run writes them all anew (it used to repair one page per run)."""
    folder, keys = persisted
    llm = _llm(tiny_engine_folder, disk_cache_dir=folder)
    damaged = {}
    for key in keys:
        path = llm.engine.prefix_cache.disk.path(key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        damaged[key] = bytes(data)
    assert _ids(llm, DOC + QUESTION) == cold
    llm.close()
    store = llm.engine.prefix_cache.disk
    assert all(store.path(k).read_bytes() != damaged[k] for k in keys)  # every one rewritten
    again = _llm(tiny_engine_folder, disk_cache_dir=folder)
    assert _ids(again, DOC + QUESTION) == cold
    # every page of the prompt but its last token's: the document's and the one the first run wrote for
    # the question
    assert again.cache_stats().hit_tokens["disk"] == (len(keys) + 1) * BLOCK
    assert again.cache_stats().disk_misses == {}
    stats = llm.cache_stats()
    assert stats.hit_tokens["disk"] == 0 and stats.disk_misses == {"checksum": 1}
    assert stats.disk_quarantined == len(keys)  # the first page and the 11 chained after it


def test_a_header_too_deep_for_the_json_parser_is_a_counted_miss(tmp_path):
    """json.loads raises RecursionError, not ValueError, on b"[" * 50_000: a miss like any
    corrupted header, and the file removed (it used to escape as an exception)."""
    store = _store(tmp_path)
    payload = _page(0).numpy().tobytes()
    files = {  # key: (file, its miss)
        _key(0): (b"LCKVPAGE3\n" + bytes(32) + struct.pack("<I", 50_000) + b"[" * 50_000 + payload, "corrupted"),
        _key(1): (b"LCKVPAGE3\n" + bytes(32) + struct.pack("<I", 100_000) + b"[" * 100_000 + payload,
                  "truncated"),  # a header past MAX_HEADER is not parsed at all
        _key(2): (b"LCKVPAGE2\n" + struct.pack("<I", 50_000) + b"[" * 50_000 + payload, "old"),
    }
    for key, (data, _) in files.items():
        store.path(key).parent.mkdir(mode=0o700, exist_ok=True)
        store.path(key).write_bytes(data)
        assert store.read(key) is None
        assert not store.path(key).exists()
    assert store.misses == {"corrupted": 1, "truncated": 1, "old": 1}


# ---------------------------------------------------------------------- the budget

WRITER = """
import sys, time, hashlib
from pathlib import Path
import torch
from longctx.kv.disk_store import DiskKVStore

folder, budget, name, n = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = DiskKVStore(folder, budget, (2, 2, 4, 1, 3), torch.float32)
(folder.parent / f"ready-{name}").touch()
while len(list(folder.parent.glob("ready-*"))) < 2:  # start writing together
    time.sleep(0.01)

def folder_bytes():
    total = 0
    for page in folder.glob("*/*.kvpage"):
        try:
            total += page.stat().st_size
        except FileNotFoundError:
            pass
    return total

most = 0
for i in range(n):
    store.write(hashlib.sha256(f"{name}{i}".encode()).hexdigest(), torch.full((2, 2, 4, 1, 3), float(i)))
    most = max(most, folder_bytes())
print(most)
"""


def test_two_processes_sharing_a_folder_stay_within_its_budget(tmp_path):
    probe = _store(tmp_path / "probe")
    probe.write(_key(0), _page(0))
    page = probe.path(_key(0)).stat().st_size
    budget = 6 * page
    folder = tmp_path / "shared" / "kv"
    folder.mkdir(parents=True)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(budget), name, "40"],
                                stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    most = [int(w.communicate(timeout=300)[0]) for w in writers]
    assert all(w.returncode == 0 for w in writers)
    assert max(most) <= budget + page  # at most the page of whoever holds the folder's lock
    assert sum(p.stat().st_size for p in folder.glob("*/*.kvpage")) <= budget


def test_two_stores_writing_in_turn_hold_one_budget(tmp_path):
    """In turn, deterministically: each store's writes count for the other's trims."""
    first = _store(tmp_path)
    first.write(_key(0), _page(0))
    page = first.path(_key(0)).stat().st_size
    stores = [_store(tmp_path, budget=6 * page), _store(tmp_path, budget=6 * page)]
    for i in range(1, 21):
        stores[i % 2].write(_key(i), _page(i))
        assert sum(p.stat().st_size for p in tmp_path.glob("*/*.kvpage")) <= 6 * page
    assert sorted(p.stem for p in tmp_path.glob("*/*.kvpage")) == sorted(_key(i) for i in range(15, 21))


def test_an_over_budget_folder_is_trimmed_at_open_by_recency_all_processes_see(tmp_path):
    keys = [_key(i) for i in range(8)]
    big = _store(tmp_path)
    for i, key in enumerate(keys):
        big.write(key, _page(i))
    size = big.path(keys[0]).stat().st_size
    assert big.read(keys[0]) is not None  # read: now the most recently used, for every store
    reader = _store(tmp_path, budget=3 * size)  # opens the folder and never writes
    assert sorted(p.stem for p in tmp_path.glob("*/*.kvpage")) == sorted([keys[0], keys[6], keys[7]])
    assert reader.num_pages == 3
    writer = _store(tmp_path, budget=3 * size)
    assert reader.read(keys[6]) is not None  # another store's read counts for the writer's trim
    writer.write(_key(8), _page(8))
    assert sorted(p.stem for p in tmp_path.glob("*/*.kvpage")) == sorted([keys[0], keys[6], _key(8)])
