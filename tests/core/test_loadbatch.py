"""LoadBatch: a recovery's requests as columns, each item the LoadRequest a pool's slot view would make."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from kvtier.core import CacheForm
from kvtier.core.loadbatch import LoadBatch, TargetGroup
from kvtier.core.tier import LoadRequest, ObjectKey

NS = b"n" * 16
POOL_A = torch.arange(10 * 64, dtype=torch.int64).to(torch.uint8)
POOL_B = torch.zeros(4 * 4096, dtype=torch.uint8)
GROUPS = (
    TargetGroup("c4", CacheForm.COMPRESSED, b"a" * 16, POOL_A, 64, 48),
    TargetGroup("swa", CacheForm.SWA, b"b" * 16, POOL_B, 4096, 4000),
)


def _hash(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"%d" % i)


def _batch(groups=GROUPS, n: int = 6) -> LoadBatch:
    return LoadBatch(NS, groups, np.array([i % 2 for i in range(n)]), [_hash(i) for i in range(n)], np.arange(n) % 4)


def test_each_item_is_the_request_of_its_slot() -> None:
    batch = _batch()
    assert len(batch) == 6
    for i, req in enumerate(batch):
        g = GROUPS[i % 2]
        slot = i % 4
        assert req.key == ObjectKey(NS, _hash(i), g.name, g.form)
        assert req.layout_digest == g.layout_digest
        assert req.out.data_ptr() == g.tensor.data_ptr() + slot * g.stride and req.out.numel() == g.nbytes
        assert isinstance(req, LoadRequest)


def test_a_slice_and_a_join_are_batches_of_the_same_objects() -> None:
    batch = _batch()
    part = batch[2:5]
    assert isinstance(part, LoadBatch) and [r.key for r in part] == [r.key for r in batch][2:5]
    joined = (
        batch[:2]
        + _batch(
            groups=tuple(TargetGroup(g.name, g.form, g.layout_digest, g.tensor, g.stride, g.nbytes) for g in GROUPS)
        )[2:]
    )
    assert [r.key for r in joined] == [r.key for r in batch]
    assert [r.out.data_ptr() for r in joined] == [r.out.data_ptr() for r in batch]


def test_batches_of_other_pools_or_namespaces_do_not_join() -> None:
    other_pool = (GROUPS[0], TargetGroup("swa", CacheForm.SWA, b"b" * 16, POOL_B.clone(), 4096, 4000))
    with pytest.raises(ValueError, match="same groups"):
        _batch() + _batch(groups=other_pool)
    with pytest.raises(ValueError, match="same groups"):
        _batch() + LoadBatch(b"m" * 16, GROUPS, np.zeros(1), [_hash(0)], np.zeros(1))


@pytest.mark.parametrize(
    "namespace, group_of, hashes, slots, message",
    [
        (b"short", [0], [_hash(0)], [0], "namespace"),
        (NS, [0], [b"x" * 15], [0], "16-byte"),
        (NS, [0, 1], [_hash(0)], [0, 1], "one group and one slot"),
        (NS, [2], [_hash(0)], [0], "group indexes"),
        (NS, [-1], [_hash(0)], [0], "group indexes"),
    ],
)
def test_malformed_columns_are_refused(namespace, group_of, hashes, slots, message) -> None:
    with pytest.raises(ValueError, match=message):
        LoadBatch(namespace, GROUPS, np.array(group_of), hashes, np.array(slots))
