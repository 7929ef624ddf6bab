"""The engine's paged cache: rows hold block tables over one pool, joining and leaving copy nothing,
decode writes in place and gathers what a rectangle of slots would hold, blocks are shared by
holder count, and a request's answer does not depend on who joined or left around it."""

import os
import resource

import numpy as np
import pytest
import torch

from support_replay import SamplingParams
from support_replay.engine import Engine, EngineSettings, block_pool
from support_replay.engine.block_pool import BlockPool
from support_replay.engine.paged_cache import PagedCache, attention_groups, strided_runs
from support_replay.errors import EngineError
from support_replay.protocol import GenerateRequest
from tiny_model import assert_answers_as_alone

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def filled(lengths, heads=2, dim=3, layers=2, page=4, blocks=64, reserve=None, pool=None):
    """A cache whose row i holds value 100 * i + position at every held position (values: the negative)."""
    cache = PagedCache(pool or BlockPool(layers, page, blocks * page))
    width = max(lengths)
    keys = torch.zeros(len(lengths), heads, width, dim)
    for i, n in enumerate(lengths):
        keys[i, :, width - n :] = (100 * i + torch.arange(n, dtype=torch.float32))[None, :, None]
    cache.append([(keys, -keys)] * layers, list(lengths), reserve=reserve)
    return cache


def held(cache, row, layer=0):
    """Row ``row``'s keys at its held positions, read back from the pool."""
    keys, values = cache.pool.read(cache.tables[row], int(cache.lengths[row]))[layer]
    assert torch.equal(values, -keys)
    return keys[0, :, 0]


def test_rows_hold_their_own_length_in_blocks_and_leaving_frees_them_without_a_copy():
    cache = filled([3, 5, 2, 4, 6])
    assert [len(t) for t in cache.tables] == [1, 2, 1, 1, 2]  # pages of 4: a row's length, not the longest's
    pool = cache.pool
    assert pool.used == 7
    storage = [layer.clone() for layer in pool.storage]
    order = cache.keep([0, 2, 4])
    assert order == [0, 2, 4] and cache.size == 3 and cache.lengths.tolist() == [3, 2, 6]
    assert pool.used == 4 and all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(storage, pool.storage)
    )  # no copy
    for slot, row in enumerate(order):
        assert torch.equal(held(cache, slot), 100 * row + torch.arange(int(cache.lengths[slot]), dtype=torch.float32))
    assert cache.keep([]) == [] and cache.size == 0
    assert pool.used == 0  # nothing held: the memory goes back (test_idle_memory_goes_back_lazily_...)


def test_decode_writes_each_rows_position_and_takes_a_block_as_it_grows():
    cache = filled([2, 4])
    mask = cache.prepare_decode()
    assert mask[:, 0, 0].tolist() == [[True, True, True, False, False], [True] * 5]  # width 5: row 0 sees positions 0-2
    assert [len(t) for t in cache.tables] == [1, 2]  # row 1 writes position 4: its second block, taken now
    new = torch.full((2, 2, 1, 3), 7.0)
    keys, values = cache.layers[0].update(new, -new)
    assert keys.shape == (2, 2, 5, 3) and keys[0, 0, 2, 0] == 7 and keys[1, 0, 4, 0] == 7 and keys[1, 0, 3, 0] == 103
    assert torch.equal(values, -keys) and keys.stride()[-2:] == (3, 1)  # a rectangle's inner layout
    assert keys[0, 0, 3:].abs().sum() == 0  # past row 0's length: its fresh block's zeros
    cache.finish_decode()
    for _ in range(6):
        cache.prepare_decode()
        for layer in cache.layers:
            layer.update(new, -new)
        cache.finish_decode()
    assert cache.lengths.tolist() == [9, 11] and [len(t) for t in cache.tables] == [3, 3]
    assert held(cache, 1)[:5].tolist() == [100, 101, 102, 103, 7]


def test_rows_of_unlike_lengths_attend_in_groups_at_their_own_widths():
    assert attention_groups([100, 3, 60, 40, 2, 10], align=1) == [[0, 2], [3], [5], [1, 4]]
    assert attention_groups([64, 60, 70, 66], align=1) == [[2, 3, 0, 1]]  # like lengths: one group
    assert len(attention_groups([200, 3], align=64)) == 2 and len(attention_groups([100, 3], align=64)) == 1
    cache = filled([9, 2, 3, 8], page=4)
    whole = cache.prepare_decode()
    assert len(cache.groups) == 1 and whole.shape == (4, 1, 1, 10)
    every, _ = cache.attended(0)
    every = every.clone()
    mask = cache.prepare_decode(grouped=True)
    assert mask.shape == (4, 1, 1, 10) and [g.rows.tolist() for g in cache.groups] == [[0, 3], [1, 2]]
    for group in cache.groups:
        keys, values = cache.attended(0, group)
        assert keys.shape == (group.size, 2, group.width, 3) and torch.equal(values, -keys)
        assert torch.equal(keys, every[group.rows, :, : group.width])  # what the whole gather holds there
        assert torch.equal(group.mask, whole[group.rows, :, :, : group.width])
    with pytest.raises(EngineError, match="attention groups"):
        cache.attended(0)


def test_rows_whose_reservations_lie_at_one_stride_are_attended_in_place():
    """A prefilled group's rows take their reservations as one run: their decode attention reads the
    storage through a strided view (nothing gathered), the same values as a gather of their blocks."""
    pool = BlockPool(2, 4, 64 * 4)
    cache = filled([5, 7, 6], reserve=[3, 3, 3], pool=pool)
    assert cache.tables == [[1, 2, 3], [4, 5, 6], [7, 8, 9]] and cache.pitches == [3] * 3
    late = filled([2, 9], pool=pool)  # no reservation: blocks as it grows, gathered
    cache.extend(late)
    cache.prepare_decode(grouped=True)
    in_place = [g for g in cache.groups if g.gather is None]
    assert len(in_place) == 1 and in_place[0].rows.tolist() == [0, 1, 2] and in_place[0].stride == 3
    keys, values = cache.attended(1, in_place[0])
    assert keys.shape == (3, 2, 8, 3) and keys.stride()[-2:] == (3, 1) and torch.equal(values, -keys)
    for row in range(3):
        n = int(cache.lengths[row])
        assert torch.equal(keys[row, 0, :n, 0], 100 * row + torch.arange(n, dtype=torch.float32))
    new = torch.full((5, 2, 1, 3), 7.0)
    cache.write(1, new, -new)
    assert keys[1, 0, 7, 0] == 7  # a view: the write is seen without another gather
    with pytest.raises(EngineError, match="past its reservation"):
        for _ in range(6):
            cache.finish_decode()
            cache.prepare_decode(grouped=True)
    assert strided_runs([1, None, 4, 10, 7], [3, 0, 3, 3, 3]) == [([0, 2, 4, 3], 3)]
    assert strided_runs([1, 4, 8], [3, 3, 4]) == [([0, 1], 3), ([2], 4)]


def test_rows_of_unlike_reservations_lie_at_one_pitch_and_are_attended_in_place_together():
    """Reservations of 2, 3 and 2 blocks laid 3 apart: one strided view serves the three rows (a shorter
    row's view runs past its own blocks only at positions its mask hides), the blocks between stay free."""
    pool = BlockPool(2, 4, 64 * 4)
    cache = filled([5, 9, 6], reserve=[2, 3, 2], pool=pool)
    assert cache.tables == [[1, 2], [4, 5, 6], [7, 8]] and cache.pitches == [3] * 3 and pool.used == 7
    assert pool.allocate(1) == [3]  # the gap after a shorter run is anyone's
    cache.prepare_decode(grouped=True)
    (group,) = cache.groups
    assert group.gather is None and group.stride == 3 and group.width == 10
    keys, values = cache.attended(0, group)
    assert torch.equal(values, -keys)
    for row in range(3):
        n = int(cache.lengths[row])
        assert torch.equal(keys[row, 0, :n, 0], 100 * row + torch.arange(n, dtype=torch.float32))
        assert not group.mask[row, 0, 0, n + 1 :].any()  # what lies past a row's own blocks is masked


def test_blocks_are_shared_by_holder_count_and_handed_out_lowest_first():
    pool = BlockPool(num_layers=1, block_size=4, max_tokens=16)
    pool.ensure(1, 2, torch.float32, "cpu")
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.free == 1
    pool.share(a[:2])  # a prefix cache entry holds the first two
    pool.release(a)
    assert pool.used == 2 and pool.allocate(2) == [3, 4]
    with pytest.raises(EngineError, match="1 blocks asked with 0 of 4 free"):
        pool.allocate(1)
    pool.release([1, 2])
    assert pool.allocate(1) == [1]
    with pytest.raises(EngineError, match="released more often than held"):
        pool.release([2])


def test_the_cpu_storage_is_zero_filled_memory_made_at_first_write_and_given_back_when_nothing_is_held(
    monkeypatch,
):
    monkeypatch.setattr(block_pool, "LAZY_FREE", None)  # where the kernel frees nothing lazily: dropped
    pool = BlockPool(num_layers=2, block_size=2, max_tokens=8)
    pool.ensure(1, 1, torch.float32, "cpu")
    assert all(torch.equal(layer, torch.zeros(2, 1, 5, 2, 1)) for layer in pool.storage)  # the OS's zero pages
    first = pool.allocate(2)
    pool.storage[0][:, :, first] = 5.0
    pool.release(first)
    assert pool.storage is None and pool.used == 0  # nothing held: the memory went back
    pool.ensure(1, 1, torch.float32, "cpu")
    assert pool.allocate(1) == [1] and pool.storage[0].abs().sum() == 0
    assert pool.allocate_rows([3]) == [[2, 3, 4]] and pool.free == 0 and pool.allocate(0) == []
    pool.release([1, 3])
    assert pool.allocate_rows([2]) is None and pool.allocate(2) == [1, 3]  # free, but not one after the other
    pool.release([2, 4])
    assert pool.allocate_rows([1, 1]) is None  # two free blocks, not one after the other
    small = BlockPool(num_layers=1, block_size=1, max_tokens=4)
    small.ensure(1, 1, torch.float32, "cpu")
    assert small.allocate_rows([1, 1, 2]) is None  # 4 blocks free, but rows 2 apart span 6: past the storage
    big = BlockPool(num_layers=1, block_size=2, max_tokens=20)
    big.ensure(1, 1, torch.float32, "cpu")
    big.allocate(2)
    assert big.allocate_rows([1, 2, 2]) == [[3], [5, 6], [7, 8]] and big.used == 7


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(block_pool.LAZY_FREE is None, reason="MADV_FREE is Linux's")
def test_idle_memory_goes_back_lazily_and_the_next_rollout_writes_it_without_faults():
    pool = BlockPool(num_layers=2, block_size=256, max_tokens=256 * 40)  # a block: 64 KiB of keys, 16 pages
    pool.ensure(1, 64, torch.float32, "cpu")
    storage = [layer.data_ptr() for layer in pool.storage]
    pages = 2 * 2 * 32 * 256 * 64 * 4 // 4096  # 2 layers x keys and values of 32 blocks

    def rollout(value: float) -> int:
        """Faults taken writing 32 blocks of every layer; all of them released after."""
        blocks = pool.allocate(32)
        assert blocks == list(range(1, 33))  # the lowest blocks again, after the pool went idle
        before = page_faults()
        for layer in pool.storage:
            layer[:, :, 1:33] = value
        faults = page_faults() - before
        assert all(torch.equal(layer[:, :, 1:33], torch.full_like(layer[:, :, 1:33], value)) for layer in pool.storage)
        pool.release(blocks)
        return faults

    assert rollout(1.0) >= pages // 2  # fresh memory: a fault a page (the kernel may map a few at once)
    assert pool.used == 0 and [layer.data_ptr() for layer in pool.storage] == storage  # idle: kept mapped, freed
    lazy = lazily_freed_kib()
    assert lazy is None or lazy >= pages * 4 // 2  # the kernel holds them as lazily freed: its to take back
    assert rollout(2.0) < pages // 10  # not taken back (no memory pressure here): written again without faults
    assert pool.storage[0][:, :, 40].abs().sum() == 0  # never written: zeros; what was written holds finite values
    pool.ensure(1, 32, torch.float32, "cpu")  # idle storage of other shapes is made anew (a model of other heads)
    assert pool.storage[0].shape == (2, 1, 41, 256, 32)
    pool.allocate(1)
    with pytest.raises(EngineError, match="keys of 1 heads x 64"):
        pool.ensure(1, 64, torch.float32, "cpu")  # held blocks: the storage stays and other shapes are refused


def test_an_idle_pool_whose_kernel_refuses_the_lazy_free_drops_its_storage(monkeypatch):
    monkeypatch.setattr(block_pool, "LAZY_FREE", 10**6)  # no such advice: madvise fails with EINVAL
    pool = BlockPool(num_layers=1, block_size=2, max_tokens=8)
    pool.ensure(1, 1, torch.float32, "cpu")
    pool.release(pool.allocate(2))
    assert pool.storage is None and pool.used == 0


def lazily_freed_kib() -> int | None:
    """The process's lazily freed memory (``LazyFree`` of /proc/self/smaps_rollup), None where not shown."""
    try:
        text = open("/proc/self/smaps_rollup").read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("LazyFree:"):
            return int(line.split()[1])
    return None


class Entries:
    """An idle holder as the prefix cache is one: entries of blocks, the oldest first, each holding its blocks."""

    def __init__(self, pool, *entries):
        self.pool, self.entries = pool, [list(e) for e in entries]
        for entry in self.entries:
            pool.share(entry)

    def held(self, blocks):
        ids = [b for entry in self.entries for b in entry]
        return np.bincount(np.asarray(ids, np.int64), minlength=blocks)[:blocks]

    def give_way(self):
        if not self.entries:
            return False
        self.pool.release(self.entries.pop(0))
        return True


def test_idle_entries_give_way_oldest_first_to_rows_in_place_and_only_where_that_finds_them_a_window():
    pool = BlockPool(num_layers=1, block_size=1, max_tokens=9)
    pool.ensure(1, 1, torch.float32, "cpu")
    rows = pool.allocate(8)
    pool.idle = Entries(pool, [2], [5], [7])  # finished rows left blocks 2, 5 and 7 to the cache
    pool.release(rows)
    assert pool.used == 3
    assert pool.allocate_rows([3, 3]) == [[1, 2, 3], [4, 5, 6]]  # [2] and [5] went, the newest entry stayed
    assert pool.idle.entries == [[7]] and pool.used == 7
    pool.release([1, 2, 3, 4, 5, 6])
    assert pool.allocate(4) == [1, 2, 3, 4]
    pool.release([1, 2, 3])
    # a running row (block 4) breaks every window of two rows of 3; the entry is no help and stays
    assert pool.allocate_rows([3, 3]) is None and pool.idle.entries == [[7]]
    last = BlockPool(num_layers=1, block_size=1, max_tokens=5)
    last.ensure(1, 1, torch.float32, "cpu")
    held = last.allocate(4)
    last.idle = Entries(last, [2])
    last.release(held)
    assert last.allocate_rows([4]) == [[1, 2, 3, 4]] and last.storage is not None  # its last block went, not its memory


def test_requests_joining_and_leaving_mid_flight_answer_as_alone(tiny_checkpoint):
    """Deterministic engine, driven step by step: three requests start, two more join after three
    decode steps, all with different lengths so they leave at different steps (each leaving slot
    taken by the last row); every answer equals the same request alone, bit for bit."""
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True))
    reqs = [
        GenerateRequest(
            [5 + i, 6, 7, 8][: 2 + i % 3],
            SamplingParams(top_k=20, top_p=0.9, seed=i),
            max_new_tokens=3 + 2 * i,
            ignore_eos=True,
            return_sampling_mask=True,
        )
        for i in range(5)
    ]
    first = [engine.submit(r) for r in reqs[:3]]
    for _ in range(4):
        engine.step()
    late = [engine.submit(r) for r in reqs[3:]]
    while not all(f.done() for f in first + late):
        engine.step()
    together = [f.result() for f in first + late]
    assert_answers_as_alone(engine, reqs, together)
    engine.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_pools_larger_than_the_machine_still_let_the_process_fork():
    """The storage is reserved nowhere: mapped privately it would count whole at every fork, and a process holding
    more budget than the machine has memory (an engine per test, a colocated trainer) could not start a worker."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    block_bytes = 2 * 1 * 16 * 64 * 4  # keys and values of one head, 16 positions of 64 floats
    pool = BlockPool(num_layers=6, block_size=16, max_tokens=16 * (memory // 4 // block_bytes))
    pool.ensure(1, 64, torch.float32, "cpu")  # 1.5x the machine's memory in all, none of it written
    pool.storage[0][0, 0, 1] = 1.0
    pid = os.fork()
    if pid == 0:
        os._exit(0 if float(pool.storage[0][0, 0, 1, 0, 0]) == 1.0 else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_rows_copied_from_one_prefill_row_say_so_to_the_attention_through_joins_and_leaves():
    """Rows whose prompt came from one prefill row hold the same keys and values at its positions: their in-place group
    names, for each row, the group's first row of its prompt and the prompt's positions (the decode kernel reads them
    there), through rows leaving and other prefills joining."""
    pool = BlockPool(2, 4, 64 * 4)
    cache = PagedCache(pool)
    keys = torch.randn(2, 2, 6, 3)
    cache.append([(keys, -keys)] * 2, [6, 5, 6, 5, 6], sources=[0, 1, 0, 1, 0], reserve=[4] * 5)
    cache.prepare_decode(grouped=True)
    assert cache.groups[0].shared.tolist() == [[0, 0], [1, 0], [0, 6], [1, 5], [0, 6]]
    cache.keep([1, 2, 3, 4])  # the first row of prompt 0 leaves: the next one serves
    cache.prepare_decode(grouped=True)
    assert cache.groups[0].shared.tolist() == [[0, 0], [1, 0], [0, 5], [1, 6]]
    other = PagedCache(pool)
    other.append([(keys, -keys)] * 2, [6, 5], sources=[0, 1], reserve=[4, 4])  # its own prompts, numbered apart
    cache.extend(other)
    assert len({prompt for prompt, _ in cache.prompts}) == 4
    cache.keep([0, 2])  # one row of each prompt: nothing shared
    cache.prepare_decode(grouped=True)
    assert cache.groups[0].shared is None
