"""``bench serve``'s speculative-decoding summary, as ``vllm bench serve`` prints it: the
server's ``spec_decode_*`` counters read from its ``/metrics`` page before and after a run."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["SpecCounters", "scrape", "summary"]

_PREFIX = "pagedserve_spec_decode_"

SpecCounters = dict[str, float]  # counter name (without the prefix) or "per_pos/<i>" -> value


async def scrape(client: httpx.AsyncClient, url: str) -> SpecCounters | None:
    """The server's speculative-decoding counters, or None when its page cannot be read
    (another server, or metrics behind auth): the summary is then left out."""
    try:
        r = await client.get(url)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    counters: SpecCounters = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.startswith(_PREFIX) or not s.name.endswith("_total"):
                continue
            name = s.name[len(_PREFIX) : -len("_total")]
            if "position" in s.labels:
                name = f"per_pos/{s.labels['position']}"
            counters[name] = s.value
    return counters


def summary(before: SpecCounters | None, after: SpecCounters | None) -> dict[str, object]:
    """The run's drafts, draft and accepted tokens, acceptance rate, mean acceptance length
    (1 + accepted per draft) and per-position acceptance rates; empty without speculation."""
    if before is None or after is None:
        return {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    drafts = delta.get("num_drafts", 0.0)
    if drafts <= 0:
        return {}
    drafted = delta.get("num_draft_tokens", 0.0)
    accepted = delta.get("num_accepted_tokens", 0.0)
    positions = sorted(int(k.split("/")[1]) for k in delta if k.startswith("per_pos/"))
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(drafted),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts,
        "spec_decode_per_position_acceptance_rate": [
            delta[f"per_pos/{p}"] / drafts for p in positions
        ],
    }
