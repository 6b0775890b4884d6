"""BlockPool: lowest-id-first allocation, refcounts, and the errors a caller can provoke.

Exact ids throughout; a hypothesis state machine checks the pool against a plain dict model.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from longctx.cache.block_pool import BlockPool, OutOfBlocksError


def test_new_pool_is_all_free_with_zero_refcounts():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free == 5
    assert [pool.refcount(i) for i in range(5)] == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_at_least_one_block(num_blocks):
    with pytest.raises(ValueError, match=rf"at least one block, got {num_blocks}$"):
        BlockPool(num_blocks)


def test_single_block_pool():
    pool = BlockPool(1)
    assert pool.allocate(1) == [0]
    assert pool.num_free == 0
    pool.release([0])
    assert pool.allocate(1) == [0]


def test_allocate_hands_out_lowest_ids_first_with_refcount_one():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 3
    assert [pool.refcount(i) for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_allocate_zero_returns_nothing_and_changes_nothing():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free == 3
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(0) == []
    assert pool.num_free == 0


def test_released_ids_are_reused_lowest_first():
    pool = BlockPool(8)
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]
    pool.release([4, 1, 3])
    assert pool.num_free == 5
    # Free now: 1, 3, 4, 6, 7. Lowest first, whatever the release order was.
    assert pool.allocate(2) == [1, 3]
    assert pool.allocate(3) == [4, 6, 7]
    assert pool.num_free == 0


def test_allocate_result_is_sorted_after_interleaved_releases():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    c = pool.allocate(2)
    assert (a, b, c) == ([0, 1], [2, 3], [4, 5])
    pool.release(c)
    pool.release(a)
    assert pool.allocate(4) == [0, 1, 4, 5]


def test_over_allocation_raises_and_leaves_pool_unchanged():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match=r"^asked for 2 blocks, 1 free$"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert [pool.refcount(i) for i in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(1) == [3]


def test_over_allocation_from_empty_pool_message():
    pool = BlockPool(2)
    with pytest.raises(OutOfBlocksError, match=r"^asked for 3 blocks, 2 free$"):
        pool.allocate(3)
    assert pool.num_free == 2


def test_out_of_blocks_error_is_a_runtime_error():
    assert issubclass(OutOfBlocksError, RuntimeError)


def test_share_adds_a_holder_and_block_stays_used_until_last_release():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    assert ids == [0, 1]
    pool.share([0])
    pool.share([0, 1])
    assert (pool.refcount(0), pool.refcount(1)) == (3, 2)
    assert pool.num_free == 2

    pool.release([0, 1])
    assert (pool.refcount(0), pool.refcount(1)) == (2, 1)
    assert pool.num_free == 2
    pool.release([1])
    assert pool.refcount(1) == 0
    assert pool.num_free == 3
    pool.release([0])
    pool.release([0])
    assert pool.refcount(0) == 0
    assert pool.num_free == 4
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_shared_block_is_not_handed_out_again():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.share([0])
    pool.release([0])  # one holder left
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_double_release_raises():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.release([1])
    with pytest.raises(ValueError, match=r"^block 1 released more often than held$"):
        pool.release([1])
    assert pool.refcount(1) == 0
    assert pool.num_free == 2


def test_release_of_never_allocated_block_raises():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=r"^block 2 released more often than held$"):
        pool.release([2])
    assert pool.num_free == 3


def test_release_more_often_than_shared_raises():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.share([0])
    pool.release([0])
    pool.release([0])
    with pytest.raises(ValueError, match="block 0 released more often than held"):
        pool.release([0])
    assert pool.refcount(0) == 0
    assert pool.num_free == 2


def test_sharing_a_free_block_raises():
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(ValueError, match=r"^block 1 is free and cannot be shared$"):
        pool.share([1])
    assert pool.refcount(1) == 0
    assert pool.num_free == 2


def test_sharing_a_released_block_raises():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.release([0])
    with pytest.raises(ValueError, match=r"^block 0 is free and cannot be shared$"):
        pool.share([0])


def test_negative_block_id_is_rejected():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        pool.release([-1])
    with pytest.raises(ValueError, match="block ids"):
        pool.share([4])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([3, 3])  # all or nothing: block 3 stays held
    assert pool.num_free == 0
    assert pool.refcount(3) == 1


# ---------------------------------------------------------------------------- random operations


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / share / release (valid and invalid) against a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.model: dict[int, int] = {}

    @precondition(lambda self: self.pool is None)
    @rule(num_blocks=st.integers(1, 12))
    def create(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.model = {i: 0 for i in range(num_blocks)}

    def _free_ids(self) -> list[int]:
        return sorted(i for i, c in self.model.items() if c == 0)

    def _used_ids(self) -> list[int]:
        return sorted(i for i, c in self.model.items() if c > 0)

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def allocate(self, data):
        free = self._free_ids()
        count = data.draw(st.integers(0, len(free) + 2), label="count")
        if count > len(free):
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(count)
            return
        got = self.pool.allocate(count)
        assert got == free[:count]
        for i in got:
            self.model[i] = 1

    @precondition(lambda self: self.pool is not None and self._used_ids())
    @rule(data=st.data())
    def share(self, data):
        ids = data.draw(st.lists(st.sampled_from(self._used_ids()), min_size=1, max_size=4),
                        label="ids")
        self.pool.share(ids)
        for i in ids:
            self.model[i] += 1

    @precondition(lambda self: self.pool is not None and self._used_ids())
    @rule(data=st.data())
    def release(self, data):
        ids = data.draw(st.lists(st.sampled_from(self._used_ids()), min_size=1, max_size=4,
                                 unique=True), label="ids")
        self.pool.release(ids)
        for i in ids:
            self.model[i] -= 1

    @precondition(lambda self: self.pool is not None and self._free_ids())
    @rule(data=st.data())
    def release_free_block_fails(self, data):
        i = data.draw(st.sampled_from(self._free_ids()), label="id")
        with pytest.raises(ValueError, match=f"block {i} released more often than held"):
            self.pool.release([i])

    @precondition(lambda self: self.pool is not None and self._free_ids())
    @rule(data=st.data())
    def share_free_block_fails(self, data):
        i = data.draw(st.sampled_from(self._free_ids()), label="id")
        with pytest.raises(ValueError, match=f"block {i} is free and cannot be shared"):
            self.pool.share([i])

    @invariant()
    def pool_matches_model(self):
        if self.pool is None:
            return
        n = self.pool.num_blocks
        counts = [self.pool.refcount(i) for i in range(n)]
        assert counts == [self.model[i] for i in range(n)]
        assert min(counts) >= 0
        num_used = sum(1 for c in counts if c > 0)
        assert self.pool.num_free + num_used == n
        # The free ids are exactly those with refcount 0: allocating every free block returns
        # precisely that set, lowest first; giving them back restores the state.
        free = [i for i, c in enumerate(counts) if c == 0]
        assert self.pool.num_free == len(free)
        assert self.pool.allocate(len(free)) == free
        assert self.pool.num_free == 0
        self.pool.release(free)
        assert self.pool.num_free == len(free)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
