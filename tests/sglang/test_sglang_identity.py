"""The backend's namespace is what SGLang resolved for the launch, not what config.json says.

Each test launches the way SGLang's scheduler process does (a real `ServerArgs`, resolved and published
with `runtime_context.publish`), stores pages, then launches again from the same checkpoint and path with
one launch-time change, and asks the store what it would serve.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.integrations.sglang.identity import EXCLUDED
from kvtier.integrations.sglang.pools import SglangStorageError
from support.daemon import DaemonProc
from support.sglang_pools import (  # first: it skips this module unless SGLang imports
    FakePagedPool,
    HiCacheStorageExtraInfo,
    StorageBackendFactory,
    backup,
    chain,
    kvtier_backend,
    launch,
    query,
    storage_config,
    write_checkpoint,
    write_qwen3_checkpoint,
    write_v41_checkpoint,
)

PAGES = 4
SLOTS = list(range(PAGES))


def kv_backend(model: Path, page_size: int, **options):
    """The plain KV host pool (a Qwen3's) of the published launch's page size, through SGLang's factory."""
    pool = FakePagedPool(item_bytes=2 * 2 * 16 * 2, layer_num=2, num_pages=PAGES, page_size=page_size)
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        **options,
    }
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, model_name="qwen3-tiny"), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend, pool


def store_then_ask(model: Path, store: Path, first: dict, second: dict, **options) -> int:
    """Pages stored under launch `first`; how many launch `second` (same checkpoint, same path) is served."""
    keys = chain("prompt", PAGES)
    info = HiCacheStorageExtraInfo(prefix_keys=None)
    args = launch(model, **first)
    backend, pool = kv_backend(model, args["page_size"], store_dir=str(store), **options)
    pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, dtype=torch.uint8))
    indices = torch.arange(PAGES * pool.page_size, dtype=torch.int64)
    assert backend.batch_set_v1(keys, indices, info) == [True] * PAGES
    assert backend.flush(30)
    assert backend.batch_exists(keys, info) == PAGES  # the storing launch itself hits
    backend.close()
    args = launch(model, **second)
    backend, _ = kv_backend(model, args["page_size"], store_dir=str(store), **options)
    try:
        return backend.batch_exists(keys, info)
    finally:
        backend.close()


@pytest.fixture
def qwen(tmp_path: Path) -> Path:
    return write_qwen3_checkpoint(tmp_path / "qwen3")


@pytest.mark.parametrize(
    "change",
    [
        {"json_model_override_args": json.dumps({"rope_theta": 40000.0})},
        {
            "json_model_override_args": json.dumps(
                {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
            )
        },
        {"kv_cache_dtype": "fp8_e4m3"},
        {"page_size": 16},
        {"dtype": "float32"},
    ],
    ids=["rope-theta", "yarn-rope-scaling", "kv-cache-dtype", "page-size", "dtype"],
)
def test_launch_change_that_alters_kv_bytes_is_a_miss(tmp_path: Path, qwen: Path, change: dict) -> None:
    assert store_then_ask(qwen, tmp_path / "store", {}, change) == 0


@pytest.mark.parametrize(
    "change",
    [{"max_running_requests": 7}, {"sampling_defaults": "openai"}, {"random_seed": 1234}, {"port": 31001}],
    ids=["max-running-requests", "sampling-defaults", "random-seed", "port"],
)
def test_launch_change_that_keeps_kv_bytes_still_hits(tmp_path: Path, qwen: Path, change: dict) -> None:
    assert store_then_ask(qwen, tmp_path / "store", {}, change) == PAGES


def test_a_runtime_override_after_publish_is_read(tmp_path: Path, qwen: Path) -> None:
    """SGLang's processes may override a resolved leaf after publishing (`get_context().override`): the
    identity is read from the values in effect when the backend opens, not from the launch's input."""
    from sglang.srt.runtime_context import get_context

    keys = chain("prompt", PAGES)
    info = HiCacheStorageExtraInfo(prefix_keys=None)
    args = launch(qwen)
    backend, pool = kv_backend(qwen, args["page_size"], store_dir=str(tmp_path / "store"))
    assert backend.batch_set_v1(keys, torch.arange(PAGES * pool.page_size), info) == [True] * PAGES
    assert backend.flush(30)
    backend.close()
    launch(qwen)
    get_context().override("test", kv_cache_dtype="fp8_e4m3")
    backend, _ = kv_backend(qwen, args["page_size"], store_dir=str(tmp_path / "store"))
    assert backend.batch_exists(keys, info) == 0
    assert backend.identity["server_args"]["model"]["kv_cache_dtype"] == "fp8_e4m3"
    backend.close()


def test_identical_launches_share_a_namespace(tmp_path: Path, qwen: Path) -> None:
    """SGLang draws a new random seed per launch: two identical launches must still be one namespace."""
    assert store_then_ask(qwen, tmp_path / "store", {}, {}) == PAGES


def test_rope_override_through_the_daemon_is_a_miss_for_every_dsv4_pool(tmp_path: Path) -> None:
    from support.sglang_pools import Dsv4Host

    model = write_checkpoint(tmp_path / "dsv4")
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProc(tmp_path / "daemon", store_root=tmp_path / "store")
    try:
        keys = chain("a", PAGES)
        launch(model)
        host = Dsv4Host(PAGES)
        host.fill(seed=7)
        kv = kvtier_backend(host, model, daemon_socket=str(daemon.socket))
        backup(kv, host, keys, SLOTS, state_at={PAGES - 1})
        assert kv.flush(30)
        assert query(kv, keys) == (PAGES, [PAGES])
        kv.close()
        launch(model, json_model_override_args=json.dumps({"rope_theta": 40000.0}))
        kv = kvtier_backend(Dsv4Host(PAGES), model, daemon_socket=str(daemon.socket))
        assert query(kv, keys) == (0, [])
        kv.close()
        launch(model, max_running_requests=9)  # not a KV byte: the first launch's pages again
        kv = kvtier_backend(Dsv4Host(PAGES), model, daemon_socket=str(daemon.socket))
        assert query(kv, keys) == (PAGES, [PAGES])
        kv.close()
        assert daemon.proc.poll() is None and "Traceback" not in daemon.read_log()
    finally:
        assert daemon.terminate() == 0


def test_dsv41_pools_round_trip_and_a_changed_sharing_layout_is_a_miss(tmp_path: Path) -> None:
    """DeepSeek-V4.1's host pools (C1/C2 KV and indexer keys, SWA) store and load bitwise; rewriting
    `kv_source_layer_ids` or `index_source_layer_ids` in the same checkpoint at the same path, with the
    operator's weights digest unchanged, is 0 hits."""
    from support.sglang_pools import DSV41_POOLS, Dsv4Host, load

    model = write_v41_checkpoint(tmp_path / "v41")
    store = str(tmp_path / "store")
    keys = chain("a", PAGES)
    launch(model)
    host = Dsv4Host(PAGES, geometry=DSV41_POOLS)
    host.fill(seed=8)
    written = host.snapshot()
    kv = kvtier_backend(host, model, store_dir=store)
    stored = backup(kv, host, keys, SLOTS, state_at={PAGES - 1})
    assert len(stored) == len(DSV41_POOLS) and all(all(v) for v in stored.values())
    assert kv.flush(30)
    kv.close()
    host.clear()
    kv = kvtier_backend(host, model, store_dir=store)  # a restart: same launch, same namespace
    assert query(kv, keys, geometry=DSV41_POOLS) == (PAGES, [PAGES])
    assert all(all(v) for v in load(kv, host, keys, SLOTS).values())
    for g in DSV41_POOLS:
        rows = SLOTS if g.policy.value == "all_pages" else SLOTS[-1:]
        assert torch.equal(host.pools[g.name].kv_buffer[rows], written[g.name][rows]), g.name
    kv.close()
    for change in ({"kv_source_layer_ids": [0, 1, 2, 2, 1, 5]}, {"index_source_layer_ids": [0, 1, 1, 1, 2, 5]}):
        write_v41_checkpoint(model, **change)  # same path, same weights digest (the operator's)
        launch(model)
        kv = kvtier_backend(Dsv4Host(PAGES, geometry=DSV41_POOLS), model, store_dir=store)
        assert query(kv, keys, geometry=DSV41_POOLS) == (0, []), change
        kv.close()


def test_audit_json_shows_the_resolved_identity(tmp_path: Path, qwen: Path) -> None:
    override = {"json_model_override_args": json.dumps({"rope_theta": 40000.0}), "kv_cache_dtype": "fp8_e4m3"}
    store_then_ask(qwen, tmp_path / "store", {}, override)  # two launches: two namespaces (the second empty)
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "audit", "--store", str(tmp_path / "store"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    namespaces = json.loads(out.stdout)["namespaces"]
    thetas = set()
    for ns in namespaces:
        identity = ns["identity"]
        assert ns["version_key"]["engine_config"].startswith("blake2b16:")
        text = identity["model_config"]["hf_text_config"]
        thetas.add(text.get("rope_theta", text["rope_parameters"]["rope_theta"]))
        assert identity["server_args"]["model"]["model_path"] == str(qwen)
        assert "serving" not in identity["server_args"]  # API keys and the like never reach the audit
        assert "random_seed" not in identity["server_args"]["device"]
        assert "max_running_requests" not in identity["server_args"]["schedule"]
    assert thetas == {10000.0, 40000.0}
    kv_dtypes = {ns["identity"]["server_args"]["model"]["kv_cache_dtype"] for ns in namespaces}
    assert kv_dtypes == {"auto", "fp8_e4m3"}


def test_every_exclusion_names_a_field_sglang_resolves(qwen: Path) -> None:
    """The exclusion table is about SGLang 0.5.23's real fields: a stale name would exclude nothing."""
    from kvtier.integrations.resolved_config import canonical
    from kvtier.integrations.sglang.backend import _resolved_engine

    launch(qwen)
    server_args, model_config = _resolved_engine()
    whole = canonical({"server_args": server_args, "model_config": model_config})
    for path in EXCLUDED:
        node = whole
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f"{path} is not a field SGLang resolves"
            node = node[part]


def test_refuses_to_start_where_sglang_published_nothing(tmp_path: Path, qwen: Path) -> None:
    from sglang.srt.runtime_context import reset_context

    reset_context()
    with pytest.raises(SglangStorageError, match="published no resolved configuration"):
        kv_backend(qwen, 64, store_dir=str(tmp_path / "store"))


def test_model_dir_must_be_the_checkpoint_sglang_serves(tmp_path: Path, qwen: Path) -> None:
    other = write_qwen3_checkpoint(tmp_path / "elsewhere")
    launch(qwen)
    with pytest.raises(SglangStorageError, match="is not the checkpoint SGLang serves"):
        kv_backend(qwen, 1, store_dir=str(tmp_path / "store"), model_dir=str(other))


def test_a_stale_kv_cache_dtype_option_is_refused(tmp_path: Path, qwen: Path) -> None:
    launch(qwen)
    with pytest.raises(SglangStorageError, match="remove kv_cache_dtype"):
        kv_backend(qwen, 1, store_dir=str(tmp_path / "store"), kv_cache_dtype="fp8_e4m3")
