"""The cleaner is asked to make room for writes that wait (issue 18): a form whose quota holds its records
below the cleaner's usual watermark, yet has no room for the objects waiting to be written back, is
unblocked by the supervised verifier, without a flush or an operator: the daemon publishes what the blocked
form needs, the cleaner evicts below its watermark for it, the daemon retries the write-back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.client import Client, NotDurable, NotDurableCause
from kvtier.core.profile import load_profile
from support.daemon import DaemonProc
from support.workload import caches_for, tokens_for

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens
SWA_RECORD = 160 + PROFILE.group("swa").object_bytes(H)  # header + payload, as the store counts it
QUOTA = 2 * SWA_RECORD + SWA_RECORD // 2  # two records fill 80% of it: under the 95% watermark, no room for a third


def test_a_blocked_form_unblocks_through_the_verifier(tmp_path: Path) -> None:
    d = DaemonProc(
        tmp_path,
        extra_toml=f"[store.quota_bytes]\nswa = {QUOTA}\n",
        verifier='mode = "supervise"\n',
    )
    try:
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            swa = 0
            for seed in range(3):
                c.offload(tokens_for(seed, 2, H), caches_for(PROFILE, seed, 2))
                swa += len(caches_for(PROFILE, seed, 2)["swa"])
            assert swa > 2
            with pytest.raises(NotDurable) as err:
                c.flush(timeout_s=20)
            assert [w.cause for w in err.value.why] == [NotDurableCause.STORE_REFUSED], err.value.reasons
            # nobody flushes from here on: the daemon asks for room, the cleaner makes it, write-back retries
            deadline = time.monotonic() + 90
            while (doc := c.stats()).store["persist_queue"]:
                assert time.monotonic() < deadline, f"write-back still blocked: {doc.store['write_back_blocked']}"
                time.sleep(0.2)  # polling a condition with a deadline
            assert doc.store["write_back_blocked"] == [] and doc.daemon.health == "ok"
            assert doc.store["forms"]["swa"]["record_bytes"] <= QUOTA
            evicted = doc.verifier.actions.get("evicted", 0)
            assert evicted >= swa - 2, doc.verifier.actions  # below its watermark, for the waiting swa objects
            assert c.flush(timeout_s=20) == 0
    finally:
        d.close()
