"""Replies belong to their request: a daemon frozen (SIGSTOP) past a client's timeout, then resumed.

The timed-out call fails with a typed error and closes its connection; every later call on that client
returns its own answer. Before request ids, the late reply of the timed-out call answered the next one:
a lookup or a `TierClient.load_into` of record B came back OK with record A's bytes.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.client import Client, DaemonTimeout, OutOfOrder, TierClient
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from support.boundary import frozen
from support.daemon import DaemonProc
from support.workload import caches_for, compare, tokens_for

VKEY = VersionKey("test/ids", "xxh3_128:00", "test-abi", "none", "none", "bf16")
GROUPS = [("g0", CacheForm.COMPRESSED)]
DIGEST = bytes(range(16))
OBJ = 8192


def _key(i: int) -> ObjectKey:
    return ObjectKey(VKEY.namespace, i.to_bytes(16, "little"), "g0", CacheForm.COMPRESSED)


def _payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (OBJ,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


# One daemon for the module (`shared_daemon`): each test freezes and resumes it, and uses prompts or records of its
# own (seeds 1-2 of ref-tiny, a lookup that misses, records of the tier's own namespace), so none sees another's state.


def test_client_after_a_frozen_daemon(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    profile = load_profile("ref-tiny")
    h = profile.hash_block_tokens
    with Client(daemon.socket) as writer:
        writer.attach("ref-tiny")
        for seed in (1, 2):
            assert writer.offload(tokens_for(seed, 2, h), caches_for(profile, seed, 2)).written > 0
    with Client(daemon.socket, timeout_s=1.0) as c:
        c.attach("ref-tiny")
        held = c.lookup(tokens_for(1, 2, h))
        with frozen(daemon):
            with pytest.raises(DaemonTimeout):
                c.lookup(tokens_for(1, 2, h))
            with pytest.raises(DaemonTimeout):  # the reconnect's hello waits on the frozen daemon too
                c.lookup(tokens_for(2, 2, h))
        with pytest.raises(OutOfOrder, match="closed since"):  # its leases went with the closed connection
            c.read(held, profile.groups[0].name, 0)
        assert c.release(held) == 0
        for seed in (2, 1, 2, 1):
            result = c.lookup(tokens_for(seed, 2, h))
            assert result.hit_tokens == 2 * h
            assert compare(c, result, caches_for(profile, seed, 2)) > 0  # its own bytes, never the other seed's
            c.release(result)


def test_lookup_deadline_costs_a_miss_not_the_call_timeout(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    with Client(daemon.socket, timeout_s=30.0, lookup_timeout_s=0.3) as c:
        c.attach("ref-tiny")
        with frozen(daemon):
            started = time.monotonic()
            with pytest.raises(DaemonTimeout):
                c.lookup([0] * 512)
            assert time.monotonic() - started < 5.0  # the lookup's own deadline, not timeout_s
        assert c.lookup([0] * 512).hit_tokens == 0


def test_tier_client_after_a_frozen_daemon(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    with TierClient(daemon.socket, VKEY, GROUPS, staging_bytes=OBJ, timeout_s=1.0) as t:
        t.store_many([(_key(i), _payload(i), DIGEST) for i in (1, 2)])
        out = torch.zeros(OBJ, dtype=torch.uint8)
        with frozen(daemon), pytest.raises(DaemonTimeout):
            t.load_into([LoadRequest(_key(1), out, DIGEST)])
        assert not out.any()  # nothing was copied for the call the daemon did not answer
        for i in (2, 1, 2, 1):
            out = torch.zeros(OBJ, dtype=torch.uint8)
            assert t.load_into([LoadRequest(_key(i), out, DIGEST)]) == [Reason.OK]
            assert torch.equal(out, _payload(i)), f"record {i} came back with other bytes"
        with frozen(daemon), pytest.raises(DaemonTimeout):
            t.store_many([(_key(3), _payload(3), DIGEST)])
        t.store_many([(_key(3), _payload(3), DIGEST)])
        out = torch.zeros(OBJ, dtype=torch.uint8)
        assert t.load_into([LoadRequest(_key(3), out, DIGEST)]) == [Reason.OK]
        assert torch.equal(out, _payload(3))
