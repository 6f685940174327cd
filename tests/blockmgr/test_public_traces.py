"""Public traces (Mooncake's, Qwen-Bailian's format) replayed through the real block manager:
at unbounded capacity the hit ratio is exactly the trace's maximum, computed here without the
block manager; a bounded pool hits less; bad lines are named; the sweep's JSON keeps its
names."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from services.blockmgr.trace.public import read_public_trace
from services.blockmgr.trace.replay import main as replay_main
from services.blockmgr.trace.sweep import parse_capacity, replay_sequential, sweep
from services.blockmgr.trace.timed import ServiceModel, replay_timed


def _conversations(seed: int, num: int, block: int) -> list[dict]:
    """Mooncake-shaped requests: sessions whose turns extend their previous prompt (shared
    leading hash ids), a common system prefix on some, one-off prompts between."""
    rng = random.Random(seed)
    next_id, sessions, lines = 0, [], []

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    system = fresh(3)
    for i in range(num):
        if sessions and rng.random() < 0.6:
            s = rng.randrange(len(sessions))
            hashes = sessions[s] + fresh(rng.randint(1, 3))
            sessions[s] = hashes
        else:
            hashes = (system if rng.random() < 0.5 else []) + fresh(rng.randint(1, 6))
            if rng.random() < 0.7:
                sessions.append(hashes)
        length = (len(hashes) - 1) * block + rng.randint(1, block)
        lines.append(
            {
                "timestamp": i * 100,
                "input_length": length,
                "output_length": rng.randint(1, 300),
                "hash_ids": hashes,
            }
        )
    return lines


def _maximum(lines: list[dict], block: int) -> float:
    """The trace's maximum hit ratio: leading ids seen before, in tokens, capped."""
    seen: set[int] = set()
    hit = total = 0
    for r in lines:
        run = next((i for i, h in enumerate(r["hash_ids"]) if h not in seen), len(r["hash_ids"]))
        hit += min(run * block, r["input_length"])
        total += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / total


def _write(path: Path, lines: list[dict], extra: str = "") -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + extra)
    return path


@pytest.mark.parametrize("block_size", [512, 64])
def test_an_unbounded_pool_hits_exactly_the_traces_maximum(tmp_path, block_size):
    lines = _conversations(1, 400, 512)
    trace = read_public_trace(_write(tmp_path / "t.jsonl", lines), "mooncake")
    point = replay_sequential(trace, None, "lru", block_size)
    assert point.hit_ratio == pytest.approx(_maximum(lines, 512), abs=0)
    assert point.hit_ratio == point.max_hit_ratio > 0.2
    assert point.num_refused == 0


def test_a_bounded_pool_hits_less_and_more_capacity_hits_more(tmp_path):
    lines = _conversations(2, 400, 512)
    trace = read_public_trace(_write(tmp_path / "t.jsonl", lines), "mooncake")
    points = sweep(trace, [20_000, 200_000, None], ["lru", "s3fifo"], workers=2)
    by = {(p.policy, p.capacity_tokens): p.hit_ratio for p in points}
    for policy in ("lru", "s3fifo"):
        assert 0 < by[(policy, 20_000)] < by[(policy, 200_000)] <= by[(policy, None)]
    assert [(p.policy, p.capacity_tokens) for p in points] == [
        ("lru", 20_000),
        ("s3fifo", 20_000),
        ("lru", 200_000),
        ("s3fifo", 200_000),
        ("lru", None),
        ("s3fifo", None),
    ]


def test_a_request_larger_than_the_pool_is_refused_and_counted(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 4000, "output_length": 1, "hash_ids": list(range(8))},
        {"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [99]},
    ]
    trace = read_public_trace(_write(tmp_path / "t.jsonl", lines), "mooncake")
    point = replay_sequential(trace, 2048, "lru")
    assert (point.num_refused, point.prompt_tokens, point.hit_tokens) == (1, 4100, 0)


def test_bailian_lines_keep_their_session_fields_and_bad_lines_are_named(tmp_path):
    good = {
        "chat_id": 7,
        "parent_chat_id": 3,
        "timestamp": 1.5,
        "input_length": 40,
        "output_length": 9,
        "type": "search",
        "turn": 2,
        "hash_ids": [1, 2, 3],
    }
    first = {**good, "chat_id": 3, "parent_chat_id": -1, "timestamp": 0.5, "turn": 1}
    bad = [
        "not json",
        json.dumps({**good, "hash_ids": [1, 2]}),  # 40 tokens are 3 blocks of 16
        json.dumps({k: v for k, v in good.items() if k != "turn"}),
        json.dumps({**good, "input_length": -1}),
    ]
    path = _write(tmp_path / "b.jsonl", [good, first], "\n".join(bad) + "\n")
    trace = read_public_trace(path, "bailian")
    assert [r.chat_id for r in trace.requests] == [3, 7]  # by arrival
    assert trace.requests[0].parent_chat_id is None
    assert (trace.requests[1].parent_chat_id, trace.requests[1].type) == (3, "search")
    assert [(b.line, b.reason) for b in trace.bad_lines] == [
        (3, "Expecting value: line 1 column 1 (char 0)"),
        (4, "2 hash_ids for input_length 40 (blocks of 16 tokens: 3)"),
        (5, "missing field 'turn'"),
        (6, "input_length must be an integer >= 0"),
    ]


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("3M", 3_000_000), ("250000", 250_000), ("1.5k", 1500), ("10b", 160), ("unbounded", None)],
)
def test_capacities_are_tokens_blocks_or_unbounded(text, tokens):
    assert parse_capacity(text, 16) == tokens


@pytest.mark.parametrize("text", ["3X", "", "0", "-5"])
def test_a_bad_capacity_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="--capacity"):
        parse_capacity(text, 16)


def test_the_cli_prints_a_table_and_writes_the_points_and_the_plot(tmp_path, capsys):
    trace = _write(tmp_path / "t.jsonl", _conversations(3, 200, 512))
    out, png = tmp_path / "points.json", tmp_path / "hits.png"
    args = [str(trace), "--format", "mooncake", "--capacity", "50k,unbounded"]
    assert replay_main([*args, "--policy", "lru,arc", "--json", str(out), "--plot", str(png)]) == 0
    points = json.loads(out.read_text())
    assert {"policy", "capacity_tokens", "prompt_tokens", "hit_tokens", "hit_ratio"} <= set(
        points[0]
    )
    assert [(p["policy"], p["capacity_tokens"]) for p in points] == [
        ("lru", 50_000),
        ("arc", 50_000),
        ("lru", None),
        ("arc", None),
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| lru | unbounded |" in capsys.readouterr().out


def test_timed_replay_of_requests_that_never_overlap_is_the_sequential_one(tmp_path):
    lines = _conversations(4, 300, 512)  # 0.1 s apart; each runs under 10 ms here
    trace = read_public_trace(_write(tmp_path / "t.jsonl", lines), "mooncake")
    model = ServiceModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=1e6, max_concurrency=1)
    for capacity in (30_000, None):
        timed = replay_timed(trace, capacity, "lru", model=model)
        sequential = replay_sequential(trace, capacity, "lru")
        assert (timed.hit_tokens, timed.num_refused) == (
            sequential.hit_tokens,
            sequential.num_refused,
        )
        assert timed.mean_wait_s == 0 and timed.max_waiting == 1


def test_blocks_in_use_are_not_evicted_and_admissions_wait_for_them(tmp_path):
    """Three requests at once, each holding 3 blocks (2 of prompt, the output's) for 10 s, in
    a pool of 6: the third, which needs one block more than its hit, waits for the first to
    end, then hits the prefix the first committed."""
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [3, 4]},
        {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [1, 2]},
    ]
    trace = read_public_trace(_write(tmp_path / "t.jsonl", lines), "mooncake")
    model = ServiceModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=10, max_concurrency=8)
    point = replay_timed(trace, 6 * 512, "lru", model=model)
    assert point.num_refused == 0 and point.num_evicted_blocks == 0
    assert point.mean_wait_s == pytest.approx(10 / 3)  # the third waited 10 s
    assert point.hit_tokens == 1000  # its whole prompt (capped at its input_length)


def test_a_bad_service_model_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--decode-tokens-per-s must be > 0"):
        ServiceModel(decode_tokens_per_s=0)
    with pytest.raises(ValueError, match="--max-concurrency must be >= 1"):
        ServiceModel(max_concurrency=0)


def test_a_host_tier_under_a_small_device_cache_gets_back_what_it_evicted(tmp_path):
    lines = _conversations(6, 400, 512)
    trace = read_public_trace(_write(tmp_path / "t.jsonl", lines), "mooncake")
    points = sweep(trace, [20_000], ["lru"], host_capacities=[0, 10_000_000])
    alone, tiered = points
    assert (alone.host_capacity_tokens, tiered.host_capacity_tokens) == (0, 10_000_000)
    assert alone.host_hit_tokens == 0 < tiered.host_hit_tokens
    assert alone.hit_ratio < tiered.hit_ratio == pytest.approx(tiered.max_hit_ratio)


def test_a_session_pinned_between_its_turns_outlives_the_one_off_prompts_between_them(tmp_path):
    """Replay ``--pin-sessions``: a session's second turn, an hour after its first with one-off
    prompts from 700 s on, hits its first turn's blocks when the first turn was pinned for two
    hours, not for ten minutes nor unpinned; a request no later turn continues is never
    pinned."""
    block = 512
    first = {
        "timestamp": 0,
        "input_length": 4 * block,
        "output_length": 1,
        "hash_ids": [0, 1, 2, 3],
    }
    floods = [
        {
            "timestamp": 700_000 + 1000 * i,  # (ms) from 700 s on
            "input_length": 8 * block,
            "output_length": 1,
            "hash_ids": list(range(100 + 8 * i, 108 + 8 * i)),
        }
        for i in range(30)
    ]
    second = {
        "timestamp": 3_600_000,
        "input_length": 6 * block,
        "output_length": 1,
        "hash_ids": [0, 1, 2, 3, 4, 5],
    }
    trace = read_public_trace(_write(tmp_path / "t.jsonl", [first, *floods, second]), "mooncake")
    assert trace.followed() == [True, *[False] * 30, False]
    capacity = 40 * block  # the floods turn it over; a 10 % pin budget keeps 4 blocks
    plain = replay_sequential(trace, capacity, "lru")
    short = replay_sequential(trace, capacity, "lru", pin_ttl_s=600)
    long = replay_sequential(trace, capacity, "lru", pin_ttl_s=7200)
    assert plain.hit_tokens == short.hit_tokens == 0  # expired before the second turn
    assert long.hit_tokens == 4 * block and long.pin_ttl_s == 7200


def test_bailian_sessions_are_followed_by_their_children(tmp_path):
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "turn": 1},
        {"chat_id": 2, "parent_chat_id": -1, "turn": 1},
        {"chat_id": 3, "parent_chat_id": 1, "turn": 2},
    ]
    lines = [
        {
            **row,
            "timestamp": float(i),
            "input_length": 32,
            "output_length": 4,
            "type": "text",
            "hash_ids": [10 * i, 10 * i + 1],
        }
        for i, row in enumerate(rows)
    ]
    trace = read_public_trace(_write(tmp_path / "b.jsonl", lines), "bailian")
    assert trace.followed() == [True, False, False]
