"""A small deterministic hybrid-attention model that produces all five cache forms: demo, oracle and workload."""

from kvtier.refmodel.config import CompressedSpec, RefConfig, SwaSpec
from kvtier.refmodel.errors import BoundaryError, CorruptObjectError, MissingObjectError, ResumeError, TokenError
from kvtier.refmodel.model import PrefillResult, RefModel
from kvtier.refmodel.objects import export_checkpoint, export_history, required_objects, restore_state
from kvtier.refmodel.state import ObjectId, RefState

__all__ = [
    "BoundaryError",
    "CompressedSpec",
    "CorruptObjectError",
    "MissingObjectError",
    "ObjectId",
    "PrefillResult",
    "RefConfig",
    "RefModel",
    "RefState",
    "ResumeError",
    "SwaSpec",
    "TokenError",
    "export_checkpoint",
    "export_history",
    "required_objects",
    "restore_state",
]
