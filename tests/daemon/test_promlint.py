"""The exposition lint itself can fail: the faults issue 17 found in kvtier's metrics are each reported."""

from __future__ import annotations

from support.promlint import problems

BAD = """\
# HELP kvtier_hit_rate Share of the objects served
# TYPE kvtier_hit_rate gauge
kvtier_hit_rate{form="swa"} 0.5
# HELP kvtier_persist_queue Sealed objects waiting
# TYPE kvtier_persist_queue gauge
kvtier_persist_queue 3.0
# HELP kvtier_requests Requests served
# TYPE kvtier_requests counter
kvtier_requests_total{op="lookup",code="ok"} 4.0
kvtier_requests_created{op="lookup",code="ok"} 1.7e9
# TYPE kvtier_load_milliseconds histogram
kvtier_load_milliseconds_count 1.0
"""

GOOD = """\
# HELP kvtier_lookup_objects_total Objects a lookup routed, by form and route
# TYPE kvtier_lookup_objects_total counter
kvtier_lookup_objects_total{form="swa",route="reuse"} 4.0
# HELP kvtier_persist_queue_objects Sealed objects waiting to be written to the store
# TYPE kvtier_persist_queue_objects gauge
kvtier_persist_queue_objects 0.0
# HELP kvtier_request_seconds Time to serve one request
# TYPE kvtier_request_seconds histogram
kvtier_request_seconds_bucket{op="lookup",le="+Inf"} 1.0
kvtier_request_seconds_count{op="lookup"} 1.0
kvtier_request_seconds_sum{op="lookup"} 0.001
"""


def test_lint_flags_each_fault() -> None:
    found = "\n".join(problems(BAD))
    assert "kvtier_hit_rate: a since-start rate gauge" in found
    assert "kvtier_persist_queue: the name does not end in its unit" in found
    assert "kvtier_requests_created" in found and "_created series" in found
    assert "kvtier_load_milliseconds: use base units" in found and "kvtier_load_milliseconds: no HELP" in found


def test_lint_passes_conventional_families() -> None:
    assert problems(GOOD) == []
