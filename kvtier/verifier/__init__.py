"""The independent verifier/cleaner of the disk store, and `kvtier audit` (see verifier.py for the loop)."""

from kvtier.core.verifier_status import verifier_status
from kvtier.verifier.errors import StoreNotFound, VerifierError
from kvtier.verifier.layouts import LayoutOracle
from kvtier.verifier.policy import Candidate, plan_eviction
from kvtier.verifier.process import open_store
from kvtier.verifier.settings import VerifierSettings, settings_from_config
from kvtier.verifier.store_report import AuditReport, NamespaceReport, audit_store, render_table
from kvtier.verifier.verifier import Verifier

__all__ = [
    "AuditReport",
    "Candidate",
    "LayoutOracle",
    "NamespaceReport",
    "StoreNotFound",
    "Verifier",
    "VerifierError",
    "VerifierSettings",
    "audit_store",
    "open_store",
    "plan_eviction",
    "render_table",
    "settings_from_config",
    "verifier_status",
]
