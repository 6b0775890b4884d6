"""KV tier moves off the scheduler, on a tiny random Llama: ``schedule()`` plans copies as
data and never copies or reads a file itself; a request whose prefix is read from disk waits
in its own state while other requests keep decoding; an aborted read writes nothing; and the
host tier exists on the CPU only when asked for."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.kv.disk_store import DiskKVStore
from longctx.kv.host_pool import HostKVPool
from longctx.kv.mover import DiskLoad, DiskSave, HostLoad, HostSave
from tiny_models import random_tokens

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_engine_folder):
    return tiny_engine_folder


def _tokens(n, seed):
    return random_tokens(n, seed, high=160)


DOC = _tokens(200, seed=1)  # 12 full pages of 16
QUESTION = _tokens(9, seed=2)


def _llm(folder, **kw):
    return LLM(folder, **{"block_size": BLOCK, "max_num_batched_tokens": 64, **kw})


def run_to_end(engine):
    """Step ``engine`` until every request is done; their final outputs by request id."""
    outputs = {}
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                outputs[update.request_id] = engine.release(update.request_id)
    return outputs


def _ids(llm, prompt, params=GREEDY):
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def cold(folder):
    llm = LLM(folder, block_size=BLOCK, enable_prefix_caching=False)
    return {"question": _ids(llm, DOC + QUESTION)}


@pytest.fixture
def persisted(folder, tmp_path):
    """A disk tier holding DOC's pages, written by an engine that is closed again."""
    llm = _llm(folder, disk_cache_dir=str(tmp_path))
    _ids(llm, DOC)
    llm.close()
    return str(tmp_path)


def pages_add_up(engine) -> bool:
    """Every device page is free, reserved, in use by a request or cached by the prefix
    store (none leaked)."""
    dev = engine.kv_usage()["device"]
    return dev["in_use"] + dev["cached"] + dev["free"] + dev["reserved"] == dev["total"]


def test_host_tier_only_when_asked_for_on_the_cpu(folder):
    assert "host" not in _llm(folder).engine.kv_usage()
    usage = _llm(folder, host_cache_gb=0.01).engine.kv_usage()
    assert usage["host"]["free"] > 0 and usage["host"]["cached"] == 0


def test_schedule_plans_copies_and_never_runs_them(folder, monkeypatch, tmp_path):
    llm = _llm(folder, num_blocks=20, host_cache_gb=2.0, disk_cache_dir=str(tmp_path))
    engine = llm.engine
    inside = threading.local()
    copies: list[str] = []

    def guard(name, original):
        def wrapped(*args, **kwargs):
            assert not getattr(inside, "on", False), f"{name} ran inside schedule()"
            copies.append(name)
            return original(*args, **kwargs)
        return wrapped

    for cls, name in [(HostKVPool, "write_back"), (HostKVPool, "load"), (HostKVPool, "pages"),
                      (DiskKVStore, "fetch"), (DiskKVStore, "write")]:
        monkeypatch.setattr(cls, name, guard(f"{cls.__name__}.{name}", getattr(cls, name)))
    original_schedule = engine.scheduler.schedule
    orders = []

    def schedule():
        inside.on = True
        try:
            batch = original_schedule()
        finally:
            inside.on = False
        orders.extend(batch.kv_orders)
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    _ids(llm, DOC)
    _ids(llm, _tokens(200, seed=9))  # evicts DOC's pages to the host tier
    _ids(llm, DOC + QUESTION)  # and loads them back
    assert any(isinstance(o, HostSave) for o in orders)
    assert any(isinstance(o, HostLoad) for o in orders)
    assert {"HostKVPool.write_back", "HostKVPool.load"} <= set(copies)  # they did run, outside
    assert llm.cache_stats().hit_tokens["host"] > 0


class SlowDisk:
    """Holds every disk page read until ``release``: a read that takes as long as the test
    wants."""

    def __init__(self, monkeypatch) -> None:
        self.gate = threading.Event()
        self.reads = 0
        original = DiskKVStore.fetch

        def fetch(store, key):
            self.reads += 1
            assert self.gate.wait(30), "the test never released the disk"
            return original(store, key)

        monkeypatch.setattr(DiskKVStore, "fetch", fetch)

    def release(self) -> None:
        self.gate.set()


def test_decode_goes_on_while_another_request_loads_from_disk(folder, cold, persisted, monkeypatch):
    llm = _llm(folder, disk_cache_dir=persisted)
    engine = llm.engine
    disk = SlowDisk(monkeypatch)
    stream = engine.add_request(_tokens(20, seed=5), SamplingParams(temperature=0.0, max_tokens=40,
                                                                    ignore_eos=True))
    engine.step()  # the stream's prefill and first token
    doc = engine.add_request(DOC + QUESTION, GREEDY)
    tokens_while_loading = 0
    for i in range(8):
        updates = {u.request_id: u for u in engine.step()}
        assert engine.request_state(doc) == "loading"
        assert doc not in updates  # nothing of it runs while its pages are read
        tokens_while_loading += len(updates[stream].new_token_ids)
        if i == 0:  # the read thread has the order; on a busy machine it may start late (once
            # past 8 steps beside two CPU burners): the next 7 steps run with a read held
            deadline = time.monotonic() + 120
            while disk.reads < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert disk.reads >= 1, "the disk read never started"
    assert tokens_while_loading >= 8  # one token (or more, with lookahead) every step
    disk.release()
    outputs = run_to_end(engine)
    assert outputs[doc].outputs[0].token_ids == cold["question"]
    assert llm.cache_stats().hit_tokens["disk"] == 12 * BLOCK
    assert len(outputs[stream].outputs[0].token_ids) == 40


def test_an_aborted_load_writes_nothing_and_frees_its_pages(folder, cold, persisted, monkeypatch):
    llm = _llm(folder, disk_cache_dir=persisted)
    engine = llm.engine
    disk = SlowDisk(monkeypatch)
    free_before = engine.kv_usage()["device"]["free"]
    doc = engine.add_request(DOC + QUESTION, GREEDY)
    engine.step()
    assert engine.request_state(doc) == "loading"
    assert engine.kv_usage()["device"]["in_use"] == 12  # the pages it reads into are its own
    assert engine.kv_usage()["device"]["free"] == free_before - 12
    writes = []
    monkeypatch.setattr(engine.kv_mover, "write_pages", lambda ids, pages: writes.append(ids))
    engine.abort(doc)
    assert engine.request_state(doc) is None and not engine.has_unfinished()
    assert engine.kv_usage()["device"]["free"] == free_before
    disk.release()
    engine.kv_mover.flush()
    engine.step()  # picks the finished read up, and drops it
    assert writes == [] and engine.kv_usage()["device"]["free"] == free_before
    monkeypatch.undo()
    assert _ids(llm, DOC + QUESTION) == cold["question"]


def test_a_bad_page_ends_the_disk_hit_and_frees_the_rest(folder, cold, persisted):
    llm = _llm(folder, disk_cache_dir=persisted)
    store = llm.engine.prefix_cache.disk
    from longctx.cache.radix_tree import page_hashes

    keys = page_hashes(DOC, llm.engine.prefix_cache.extra_key, BLOCK)
    payload = bytearray(store.path(keys[5]).read_bytes())
    payload[-1] ^= 0xFF
    store.path(keys[5]).write_bytes(bytes(payload))
    assert _ids(llm, DOC + QUESTION) == cold["question"]
    stats = llm.cache_stats()
    assert stats.hit_tokens["disk"] == 5 * BLOCK and stats.disk_misses == {"checksum": 1}
    assert pages_add_up(llm.engine) and llm.engine.kv_usage()["device"]["in_use"] == 0


def test_orders_are_plain_data():
    orders = [HostSave((1, 2), (0, 1)), HostLoad((0,), (5,)), DiskSave(("k",), (3,), "device")]
    for order in orders:
        assert all(isinstance(v, (tuple, str)) for v in vars(order).values())
    load = DiskLoad("r", ("a", "b"), (1, 2))
    assert load.num_read == 0 and load.buffer is None


def test_a_stale_read_of_a_reused_request_id_is_not_applied(folder, cold, persisted, monkeypatch):
    llm = _llm(folder, disk_cache_dir=persisted)
    engine = llm.engine
    disk = SlowDisk(monkeypatch)
    engine.add_request(DOC + QUESTION, GREEDY, request_id="doc")
    engine.step()
    assert engine.request_state("doc") == "loading"
    engine.abort("doc")
    engine.add_request(_tokens(40, seed=8), GREEDY, request_id="other")
    engine.step()  # "other" takes the lowest free blocks: the new read gets other ones
    engine.add_request(DOC + QUESTION, GREEDY, request_id="doc")  # the same id, a new read
    engine.step()
    assert engine.request_state("doc") == "loading"  # a new read (the first one was dropped)
    disk.release()
    outputs = run_to_end(engine)
    assert outputs["doc"].outputs[0].token_ids == cold["question"]
    assert pages_add_up(engine)  # the first read's blocks did not leak
    assert engine.kv_usage()["device"]["in_use"] == 0


def test_a_page_that_cannot_be_written_is_a_write_miss(tmp_path, monkeypatch):
    store = DiskKVStore(tmp_path, 1 << 30, (1, 2, 4, 1, 2), torch.float32)
    store.put("a" * 64, torch.ones(1, 2, 4, 1, 2))
    store.put("b" * 64, torch.ones(1, 2, 4, 1, 2))
    real_write = DiskKVStore.write

    def failing(self, key, page):
        if key.startswith("a"):
            raise OSError(28, "No space left on device")
        return real_write(self, key, page)

    monkeypatch.setattr(DiskKVStore, "write", failing)
    store.flush()  # does not raise, and goes past the bad page
    assert store.miss_counts() == {"write": 1}
    assert not store.contains("a" * 64) and store.contains("b" * 64) and store.num_written == 1
