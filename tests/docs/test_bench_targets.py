"""bench/targets.toml is the one place a benchmark's bound is written: bench/targets.py checks a report against
it, run_all records the verdicts, and bench/report.py shows them; and bench/fio_limit.py's baseline reads with the
request size and depth kvtier's loads use."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import fio_limit  # noqa: E402
import report  # noqa: E402
import run_all  # noqa: E402
import targets  # noqa: E402

from kvtier.store import aio  # noqa: E402


def _latest() -> dict:
    (_, latest), *_ = report.load_reports()
    return copy.deepcopy(latest)


def _quiet(machine: dict) -> dict:
    return {**machine, "quiet": True, "calibration": {**machine.get("calibration", {}), "python_loop_ns": 20.0}}


def test_every_target_names_a_line_the_report_makes() -> None:
    latest = _latest()
    keys = {r.key for r in report.rows(latest["sections"])}
    checked = 0
    for t in targets.load():
        if targets.lookup(latest["sections"].get(t.section, {}), t.path) is not None:
            assert t.row in keys, f"{t.text}: no report line {t.row!r}"
            checked += 1
    assert checked


def test_a_figure_on_either_side_of_its_bound_is_met_or_missed() -> None:
    store = {"read_ratio_to_fio": 0.95, "small_load_objects_per_s": 120_000}
    machine = _quiet({})
    (t,) = [t for t in targets.load() if t.path == "read_ratio_to_fio"]
    assert [v.status for v in targets.evaluate([t], {"store": store}, machine)] == ["met"]
    store["read_ratio_to_fio"] = 0.85
    (v,) = targets.evaluate([t], {"store": store}, machine)
    assert (v.status, v.measured) == ("missed", 0.85)


def test_a_line_whose_condition_fails_or_whose_figure_is_absent_is_not_applicable() -> None:
    (small,) = [t for t in targets.load() if t.path == "small_load_objects_per_s" and t.issue == 43]
    slow = {"quiet": True, "calibration": {"python_loop_ns": 31.0}}
    (v,) = targets.evaluate([small], {"store": {"small_load_objects_per_s": 150_000}}, slow)
    assert v.status == "n/a" and "python_loop_ns 31.0" in v.why and v.measured == 150_000
    (v,) = targets.evaluate([small], {"store": {"fio": {"missing": fio_limit.INSTALL}}}, _quiet({}))
    assert v.status == "n/a" and "not in the store report" in v.why
    (v,) = targets.evaluate([small], {"store": {"error": "bench/store.py exited 1"}}, _quiet({}))
    assert v.status == "n/a" and "exited 1" in v.why
    (v,) = targets.evaluate([small], {}, _quiet({}))
    assert v.why == "section store did not run"


def test_a_missed_line_whose_ceiling_misses_too_says_the_machine_is_short() -> None:
    # the LMCache line's ceiling is kvtier's layout read alone over LMCache's read, in the same run: below 2x the
    # disk itself leaves no way to meet the line, and the verdict says so; at or above it a miss is kvtier's
    (lm,) = [t for t in targets.load() if t.row == "peer_read_lmcache"]
    peers = {"lmcache_odirect": True, "kvtier_over_peer": {"lmcache": {"cold_read_MBps": 1.2}}}
    (v,) = targets.evaluate([lm], {"peers": {**peers, "layout_over_peer": {"lmcache": 1.6}}}, _quiet({}))
    assert (v.status, v.measured) == ("missed", 1.2)
    assert v.why.startswith("out of reach on this machine: kvtier's layout read alone") and v.why.endswith(" 1.6")
    assert "missed: out of reach on this machine" in targets.cell([v]) and "(out of reach" in targets.line(v)
    (v,) = targets.evaluate([lm], {"peers": {**peers, "layout_over_peer": {"lmcache": 2.4}}}, _quiet({}))
    assert (v.status, v.why) == ("missed", "")
    (v,) = targets.evaluate([lm], {"peers": peers}, _quiet({}))  # no layout read (no native AIO): nothing to say
    assert (v.status, v.why) == ("missed", "")
    peers["kvtier_over_peer"]["lmcache"]["cold_read_MBps"] = 2.1
    (v,) = targets.evaluate([lm], {"peers": {**peers, "layout_over_peer": {"lmcache": 1.6}}}, _quiet({}))
    assert (v.status, v.why) == ("met", "")


def test_a_ceiling_needs_its_words(tmp_path: Path) -> None:
    bad = tmp_path / "targets.toml"
    bad.write_text(
        '[[target]]\nrow = "r"\nsection = "s"\npath = "a"\nop = ">="\nvalue = 1\ntext = "t"\nissue = 1\nceiling = "b"\n'
    )
    with pytest.raises(ValueError, match="needs both ceiling and ceiling_text"):
        targets.load(bad)


def test_the_cluster_line_holds_every_shaped_link_and_not_the_unshaped_one() -> None:
    # the figure is the least ratio of the shaped runs; the unshaped veth (memory speed) is a line of its own with
    # no target beside it, so 0.49 of an 18 Gbit/s veth never sits next to "met"
    (t,) = [t for t in targets.load() if t.row == "cluster_link"]
    run = {"link_gbps": 0.5, "restore_MBps": 60.0}
    runs = [
        {**run, "shaped": "0.5 Gbit/s", "shaper": "tbf", "ratio_to_link": 0.99},
        {**run, "shaped": "1 Gbit/s", "shaper": "tbf", "ratio_to_link": 0.7},
        {**run, "shaped": "none", "shaper": "none", "ratio_to_link": 0.49},
    ]
    cluster = {"runs": runs, "shaped_ratio_to_link_min": 0.7}
    (v,) = targets.evaluate([t], {"cluster": cluster}, _quiet({}))
    assert (v.status, v.measured) == ("missed", 0.7)
    by_key = {}
    for r in report.rows({"cluster": cluster}, [v]):
        by_key.setdefault(r.key, []).append(r)
    assert [r.ratio for r in by_key["cluster_link"]] == ["0.99 of the link", "0.70 of the link"]
    assert all("every shaped link: missed" in r.target for r in by_key["cluster_link"])
    (unshaped,) = by_key["cluster_unshaped"]
    assert unshaped.target == "" and "unshaped veth link" in unshaped.benchmark and unshaped.ratio == "0.49 of the link"


def test_paths_pick_list_items_by_key_or_index() -> None:
    doc = {"cases": [{"tokens": 4096, "ratio": 5.0}, {"tokens": 65536, "ratio": 20.0}], "runs": [{"r": 1}]}
    assert targets.lookup(doc, "cases[tokens=65536].ratio") == 20.0
    assert targets.lookup(doc, "cases[tokens=8192].ratio") is None
    assert targets.lookup(doc, "runs[0].r") == 1 and targets.lookup(doc, "runs[3].r") is None


def test_a_malformed_target_is_refused_with_what_to_fix(tmp_path: Path) -> None:
    bad = tmp_path / "targets.toml"
    bad.write_text('[[target]]\nrow = "x"\nsection = "store"\npath = "a"\nop = "~"\nvalue = 1\ntext = "t"\nissue = 1\n')
    with pytest.raises(ValueError, match="op must be one of"):
        targets.load(bad)
    bad.write_text('[[target]]\nrow = "x"\nsection = "store"\n')
    with pytest.raises(ValueError, match="needs row, section, path"):
        targets.load(bad)


def test_the_page_shows_the_verdicts_the_report_holds(tmp_path: Path) -> None:
    # the target column is what run_all recorded, not a word written by hand: another verdict, another page
    shutil.copytree(REPO / "bench" / "results", tmp_path, dirs_exist_ok=True)
    (name, latest), *_ = report.load_reports(tmp_path)
    latest = copy.deepcopy(latest)
    latest["sections"]["store"].update(
        read_MBps=900.0, fio_read_MBps=1000.0, read_ratio_to_fio=0.9, read_ratio_best_over_best=0.85
    )
    latest["sections"]["store"]["fio"] = {"ioengine": "libaio", "request_bytes": 2 << 20, "iodepth": 16, "memory": "m"}
    verdicts = targets.evaluate(targets.load(), latest["sections"], _quiet(latest["machine"]))
    latest["targets"] = targets.as_json(verdicts)
    (tmp_path / name).write_text(json.dumps(latest))
    text = report.page(report.load_reports(tmp_path), tmp_path)
    row = "| 900 | fio libaio O_DIRECT, 2048 KiB x 16 in flight, m | 1,000 | 0.90 of fio (median of ABBA pairs; best"
    assert row + " over best 0.85) |" in text
    assert "store cold read >= 0.9 of fio at kvtier's depth: met" in text
    latest["sections"]["store"]["read_ratio_to_fio"] = 0.5
    latest["targets"] = targets.as_json(targets.evaluate(targets.load(), latest["sections"], _quiet(latest["machine"])))
    (tmp_path / name).write_text(json.dumps(latest))
    assert "store cold read >= 0.9 of fio at kvtier's depth: missed" in report.page(report.load_reports(tmp_path))


def test_fio_reads_with_the_geometry_of_kvtiers_loads() -> None:
    geo = fio_limit.geometry()
    assert geo.request_bytes == aio.AIO_PIECE_BYTES
    assert geo.depth == min(aio.DEPTH, aio.AIO_WINDOW_BYTES // aio.AIO_PIECE_BYTES)
    job = fio_limit.job_file("/x/a:b.seg", 8192, 1 << 20, geo, "shmhuge")
    for line in ("direct=1", "ioengine=libaio", f"bs={geo.request_bytes}", f"iodepth={geo.depth}", "iomem=shmhuge"):
        assert line in job.splitlines()
    assert "filename=/x/a\\:b.seg" in job  # fio splits file names at an unescaped colon


@pytest.mark.alone  # vm.nr_hugepages is the host's: a test on another worker reserving or giving back pages races it
@pytest.mark.skipif(shutil.which("fio") is None, reason=fio_limit.INSTALL)
def test_fio_reads_a_real_file_cold_and_says_which_memory(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(os.urandom(8 << 20))
    geo = fio_limit.Geometry(1 << 20, 4)
    before = fio_limit.NR_HUGEPAGES.read_text() if fio_limit.NR_HUGEPAGES.exists() else None
    with fio_limit.HugeBuffers(geo) as buffers:
        got = fio_limit.fio_read([(path, 0, 8 << 20), (path, 4096, 1 << 20)], geo, buffers)
    assert got.bytes == 9 << 20 and got.seconds > 0 and got.MBps > 0
    assert buffers.memory.startswith(buffers.iomem)
    if before is not None:  # reserved pages, if any, were given back
        assert fio_limit.NR_HUGEPAGES.read_text() == before
    with pytest.raises(RuntimeError, match="fio"):
        fio_limit.fio_read([(tmp_path / "absent", 0, 1 << 20)], geo, fio_limit.HugeBuffers(geo))


def test_without_fio_the_bench_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fio_limit.shutil, "which", lambda name: None)
    assert fio_limit.missing() == fio_limit.INSTALL and "apt-get install -y fio" in fio_limit.INSTALL


def test_thp_both_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_all.thp_settings("host") == [None]
    monkeypatch.setattr(run_all.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="--thp both needs root"):
        run_all.thp_settings("both")


def test_the_quiet_probe_is_a_share_of_the_cpus() -> None:
    assert 0.0 <= run_all.busy_share(0.2) <= 1.0


_VLLM = {
    "tokens": 131072, "lookups": 534, "lookup_total_ms_median": 2.5, "rows": 64, "row_bytes": 1003520,
    "kvtier_load_mb_per_s": 1700.0, "fs_load_mb_per_s": 1800.0, "load_ratio_kvtier_vs_fs": 0.944,
    "kvtier_store_mb_per_s": 1500.0, "fs_store_mb_per_s": 1400.0, "store_ratio_kvtier_vs_fs": 1.071,
}  # fmt: skip
_SGLANG = {
    "pages": 64, "layers": 4, "kvtier": {"get_s": 0.02, "set_s": 0.07}, "hicache_file": {"get_s": 0.05, "set_s": 0.021},
    "ratio": {"get": 2.5, "set": 0.3},
}  # fmt: skip


def test_the_engine_benches_are_lines_beside_the_engines_own_tiers() -> None:
    by_key = {r.key: r for r in report.rows({"vllm": _VLLM, "sglang": _SGLANG})}
    assert by_key["vllm_load"][2:6] == ("1,700", "vLLM's own fs tier (O_DIRECT)", "1,800", "1.06x slower")
    assert by_key["vllm_store"][2:6] == ("1,500", "vLLM's own fs tier (O_DIRECT)", "1,400", "1.07x faster")
    assert by_key["vllm_lookup"].kvtier == "2.5 ms (534 lookups)"
    assert by_key["sglang_get"][2:6] == ("20 ms", "SGLang's HiCacheFile", "50 ms", "2.50x faster")
    assert by_key["sglang_set"][2:6] == ("70 ms", "SGLang's HiCacheFile", "21 ms", "3.33x slower")


def test_an_engine_section_without_its_venv_says_what_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_VLLM_VENV", str(tmp_path / "none"))
    args = run_all.argparse.Namespace(quick=True, dir=str(tmp_path), timeout=5)
    sections, _ = run_all.run_sections(["vllm"], run_all.commands(args, "python"), {}, args, dict(os.environ))
    assert sections == {"vllm": {"pending": f"no vllm venv at {tmp_path / 'none'}: tests/vllm/run.sh builds it"}}
    assert any(r.key == "pending_vllm" for r in report.rows(sections))
