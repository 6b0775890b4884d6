"""The prefix store on a tiny random Llama: hits on the device, host and disk tiers give the
tokens of a cold run, bad disk files are misses, cache-aware admission, and no page leaks."""

from __future__ import annotations

import os

import random

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.cache.radix_tree import page_hashes
from longctx.kv.disk_store import DiskKVStore
from tiny_models import make_engine_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-prefix")
    make_engine_checkpoint(path)
    return str(path)


def _tokens(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 160, (n,), generator=gen).tolist()


DOC = _tokens(200, seed=1)  # 12 full pages of 16 and a partial one
QUESTION = _tokens(9, seed=2)


def _ids(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def cold(folder):
    llm = LLM(folder, block_size=BLOCK, enable_prefix_caching=False)
    return {"doc": _ids(llm, DOC), "question": _ids(llm, DOC + QUESTION)}


def _llm(folder, **kw):
    return LLM(folder, **{"block_size": BLOCK, "max_num_batched_tokens": 64, **kw})


# ---------------------------------------------------------------------- the disk store

def _store(tmp_path, budget=1 << 20):
    return DiskKVStore(tmp_path, budget, (2, 2, 4, 1, 3), torch.float32)


def test_disk_store_files_are_private(tmp_path):
    """Issue 43 item 3 (in part): folders 0700, files 0600 whatever the umask (they were 0755 /
    0644, readable by every local user)."""
    old = os.umask(0o002)
    try:
        store = _store(tmp_path / "cache")
        store.write("ab" * 32, torch.randn(2, 2, 4, 1, 3))
    finally:
        os.umask(old)
    page = store.path("ab" * 32)
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    assert page.parent.stat().st_mode & 0o777 == 0o700
    assert page.stat().st_mode & 0o777 == 0o600


def test_disk_store_removes_a_dead_writers_temporary_files(tmp_path):
    """Issue 43 item 6 (in part): a write killed midway leaves ``.<name>.<pid>.tmp``; a store
    opening the folder removes it when that pid is gone, and keeps a live writer's."""
    import subprocess
    import sys

    sub = tmp_path / "ab"
    sub.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = sub / f".{'ab' * 32}.kvpage.{dead}.tmp"
    live = sub / f".{'cd' * 32}.kvpage.{os.getpid()}.tmp"
    stale.write_bytes(b"half a page")
    live.write_bytes(b"being written")
    store = _store(tmp_path)
    assert not stale.exists() and live.exists() and store.num_stale_tmp_removed == 1


def test_disk_store_round_trip_and_layout_checks(tmp_path):
    store = _store(tmp_path)
    page = torch.randn(2, 2, 4, 1, 3)
    store.write("ab" * 32, page)
    assert torch.equal(store.read("ab" * 32), page)
    assert store.contains("ab" * 32) and not store.contains("cd" * 32)
    with pytest.raises(ValueError, match="does not match"):
        store.write("ef" * 32, torch.randn(2, 2, 4, 1, 4))
    other = DiskKVStore(tmp_path, 1 << 20, (2, 2, 4, 1, 3), torch.float16)  # another dtype
    assert other.read("ab" * 32) is None and other.misses["another"] == 1


@pytest.mark.parametrize("damage,reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-4] + b"\0\0\0\1"), "checksum"),
    (lambda p: p.write_bytes(b"garbage"), "truncated"),
    (lambda p: p.unlink(), "missing"),
])
def test_damaged_files_are_misses(tmp_path, damage, reason):
    store = _store(tmp_path)
    store.write("ab" * 32, torch.randn(2, 2, 4, 1, 3))
    damage(store.path("ab" * 32))
    assert store.read("ab" * 32) is None
    assert store.misses[reason] == 1
    assert not store.path("ab" * 32).exists()  # a damaged file is removed, not read again


def test_disk_budget_drops_least_recently_used(tmp_path):
    one = _store(tmp_path).path("00" * 32)
    store = _store(tmp_path)
    store.write("00" * 32, torch.zeros(2, 2, 4, 1, 3))
    size = one.stat().st_size
    store = DiskKVStore(tmp_path, 3 * size, (2, 2, 4, 1, 3), torch.float32)  # found on disk
    assert store.num_pages == 1
    for i in (1, 2):
        store.write(f"{i:02d}" * 32, torch.full((2, 2, 4, 1, 3), float(i)))
    assert store.read("00" * 32) is not None  # now the most recently used
    store.write("03" * 32, torch.ones(2, 2, 4, 1, 3))
    assert not store.contains("01" * 32)  # the least recently used went
    assert all(store.contains(f"{i:02d}" * 32) for i in (0, 2, 3))


# ---------------------------------------------------------------------- tiers through the engine

def test_device_hit_equals_cold_run(folder, cold):
    llm = _llm(folder)
    assert _ids(llm, DOC) == cold["doc"]
    assert _ids(llm, DOC + QUESTION) == cold["question"]
    stats = llm.cache_stats()
    assert stats.hit_tokens == {"device": 12 * BLOCK, "host": 0, "disk": 0}
    assert stats.prompt_tokens == 2 * len(DOC) + len(QUESTION)
    assert stats.computed_prompt_tokens == stats.prompt_tokens - 12 * BLOCK


def test_host_hit_after_device_eviction_equals_cold_run(folder, cold):
    llm = _llm(folder, num_blocks=20, host_cache_gb=2.0)  # the document (13 pages) and another (13) don't both fit
    assert _ids(llm, DOC) == cold["doc"]
    _ids(llm, _tokens(200, seed=9))  # pushes the document's pages to the host tier
    cache = llm.engine.prefix_cache
    assert cache.tree.num_host_pages >= 12 - (20 - 13 - 1)
    assert _ids(llm, DOC + QUESTION) == cold["question"]
    hits = llm.cache_stats().hit_tokens
    assert hits["host"] > 0 and hits["device"] + hits["host"] == 12 * BLOCK


def test_no_host_tier_means_evicted_pages_are_recomputed(folder, cold):
    llm = _llm(folder, num_blocks=20, host_cache_gb=0.0)
    _ids(llm, DOC)
    _ids(llm, _tokens(200, seed=9))
    assert _ids(llm, DOC + QUESTION) == cold["question"]
    assert llm.cache_stats().hit_tokens["host"] == 0


def test_disk_hit_in_a_new_engine_equals_cold_run(folder, cold, tmp_path):
    first = _llm(folder, disk_cache_dir=str(tmp_path))
    assert _ids(first, DOC) == cold["doc"]
    first.close()
    assert len(list(tmp_path.glob("*/*.kvpage"))) == 13  # 200 prompt + 9 computed output tokens
    second = _llm(folder, disk_cache_dir=str(tmp_path))
    assert _ids(second, DOC + QUESTION) == cold["question"]
    assert second.cache_stats().hit_tokens == {"device": 0, "host": 0, "disk": 12 * BLOCK}


def test_disk_pages_of_another_salt_or_dtype_are_not_used(folder, tmp_path):
    first = _llm(folder, disk_cache_dir=str(tmp_path))
    first.generate({"prompt_token_ids": DOC, "cache_salt": "alice"}, GREEDY)
    first.close()
    second = _llm(folder, disk_cache_dir=str(tmp_path))
    second.generate({"prompt_token_ids": DOC, "cache_salt": "bob"}, GREEDY)
    second.generate({"prompt_token_ids": DOC}, GREEDY)
    assert second.cache_stats().hit_tokens["disk"] == 0
    third = _llm(folder, disk_cache_dir=str(tmp_path), dtype="bfloat16")
    third.generate({"prompt_token_ids": DOC, "cache_salt": "alice"}, GREEDY)
    assert third.cache_stats().hit_tokens["disk"] == 0


def test_damaged_disk_files_are_reported_misses_with_correct_output(folder, cold, tmp_path):
    first = _llm(folder, disk_cache_dir=str(tmp_path))
    _ids(first, DOC)
    first.close()
    store = first.engine.prefix_cache.disk
    keys = page_hashes(DOC, first.engine.prefix_cache.extra_key, BLOCK)
    store.path(keys[3]).write_bytes(store.path(keys[3]).read_bytes()[:-100])  # truncated
    payload = bytearray(store.path(keys[7]).read_bytes())
    payload[-1] ^= 0xFF  # one flipped byte
    store.path(keys[7]).write_bytes(bytes(payload))
    store.path(keys[10]).unlink()  # deleted

    def run():
        llm = _llm(folder, disk_cache_dir=str(tmp_path))
        assert _ids(llm, DOC + QUESTION) == cold["question"]
        llm.close()  # writes the pages it computed, replacing the bad ones
        return llm.cache_stats()

    second = run()
    assert second.hit_tokens["disk"] == 3 * BLOCK  # pages 0-2; page 3 is bad: the hit ends there
    assert second.disk_misses == {"truncated": 1}
    # page 3 and the pages chained after it in the read (4-9: the probe stopped at the deleted
    # page 10) are quarantined, the flipped page 7 among them, and the run rewrote them all
    assert second.disk_quarantined == 7
    third = run()  # so did page 10, and page 12 (document end + question)
    assert third.hit_tokens["disk"] == 13 * BLOCK and third.disk_misses == {}


def test_host_eviction_writes_to_disk_and_hits_from_there(folder, cold, tmp_path):
    # a host tier of one page: the document's pages fall through to disk as they are evicted
    page_gb = 2 * 2 * BLOCK * 2 * 16 * 4 / (1 << 30)  # layers * K,V * tokens * Hkv * D * fp32
    llm = _llm(folder, num_blocks=20, host_cache_gb=page_gb, disk_cache_dir=str(tmp_path))
    assert llm.engine.prefix_cache.tree.host_capacity_pages == 1
    _ids(llm, DOC)
    _ids(llm, _tokens(200, seed=9))
    _ids(llm, _tokens(200, seed=10))
    llm.engine.kv_mover.flush()  # disk writes run on the disk thread
    assert llm.engine.prefix_cache.disk.num_written > 0
    assert _ids(llm, DOC + QUESTION) == cold["question"]
    assert llm.cache_stats().hit_tokens["disk"] > 0


# ---------------------------------------------------------------------- scheduling and leaks

def test_concurrent_requests_share_pages_of_a_running_prefill(folder, cold):
    llm = _llm(folder)
    first = llm.engine.add_request(DOC, GREEDY)
    for _ in range(3):  # three chunks of 64: 12 pages indexed while the first still prefills
        llm.engine.step()
    second = llm.engine.add_request(DOC + QUESTION, GREEDY)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.release(first).outputs[0].token_ids == cold["doc"]
    assert llm.engine.release(second).outputs[0].token_ids == cold["question"]
    assert llm.cache_stats().hit_tokens["device"] == 12 * BLOCK


def test_waiting_queue_prefers_the_longest_cached_prefix(folder):
    llm = _llm(folder, max_num_seqs=1)
    _ids(llm, DOC)
    engine = llm.engine
    cold_id = engine.add_request(_tokens(100, seed=3), GREEDY)
    warm_id = engine.add_request(DOC + QUESTION, GREEDY)
    order = []
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                order.append(update.request_id)
    assert order == [warm_id, cold_id]


def test_passed_over_request_is_not_starved(folder):
    llm = _llm(folder, max_num_seqs=1)
    _ids(llm, DOC)
    engine = llm.engine
    cold_id = engine.add_request(_tokens(100, seed=3), SamplingParams(max_tokens=2, ignore_eos=True))
    warm = [engine.add_request(DOC + _tokens(5, seed=20 + i), SamplingParams(max_tokens=2, ignore_eos=True))
            for i in range(8)]
    order = []
    while engine.has_unfinished():
        order += [u.request_id for u in engine.step() if u.finished]
    assert order.index(cold_id) == 4  # after MAX_SKIPS warm requests went first
    assert set(order) == {cold_id, *warm}


def test_many_overlapping_requests_leave_no_pages_behind(folder):
    rng = random.Random(0)
    bases = [_tokens(90, seed=s) for s in range(3)]
    prompts = [{"prompt_token_ids": rng.choice(bases)[:rng.randint(20, 90)] + _tokens(rng.randint(1, 40), seed=100 + i)}
               for i in range(24)]
    llm = _llm(folder, num_blocks=24, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ref = LLM(folder, block_size=BLOCK, enable_prefix_caching=False)
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    engine = llm.engine
    assert engine.cache_stats().hit_tokens["device"] > 0
    assert engine.stats()["preemptions"] > 0
    tree = engine.prefix_cache.tree
    assert all(n.lock_count == 0 for n in tree.nodes())
    llm.clear_prefix_cache()
    assert engine.kv_usage()["device"]["free"] == engine.kv_usage()["device"]["total"]
    assert tree.num_free_host_pages == tree.host_capacity_pages
