"""Typed errors of the reference model's resume path."""

from __future__ import annotations

from kvtier.core.errors import KvtierError


class ResumeError(KvtierError):
    """A resume was asked for a boundary or with objects the model cannot start from."""

    code = "bad_resume"


class MissingObjectError(ResumeError):
    """Cache objects needed at the boundary are absent; names every (group, block) missing."""

    code = "missing_object"

    def __init__(self, boundary: int, missing: list[tuple[str, int]]) -> None:
        self.boundary = boundary
        self.missing = list(missing)
        shown = ", ".join(f"{g} block {b}" for g, b in self.missing[:6])
        more = f" and {len(self.missing) - 6} more" if len(self.missing) > 6 else ""
        super().__init__(
            f"cannot resume at token {boundary}: missing {shown}{more}; "
            "load them, or resume at an earlier checkpoint boundary"
        )


class CorruptObjectError(ResumeError):
    """An object has the right size but holds values no export can produce (NaN or infinity)."""

    code = "corrupt"


class BoundaryError(ResumeError):
    """A checkpoint or resume point is not a hash-block boundary the state can be cut at."""

    code = "bad_boundary"


class TokenError(KvtierError):
    """Token ids outside the model's vocabulary, or not a flat sequence of integers."""

    code = "bad_tokens"
