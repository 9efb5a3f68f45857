"""The SGLang backend's pool forms and hit rule, without SGLang (these run in the main suite too)."""

from __future__ import annotations

import pytest

from kvtier.core.forms import CacheForm
from kvtier.integrations.sglang.pools import PoolPlan, PoolQuery, SglangStorageError, hit_pages, pool_form


@pytest.mark.parametrize(
    ("name", "form"),
    [
        ("kv", CacheForm.COMPRESSED),
        ("deepseek_v4_c4", CacheForm.COMPRESSED),
        ("deepseek_v4_c128", CacheForm.COMPRESSED),
        ("deepseek_v4_c4_rope", CacheForm.COMPRESSED),
        ("deepseek_v4_c4_indexer", CacheForm.INDEXER),
        ("deepseek_v4_c4_indexer_scale", CacheForm.INDEXER),
        ("swa", CacheForm.SWA),
        ("draft_swa", CacheForm.SWA),
        ("deepseek_v4_c4_state", CacheForm.TAIL),
        ("deepseek_v4_c4_indexer_state", CacheForm.TAIL),
        ("mamba", CacheForm.TAIL),
        # DeepSeek-V4.1's pools in SGLang 0.5.23
        ("deepseek_v4_c1", CacheForm.COMPRESSED),
        ("deepseek_v4_c2", CacheForm.COMPRESSED),
        ("deepseek_v4_c1_indexer", CacheForm.INDEXER),
        ("deepseek_v4_c2_indexer_scale", CacheForm.INDEXER),
        ("deepseek_v4_c128_state", CacheForm.TAIL),
        ("auxiliary_swa", CacheForm.SWA),
    ],
)
def test_pool_forms(name: str, form: CacheForm) -> None:
    assert pool_form(name) is form


def test_history_pools_need_every_page_state_pools_their_window() -> None:
    t, f = True, False
    hit = hit_pages(
        0,
        [t, t, t, t],
        [PoolQuery("c4", 0, [t, t, t, f]), PoolQuery("swa", 1, [f, t, f, t])],
    )
    # c4 allows 1..3; swa allows 2 and 4: the hit is 2, never 3 (no state there).
    assert (hit.pages, hit.restorable, dict(hit.pool_pages)) == (2, [2], {"kv": 4, "c4": 3, "swa": 4})


def test_state_window_counts_prefix_pages() -> None:
    t, f = True, False
    # One prefix page; a 2-page window at span length 1 spans chain pages 0 and 1.
    assert hit_pages(1, [t], [PoolQuery("swa", 2, [f, t])]).pages == 0
    assert hit_pages(1, [t], [PoolQuery("swa", 2, [t, t])]).pages == 1
    # At the chain start the window stops at token 0: one page is the whole window.
    assert hit_pages(0, [t], [PoolQuery("swa", 2, [t])]).pages == 1


def test_hit_policy_must_match_the_form() -> None:
    plan = PoolPlan("swa", CacheForm.SWA, 256, 1024, "x")
    plan.check_policy(history=False)
    with pytest.raises(SglangStorageError, match="TRAILING_PAGES"):
        plan.check_policy(history=True)
    assert plan.layout_digest("a") != plan.layout_digest("b")


def test_docs_list_every_exclusion() -> None:
    """docs/sglang.md's table of left-out fields is the code's: every excluded path is named there."""
    from pathlib import Path

    from kvtier.integrations.sglang.identity import EXCLUDED

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    missing = [path for path in EXCLUDED if f"`{path}`" not in doc]
    assert not missing, f"docs/sglang.md does not list {missing}"
