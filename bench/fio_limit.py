"""The disk's limit for a cold read: fio reading the same file spans with the requests kvtier issues.

Contract:
- `geometry()` is how kvtier's store reads a large load: the piece a run is cut into (the request size) and the
  pieces it keeps in flight (the queue depth: the bytes it allows in flight over the piece size, at most the AIO
  context's depth), read from the store's own read path, never typed in here.
- `missing()` is None where fio can run, else one line that says how to install it. A bench that needs fio reports
  that line instead of a limit: there is no silent fallback to another baseline.
- `HugeBuffers()` (a context manager) gives fio its buffers in huge pages where it can: hugetlb pages already free,
  or (as root) a few reserved for the run and given back on exit (`--iomem=shmhuge`); else fio's ordinary
  `malloc` buffers in 4 KiB pages, and `memory` says which one applies.
- `fio_read(spans, geo, buffers)` reads every (file, offset, bytes) span once, one after another, each with
  `--direct=1 --ioengine=libaio --rw=read` at `geo`'s request size and depth, `--readonly`, and returns fio's
  own bytes and seconds (the sum of its runtimes: fio's process start is not counted). A RuntimeError where fio
  fails or reads less than asked.
- `fio_random_iops(path, nbytes, ios)` is the limit for a load of small records each in a page of its own: fio's
  reads per second doing `ios` random 4 KiB reads (`--rw=randread --direct=1`, libaio) in the first `nbytes` of
  `path` at the AIO context's depth (the most reads such a load keeps in flight).

Why fio and not dd: dd reads one request at a time into ordinary memory, so it says what one synchronous reader
gets, not what the disk gives. kvtier keeps many requests in flight into huge-page memory; the limit it is held
to must do the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvtier.core import hugepages
from kvtier.store import aio

INSTALL = "fio is not installed: apt-get install -y fio (Debian/Ubuntu) or dnf install -y fio, then rerun"
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


@dataclasses.dataclass(frozen=True, slots=True)
class Geometry:
    request_bytes: int  # one read request as kvtier submits it
    depth: int  # requests kvtier keeps in flight in one large load

    def describe(self) -> dict:
        return {"request_bytes": self.request_bytes, "iodepth": self.depth}


def geometry() -> Geometry:
    """kvtier's large-load read geometry, from the store's read path: pieces of AIO_PIECE_BYTES, at most
    AIO_WINDOW_BYTES of them in flight, and never more than the AIO context's DEPTH reads."""
    piece, window = aio.AIO_PIECE_BYTES, aio.AIO_WINDOW_BYTES
    return Geometry(piece, max(1, min(aio.DEPTH, window // piece)))


def missing() -> str | None:
    return None if shutil.which("fio") else INSTALL


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class HugeBuffers:
    """fio's buffer memory for one run: hugetlb pages where free or reservable, else small pages (says which).

    `kvtier_pools` (bytes of each) reserves pages for kvtier's side too (its load targets, or the daemon's pools,
    made while the reservation holds), so that both sides read into the same kind of memory: pool memory takes the
    host's free reserved hugetlb pages where shmem refuses transparent huge pages
    (`kvtier.core.hugepages.shared_pages`)."""

    def __init__(self, geo: Geometry, kvtier_pools: Sequence[int] = ()) -> None:
        page = hugepages.HUGE_PAGE
        # fio's shmhuge segment: iodepth buffers of the request size in whole huge pages, plus two (its alignment
        # and header: with one fewer fio finds no huge pages); a pool's memfd is its bytes plus alignment: a page more
        self.pages = -(-geo.request_bytes * geo.depth // page) + 2 + sum(-(-n // page) + 1 for n in kvtier_pools)
        self.iomem = "malloc"
        self.memory = "malloc: 4 KiB pages (no hugetlb pages free, and not root to reserve them)"
        self._restore: int | None = None

    def __enter__(self) -> HugeBuffers:
        if _meminfo("HugePages_Free") >= self.pages:
            self._use("hugetlb pages already free on the host")
            return self
        if os.geteuid() != 0 or not NR_HUGEPAGES.exists():
            return self
        before = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(str(before + self.pages))
        self._restore = before
        if _meminfo("HugePages_Free") >= self.pages:  # the kernel may find fewer contiguous 2 MiB pages than asked
            self._use(f"{self.pages} hugetlb pages reserved for the run and given back after it")
        else:  # given back at once: kvtier's side must not have huge pages that fio's lacks
            self.memory = "malloc: 4 KiB pages (the kernel could not reserve enough hugetlb pages)"
            self.__exit__()
        return self

    def _use(self, why: str) -> None:
        self.iomem = "shmhuge"
        self.memory = f"shmhuge: 2 MiB pages ({why})"

    def __exit__(self, *exc: object) -> None:
        if self._restore is not None:
            NR_HUGEPAGES.write_text(str(self._restore))
            self._restore = None


@dataclasses.dataclass(frozen=True, slots=True)
class FioRead:
    bytes: int
    seconds: float

    @property
    def MBps(self) -> float:
        return self.bytes / self.seconds / 1e6


def _fio_name(path: str | Path) -> str:
    """A file name as a fio job file takes it: fio splits names at an unescaped colon."""
    return str(path).replace(":", "\\:")


def job_file(path: str | Path, offset: int, nbytes: int, geo: Geometry, iomem: str) -> str:
    """One fio job: a span read at kvtier's request size and depth, O_DIRECT through libaio, cache invalidated."""
    return (
        "[span]\nioengine=libaio\ndirect=1\nrw=read\ninvalidate=1\nthread\n"
        f"bs={geo.request_bytes}\niodepth={geo.depth}\niomem={iomem}\n"
        f"filename={_fio_name(path)}\noffset={offset}\nsize={nbytes}\n"
    )


def fio_random_iops(path: str | Path, nbytes: int, ios: int) -> float:
    """fio's 4 KiB O_DIRECT random reads per second in the first `nbytes` of `path`, `ios` of them at aio.DEPTH."""
    job = (
        "[random]\nioengine=libaio\ndirect=1\nrw=randread\nnorandommap=1\ninvalidate=1\nthread\nbs=4096\nrandrepeat=0\n"
        f"iodepth={aio.DEPTH}\nio_size={ios * 4096}\nfilename={_fio_name(path)}\nsize={nbytes}\n"
    )
    (data,) = _run_fio(job)
    if data["error"] or data["read"]["total_ios"] < ios:
        raise RuntimeError(f"fio read {data['read']['total_ios']} of {ios} pages of {path} (error {data['error']})")
    return ios / (max(data["read"]["runtime"], 0.5) / 1e3)  # fio's runtime is in whole milliseconds


def _run_fio(job: str) -> list[dict]:
    """fio's JSON jobs for one job file (read only); a RuntimeError where fio fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".fio", delete=False) as f:
        f.write(job)
    try:
        res = subprocess.run(["fio", "--readonly", "--output-format=json", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if res.returncode != 0 or "{" not in res.stdout:
        raise RuntimeError(f"fio exited {res.returncode}: {res.stderr.strip()[-300:]}")
    return json.loads(res.stdout[res.stdout.index("{") :])["jobs"]


def described(geo: Geometry, memory: str, what: str, **more: object) -> dict:
    """How a bench's fio limit was read, for its JSON: the engine and O_DIRECT of `job_file`, the geometry, the
    memory fio read into, and what it read."""
    return {"ioengine": "libaio", "direct": True, **geo.describe(), "memory": memory, **more, "what": what}


def fio_read(spans: Sequence[tuple[str | Path, int, int]], geo: Geometry, buffers: HugeBuffers) -> FioRead:
    """fio's bytes and seconds reading `spans` (offsets and sizes 4096-aligned) cold with O_DIRECT, one fio
    process per span, one after another (one job at a time: fio takes every job's buffers when it starts)."""
    total, seconds = 0, 0.0
    for path, offset, nbytes in spans:
        if nbytes <= 0:
            continue
        (job,) = _run_fio(job_file(path, offset, nbytes, geo, buffers.iomem))
        # fio reads whole requests only: a span that is not a whole number of them ends one request early or late
        # (as the file's end allows); what it read and how long it took are what count
        if job["error"] or abs(job["read"]["io_bytes"] - nbytes) >= geo.request_bytes:
            raise RuntimeError(f"fio read {job['read']['io_bytes']} of {nbytes} bytes of {path} (error {job['error']})")
        total += job["read"]["io_bytes"]
        # fio's runtime is in whole milliseconds; a span read in less than one counts as half of one
        seconds += max(job["read"]["runtime"], 0.5) / 1e3
    return FioRead(total, seconds)
