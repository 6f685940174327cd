"""The executor's flags of its KV-cache tiers (host memory, then disk, behind the KV cache),
one group in ``--help``; their fields and checks are :class:`~.config.ExecutorConfig`'s."""

from __future__ import annotations

import argparse

from services.blockmgr.api.types import EvictionPolicyName

__all__ = ["add_tier_args"]


def add_tier_args(parser: argparse.ArgumentParser, eviction_policy: EvictionPolicyName) -> None:
    """Add the tier flags to ``parser`` (``eviction_policy``: the tiers' default order)."""
    g = parser.add_argument_group("KV-cache tiers")
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        metavar="GIB",
        help="GiB of host memory for a KV tier behind the KV cache: evicted blocks are "
        "offloaded there and onboarded on a prefix hit (0: none)",
    )
    g.add_argument(
        "--kv-offloading-backend",
        default="native",
        choices=["native"],
        help="how blocks move to and from the host tier (native: copies between tensors)",
    )
    g.add_argument(
        "--kv-offloading-disk-path",
        default=None,
        metavar="DIR",
        help="directory for a KV tier on disk below the host tier (one file of "
        "--kv-offloading-disk-size GiB): host-tier blocks evicted for others are spilled "
        "there and loaded back on a prefix hit",
    )
    g.add_argument(
        "--kv-offloading-disk-size",
        type=float,
        default=0.0,
        metavar="GIB",
        help="GiB of the disk tier (0: none; needs --kv-offloading-size and "
        "--kv-offloading-disk-path)",
    )
    g.add_argument(
        "--kv-offloading-eviction-policy",
        type=EvictionPolicyName,
        default=eviction_policy,
        choices=list(EvictionPolicyName),
        help="the order in which the host and disk tiers reuse their cached slots (the "
        "KV cache's own is --eviction-policy)",
    )
