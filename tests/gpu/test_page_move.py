"""A cpu pool moved onto huge pages after it is made (kvtier.gpu.page_move, MADV_COLLAPSE): its bytes never change,
an engine's read-only mapping sees the same bytes on the huge pages, an engine process reading the pool over and over
while it is moved never sees other bytes, and loads that read into the pool while it is moved, and offloads staged into
it, leave every byte right.
Run where the kernel moves shared memory (Linux 6.1+, shmem_enabled granting nothing: else the pools get their pages
another way and have no move)."""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys

import pytest
import torch
import xxhash

from kvtier.core import CacheForm, Reason, hugepages
from kvtier.core.tier import LoadRequest
from kvtier.daemon import staging
from kvtier.gpu.page_move import start_moving
from kvtier.gpu.pools import Pool, allocate_pool
from kvtier.store import DiskStore
from support.store_helpers import DIGEST, VK, make_key, make_payload

MIB = 1 << 20
SLOT = 784_896  # a deepseek-v4-flash compressed object: large, read straight into its slot

pytestmark = pytest.mark.skipif(
    hugepages.shared_pages(hugepages.read_host(), [64 * MIB]).how is not hugepages.SharedPages.COLLAPSE,
    reason="this host gives shared memory huge pages another way, or MADV_COLLAPSE does not move it",
)


def _pool(budget: int) -> Pool:
    pool = allocate_pool("c4", CacheForm.COMPRESSED, SLOT, budget, torch.device("cpu"))
    assert pool.pages == "collapse" and pool.move is not None
    return pool


def test_a_moved_pool_keeps_its_bytes_and_a_readers_mapping_sees_them_on_huge_pages() -> None:
    pool = _pool(16 * MIB)
    try:
        assert pool.move is not None
        pattern = torch.randint(
            0, 256, (pool.tensor.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
        )
        pool.tensor.copy_(pattern)
        size = os.fstat(pool.reader_fd).st_size
        assert size == pool.move.size and size % hugepages.HUGE_PAGE == 0
        seen = mmap.mmap(pool.reader_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)  # an engine's view, mapped before
        try:
            assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == 0
            pool.move.run()
            assert pool.move.left == 0 and pool.move.moved == size  # nothing holds the pages: every range moves
            assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == size
            assert torch.equal(pool.tensor, pattern)
            at = pool.base_offset
            assert seen[at : at + pool.tensor.numel()] == pattern.numpy().tobytes()
        finally:
            seen.close()
    finally:
        pool.close()


def test_loads_into_a_pool_while_it_is_moved_read_every_byte_right(tmp_path) -> None:
    """The move runs on its thread (as in the daemon) while loads read straight into the pool's slots with O_DIRECT,
    round after round until the move is done: every load is served and every slot holds its record's bytes. A range
    with a read in flight is left on small pages, never half moved."""
    pool = _pool(48 * MIB)
    n = pool.n_slots
    root = str(tmp_path / "store")
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"m{i}") for i in range(n)]
        payloads = [make_payload(f"m{i}", SLOT) for i in range(n)]
        s.store_many(list(zip(keys, payloads, [DIGEST] * n)))
    rng = random.Random(0)
    try:
        with DiskStore(root) as s:
            thread = start_moving("test", [pool.move])
            assert thread is not None
            rounds = 0
            while thread.is_alive() or rounds < 3:
                order = rng.sample(range(n), n)  # each round, records into other slots than before
                pool.tensor.fill_(0)
                reqs = [LoadRequest(keys[k], pool.slot_view(slot), DIGEST) for slot, k in enumerate(order)]
                assert s.load_into(reqs) == [Reason.OK] * n
                for slot, k in enumerate(order):
                    assert torch.equal(pool.slot_view(slot), payloads[k]), (rounds, slot)
                rounds += 1
            thread.join()
        assert pool.move is not None and pool.move.left == 0
        assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == pool.move.moved > 0
    finally:
        pool.close()


def test_offloads_staged_into_a_pool_while_it_is_moved_leave_every_byte_right() -> None:
    """The move runs on its thread (as in the daemon) while offloads are copied into the pool's slots from a sealed
    staging memfd (`staging.copy_in`, the daemon's path for a client's bytes), round after round until the move is
    done: after each round every slot holds the object last copied into it, and the pool still ends on huge pages."""
    pool = _pool(128 * MIB)
    n = pool.n_slots
    payloads = [make_payload(f"w{i}", SLOT) for i in range(n)]
    fd = os.memfd_create("staging", os.MFD_ALLOW_SEALING)
    rng = random.Random(1)
    try:
        for p in payloads:
            os.write(fd, p.numpy().tobytes())
        assert staging.freeze(fd) == n * SLOT
        thread = start_moving("test", [pool.move])
        assert thread is not None
        rounds = during = 0
        while thread.is_alive() or rounds < 3:
            during += thread.is_alive()
            order = rng.sample(range(n), n)  # each round, objects into other slots than before
            for slot, k in enumerate(order):
                assert staging.copy_in(fd, k * SLOT, pool.slot_view(slot)) == SLOT
            for slot, k in enumerate(order):
                assert torch.equal(pool.slot_view(slot), payloads[k]), (rounds, slot)
            rounds += 1
        thread.join()
        assert during >= 1  # (copies went in while the move ran, not only after it)
        assert pool.move is not None and pool.move.left == 0
        assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == pool.move.moved > 0
    finally:
        os.close(fd)
        pool.close()


# An engine's process: maps the pool read-only through the fd it was handed and checks every byte of it, again and
# again, until told to stop (a line on stdin: one more pass then, begun after the move); it says "ready" after its
# first pass, and at the end how many passes it made and how many saw other bytes.
_READER = """
import mmap, os, select, sys, xxhash
fd, size, at, n, want = *map(int, sys.argv[1:5]), sys.argv[5]
view = memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ))[at : at + n]
passes = bad = 0
stop = False
while not stop:
    stop = bool(select.select([sys.stdin], [], [], 0)[0])  # (told to stop: one last pass, begun after the move)
    bad += xxhash.xxh3_128_hexdigest(view) != want
    passes += 1
    if passes == 1:
        print("ready", flush=True)
print(passes, bad, flush=True)
"""


def test_an_engine_process_reading_the_pool_while_it_is_moved_sees_every_byte_unchanged() -> None:
    pool = _pool(32 * MIB)
    try:
        assert pool.move is not None
        gen = torch.Generator().manual_seed(2)
        pool.tensor.copy_(torch.randint(0, 256, (pool.tensor.numel(),), dtype=torch.uint8, generator=gen))
        size = os.fstat(pool.reader_fd).st_size
        want = xxhash.xxh3_128_hexdigest(pool.tensor.numpy())
        where = [str(pool.reader_fd), str(size), str(pool.base_offset), str(pool.tensor.numel())]
        engine = subprocess.Popen(
            [sys.executable, "-c", _READER, *where, want],
            pass_fds=(pool.reader_fd,),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert engine.stdout is not None and engine.stdin is not None
            assert engine.stdout.readline().strip() == "ready"
            pool.move.run()  # while the engine reads every byte, pass after pass
            engine.stdin.write("stop\n")
            engine.stdin.flush()
            passes, bad = map(int, engine.stdout.readline().split())
        finally:
            engine.kill()
            engine.wait()
        assert bad == 0 and passes >= 2
        assert pool.move.moved > 0 and hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == pool.move.moved
    finally:
        pool.close()
