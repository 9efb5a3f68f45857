"""The long kill -9 loop for the disk store (CI runs 50 kills in tests/store); prints one JSON object."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

from support.store_crashloop import crash_loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvtier-stress-", dir=args.dir)
    try:
        result = crash_loop(os.path.join(work, "store"), kills=args.kills, seed=args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({**dataclasses.asdict(result), "seed": args.seed, "ok": True}))


if __name__ == "__main__":
    main()
