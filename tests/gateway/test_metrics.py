"""The gateway's executor-side metrics: each executor's load report (as the executor builds it
and sends it) summed over executors at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.executor.service.commands import Load
from services.executor.service.servicer import load_to_pb
from services.gateway.core.metrics import GatewayMetrics


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_tier_moves_and_failed_moves_of_every_executor_are_summed_by_move() -> None:
    loads = [
        load_to_pb(
            Load(
                num_offloaded_blocks=5,
                num_onboarded_blocks=2,
                num_spilled_blocks=3,
                num_loaded_blocks=1,
                num_failed_moves=1,
            )
        ),
        load_to_pb(Load(num_offloaded_blocks=1, num_stored_blocks=4, num_failed_moves=2)),
    ]
    samples = _samples(GatewayMetrics(lambda: loads))
    moved = {
        dict(labels)["move"]: value
        for (name, labels), value in samples.items()
        if name == "pagedserve_kv_tier_blocks_moved_total"
    }
    assert moved == {"offload": 6, "onboard": 2, "spill": 3, "load": 1, "store": 4}
    assert samples[("pagedserve_kv_tier_failed_moves_total", ())] == 3


def test_without_executors_every_tier_counter_is_zero() -> None:
    samples = _samples(GatewayMetrics(list))
    assert samples[("pagedserve_kv_tier_blocks_moved_total", (("move", "offload"),))] == 0
    assert samples[("pagedserve_kv_tier_failed_moves_total", ())] == 0


def test_speculative_decoding_counters_are_summed_over_executors_and_positions() -> None:
    loads = [
        load_to_pb(
            Load(
                num_spec_drafts=4,
                num_spec_draft_tokens=12,
                num_spec_accepted_tokens=7,
                spec_accepted_per_pos=(4, 2, 1),
            )
        ),
        load_to_pb(
            Load(
                num_spec_drafts=1,
                num_spec_draft_tokens=2,
                num_spec_accepted_tokens=1,
                spec_accepted_per_pos=(1,),
            )
        ),
        load_to_pb(Load()),  # an executor without speculation
    ]
    samples = _samples(GatewayMetrics(lambda: loads))
    assert samples[("pagedserve_spec_decode_num_drafts_total", ())] == 5
    assert samples[("pagedserve_spec_decode_num_draft_tokens_total", ())] == 14
    assert samples[("pagedserve_spec_decode_num_accepted_tokens_total", ())] == 8
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), value in samples.items()
        if name == "pagedserve_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 5, "1": 2, "2": 1}
