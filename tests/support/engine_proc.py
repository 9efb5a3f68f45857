"""One engine process: the reference model through `kvtier.client` (a `RefEngine`), driven by the e2e tests.

    engine_proc.py SOCKET PROFILE WORKDIR offload NAME...   prefill WORKDIR/NAME.npy, offload durably; a JSON line each
    engine_proc.py SOCKET PROFILE WORKDIR continue NAME...  restore + continue, logits to WORKDIR/NAME.logits.pt; same
    engine_proc.py SOCKET PROFILE WORKDIR hold NAME          look up, print the leases held, wait until killed
    engine_proc.py SOCKET PROFILE WORKDIR wait NAME...      attach, print the namespace, wait for a line on stdin,
                                                            then as `continue` (an engine attached before a rollout)

PROFILE is a bundled name or a TOML path; the client attaches to that profile's name, or to its canary with
PROFILE@canary. With ENGINE_WEIGHTS_DIGEST set the model is that version of the profile (a rollout's new weights).
The tests fork it warm (`e2e_harness.start_engine`, `support.warm_start`) with these arguments as sys.argv.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from kvtier.client import Client
from kvtier.core.profile import ModelProfile, load_profile
from kvtier.refmodel import RefModel
from kvtier.refmodel.engine import RefEngine

CHECKPOINT_EVERY = 4  # hash blocks between state checkpoints (128 tokens on ref-tiny)


def engine_profile(profile: ModelProfile) -> ModelProfile:
    """The profile at the version this engine runs: ENGINE_WEIGHTS_DIGEST, when set, is its weights digest."""
    digest = os.environ.get("ENGINE_WEIGHTS_DIGEST")
    return dataclasses.replace(profile, version=profile.version.bumped(weights_digest=digest)) if digest else profile


def emit(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def main() -> None:
    socket_path, profile_arg, workdir, role, *names = sys.argv[1:]
    torch.set_num_threads(1)
    profile_arg, _, version = profile_arg.partition("@")
    profile = engine_profile(load_profile(profile_arg))
    work = Path(workdir)
    with Client(socket_path, name=f"engine {role}") as client:
        att = client.attach(f"{profile.name}@{version}" if version else profile.name)
        engine = RefEngine(client, RefModel(profile), checkpoint_every=CHECKPOINT_EVERY)
        if role == "wait":
            emit({"attached": att.namespace.hex()})
            sys.stdin.readline()
            role = "continue"
        for name in names:
            tokens = np.load(work / f"{name}.npy")
            if role == "offload":
                rep = engine.prefill_and_offload(tokens, durable=True)
                emit(
                    {
                        "name": name,
                        "written": rep.written,
                        "skipped": rep.skipped,
                        "refused": rep.refused,
                        "persisted": rep.persisted,
                    }
                )
            elif role == "continue":
                rep = engine.restore_and_continue(tokens)
                torch.save(rep.logits, work / f"{name}.logits.pt")
                cv = rep.final_cv
                emit({"name": name, **rep.to_dict(), "routes": cv.routes.tolist(), "reasons": cv.reasons.tolist()})
            elif role == "hold":
                result = client.lookup(tokens)
                emit({"name": name, "held": len(result.leases), "hit_tokens": result.hit_tokens})
                sys.stdin.read()  # until killed
            else:
                raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
