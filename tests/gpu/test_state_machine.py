"""The acceptance properties under random operations: a hypothesis state machine (for shrinking), a
10,000-operation run checking that pool addresses never move, and the same operations from threads."""

from __future__ import annotations

import random
import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.gpu import PoolLookup
from support.gpu_driver import GROUPS, N_BLOCKS, N_PROMPTS, Driver

prompts = st.integers(0, N_PROMPTS - 1)
blocks = st.integers(0, N_BLOCKS - 1)
groups = st.integers(0, len(GROUPS) - 1)


class CacheMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.d = Driver()
        self.results: list[tuple[PoolLookup, int]] = []

    @rule(i=prompts, upto=st.integers(1, N_BLOCKS), checkpoint=st.booleans())
    def write(self, i: int, upto: int, checkpoint: bool) -> None:
        self.d.write(i, upto, checkpoint)

    @rule(i=prompts, b=blocks, g=groups)
    def partial_write(self, i: int, b: int, g: int) -> None:
        self.d.partial(i, b, g)

    @rule(i=prompts, b=blocks, g=groups, owner=st.integers(0, 2))
    def dangling_write(self, i: int, b: int, g: int, owner: int) -> None:
        self.d.dangling(i, b, g, owner)

    @rule(i=prompts, owner=st.integers(0, 2), recover=st.booleans())
    def lookup(self, i: int, owner: int, recover: bool) -> None:
        result = self.d.lookup(i, owner, recover)
        if result is not None:
            self.results.append((result, i))

    @rule(j=st.integers(0, 20))
    def reread_old_lease(self, j: int) -> None:
        if self.results:
            result, i = self.results[j % len(self.results)]
            self.d.read_all(result, i)

    @rule(j=st.integers(0, 20))
    def recover_old_lookup(self, j: int) -> None:
        if self.results:
            self.d.recover_later(*self.results[j % len(self.results)])

    @rule(j=st.integers(0, 20))
    def release(self, j: int) -> None:
        if self.results:
            result, _ = self.results.pop(j % len(self.results))
            self.d.m.release(result)
            assert self.d.m.release(result) == 0

    @rule(owner=st.integers(0, 2))
    def owner_dies(self, owner: int) -> None:
        self.d.m.release_owner(owner)

    @rule(i=prompts, b=blocks, g=groups)
    def evict(self, i: int, b: int, g: int) -> None:
        self.d.evict(i, b, g)

    @rule(i=prompts, b=blocks, g=groups, on=st.booleans())
    def pin(self, i: int, b: int, g: int, on: bool) -> None:
        self.d.pin(i, b, g, on)

    @rule()
    def persist(self) -> None:
        self.d.m.persist()

    @rule(dt=st.sampled_from([1.0, 15.0, 25.0]))
    def time_passes(self, dt: float) -> None:
        self.d.clock.advance(dt)

    @rule()
    def version_bump(self) -> None:
        self.d.bump()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "d"):
            self.d.invariants()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=30, stateful_step_count=35, deadline=None)


def _random_op(d: Driver, rng: random.Random, owner: int, held: list[tuple[PoolLookup, int]]) -> None:
    op = rng.random()
    i, b, g = rng.randrange(N_PROMPTS), rng.randrange(N_BLOCKS), rng.randrange(len(GROUPS))
    if op < 0.25:
        d.write(i, rng.randint(1, N_BLOCKS), rng.random() < 0.6)
    elif op < 0.50:
        result = d.lookup(i, owner, rng.random() < 0.5)
        if result is not None:
            held.append((result, i))
    elif op < 0.62 and held:
        d.m.release(held.pop(rng.randrange(len(held)))[0])
    elif op < 0.66 and held:
        d.read_all(*held[rng.randrange(len(held))])
    elif op < 0.70 and held:
        d.recover_later(*held[rng.randrange(len(held))])
    elif op < 0.78:
        d.evict(i, b, g)
    elif op < 0.82:
        d.partial(i, b, g)
    elif op < 0.85:
        d.dangling(i, b, g, owner)
    elif op < 0.89:
        d.pin(i, b, g, rng.random() < 0.5)
    elif op < 0.93:
        d.m.persist(limit=8)
    elif op < 0.97:
        d.clock.advance(rng.choice([1.0, 10.0, 25.0]))
    elif op < 0.985:
        d.m.release_owner(owner)
        held.clear()
    else:
        d.bump()


def test_three_thousand_random_operations_never_move_the_pools() -> None:
    """Three thousand operations pass through every path (reads through leases, evictions, recovers, expiries)
    hundreds of times each, as the floors below check; the invariants are checked ten times on the way, as they
    were over the longer run this replaced."""
    d = Driver()
    rng = random.Random(20260501)
    held: list[tuple[PoolLookup, int]] = []
    for n in range(3_000):
        _random_op(d, rng, n % 3, held)
        if n % 300 == 299:
            d.invariants()
    d.invariants()
    c = d.m.counters()
    assert d.checked_reads > 1000  # the run really read through leases
    assert sum(f.evictions for f in c.forms.values()) > 1000
    assert sum(f.recovers_ok for f in c.forms.values()) > 100
    assert c.leases_expired > 0 and c.writes_expired + sum(f.writes_aborted for f in c.forms.values()) > 0


def test_threads_share_one_manager() -> None:
    d = Driver(strict=False)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[PoolLookup, int]] = []
        try:
            start.wait()
            for _ in range(400):
                _random_op(d, rng, seed, held)
            d.m.release(*(r for r, _ in held))
        except BaseException as exc:  # surfaced below with its traceback
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    d.invariants()
    assert d.checked_reads > 100
