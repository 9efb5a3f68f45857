"""Typed errors of the cluster tier; a cluster fault on a lookup or load is a miss, these reach only operators."""

from __future__ import annotations

from kvtier.core.errors import KvtierError


class ClusterError(KvtierError):
    """Base of every cluster-tier error."""

    code = "cluster"


class ClusterUnavailable(ClusterError):
    """The cluster did not answer within the deadline, or is marked down until its next probe."""


class ClusterSetupError(ClusterError):
    """The cluster client could not be created: the extra is missing or the master refused the setup."""


class ClusterRequestError(ClusterError, ValueError):
    """A call into the cluster tier was malformed (e.g. keys and layout digests of different lengths)."""


class ClusterPutError(ClusterError):
    """Some objects of a batch were not stored in the cluster (it is full, or refused them)."""
