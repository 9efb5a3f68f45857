"""Which namespaces the daemon serves as a profile's live version or canary, as it last published them.

The store knows only live and retired; the daemon publishes the roles of the namespaces it serves as a JSON
document in the store's index (`meta_doc("rollout")`) at every change, so `kvtier audit` (which opens the
store, not the daemon) can tell a canary from a live version.
"""

from __future__ import annotations

from kvtier.core.verifier_status import MetaDocs

ROLLOUT_DOC = "rollout"


def namespace_roles(store: MetaDocs) -> dict[str, tuple[str, str]]:
    """namespace hex -> (state "live" | "canary", profile), as the daemon last published them ({} if never)."""
    doc = store.meta_doc(ROLLOUT_DOC) or {}
    return {ns: (str(v["state"]), str(v["profile"])) for ns, v in doc.get("namespaces", {}).items()}
