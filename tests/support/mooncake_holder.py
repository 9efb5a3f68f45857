"""A Mooncake holder: contributes `segment` bytes of memory to the pool until killed (tests, bench).

usage: python tests/support/mooncake_holder.py METADATA MASTER SEGMENT_BYTES READY_FILE
"""

from __future__ import annotations

import pathlib
import signal
import sys
import threading


def main() -> None:
    from mooncake.store import MooncakeDistributedStore

    metadata, master, segment, ready = sys.argv[1], sys.argv[2], int(sys.argv[3]), pathlib.Path(sys.argv[4])
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        sys.exit(f"holder: setup against {master} failed with code {rc}")
    ready.write_text("ready")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    store.close()


if __name__ == "__main__":
    main()
