"""Whether a ``laminar up`` job spans hosts, and its authentication rule when it does.

Owns the one decision "this stack is reachable from, or runs on, more than one
machine" (:func:`spanning_reasons`) and the refusal that follows from it
(:func:`check_auth`): a job that spans hosts runs only with authentication on
in every Laminar tier (``auth.dir``, from ``laminar keys``), or with
``auth: {insecure: true}`` written in every tier that has none, which is
warned about loudly. It reads job-file dicts only: it imports no tier config.

A job spans hosts when any of these holds:

- its etcd endpoints are not all on loopback;
- its tiers name more than one ``host_id`` (hosts emulated on one machine
  count: they stand for a cluster);
- a tier binds or advertises an address other than loopback (a wildcard
  bind listens on every interface);
- the launcher runs it on a cluster of more than one node (Ray).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

from laminar_common.errors import ConfigError
from laminar_common.net import endpoint_host, is_loopback, is_wildcard

__all__ = ["is_laminar_tier", "spanning_reasons", "check_auth"]

log = logging.getLogger(__name__)

_TIER_COMMAND = re.compile(r"^laminar-(relay|rollout|trainer)$|^laminar_(relay|rollout|trainer)\.cli$")


def is_laminar_tier(command: Iterable[str]) -> bool:
    """Whether ``command`` starts one of Laminar's tiers (which have an ``auth`` config),
    directly or under a wrapper such as ``torchrun -m laminar_trainer.cli``."""
    return any(_TIER_COMMAND.match(str(part)) for part in command)


def spanning_reasons(configs: Mapping[str, Mapping[str, Any]], etcd_endpoints: Iterable[str],
                     nodes: int = 1) -> list[str]:
    """Why a job with these replica configs spans hosts ([] when it does not).

    Args:
        configs: each tier replica's config as the job file gives it, by replica name.
        etcd_endpoints: the endpoints the tiers are given ([] for an embedded etcd
            on loopback).
        nodes: machines the launcher places replicas on.
    """
    reasons = []
    if nodes > 1:
        reasons.append(f"it runs on {nodes} nodes")
    remote = [h for h in map(endpoint_host, etcd_endpoints) if not is_loopback(h)]
    if remote:
        reasons.append(f"etcd is at {remote[0]!r}, not on loopback")
    host_ids = sorted({str(c["host_id"]) for c in configs.values() if c.get("host_id")})
    if len(host_ids) > 1:
        reasons.append(f"its tiers name {len(host_ids)} host ids ({', '.join(host_ids)})")
    for name, config in configs.items():
        for field in ("bind_host", "advertise_host"):
            host = config.get(field)
            if isinstance(host, str) and (is_wildcard(host) or not is_loopback(host)):
                reasons.append(f"{name} has {field}: {host!r}, reachable from other hosts")
                break
    return reasons


def check_auth(configs: Mapping[str, Mapping[str, Any]], reasons: list[str]) -> list[str]:
    """Refuse a job that spans hosts (``reasons``) while a Laminar tier runs without auth.

    Args:
        configs: the Laminar tier replicas' configs (see :func:`is_laminar_tier`) by name.
        reasons: :func:`spanning_reasons`' answer.

    Returns:
        The replicas that run unauthenticated because they say ``auth: {insecure: true}``
        (the caller warns about them); [] when the job does not span hosts.

    Raises:
        ConfigError: the job spans hosts and some replicas set neither ``auth.dir``
            nor ``auth.insecure: true``; names them and why the job spans hosts.
    """
    if not reasons:
        return []
    bare, insecure = [], []
    for name, config in configs.items():
        auth = config.get("auth")
        auth = auth if isinstance(auth, Mapping) else {}
        if auth.get("dir"):
            continue
        (insecure if auth.get("insecure") is True else bare).append(name)
    if bare:
        raise ConfigError(
            f"this job spans hosts ({'; '.join(reasons)}) but {', '.join(bare)} "
            f"{'runs' if len(bare) == 1 else 'run'} without authentication: anyone who reaches "
            "their sockets could push trajectories or publish weights. Set auth.dir in every "
            "tier (`laminar keys --split --host ADDR ... --out DIR` writes one dir a tier), or "
            "write auth: {insecure: true} in those tiers to run unauthenticated on a network "
            "you trust")
    if insecure:
        log.warning("job spans hosts (%s) and runs WITHOUT AUTHENTICATION in %s "
                    "(auth.insecure: true)", "; ".join(reasons), ", ".join(insecure))
    return insecure
