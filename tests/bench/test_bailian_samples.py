"""The Bailian-format sample traces: the format's importer reads every line, a later turn
reuses its parent's whole prompt but the partial last block, and a seed gives one trace."""

from __future__ import annotations

import json

import pytest

from bench.bailian_samples import PROFILES, main
from services.blockmgr.trace.public import read_public_trace
from services.blockmgr.trace.sweep import replay_sequential


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_samples_read_as_bailian_with_turns_that_extend_their_parents_prompt(tmp_path, profile):
    path = tmp_path / "s.jsonl"
    assert main(["--profile", profile, "--out", str(path), "--requests", "600"]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    trace = read_public_trace(path, "bailian")
    assert len(trace.requests) == 600 and not trace.bad_lines
    by_chat = {line["chat_id"]: line for line in lines}
    children = [line for line in lines if line["parent_chat_id"] >= 0]
    assert children and all(c["turn"] > 1 for c in children)
    for child in children:
        parent = by_chat[child["parent_chat_id"]]
        kept = len(parent["hash_ids"]) - 1
        assert child["hash_ids"][:kept] == parent["hash_ids"][:kept]
        assert child["hash_ids"][kept] != parent["hash_ids"][kept]  # completed by the output
        assert child["timestamp"] >= parent["timestamp"]
    assert PROFILES[profile](600, 0) == lines  # seed 0: the same trace
    point = replay_sequential(trace, None, "lru")
    assert 0 < point.hit_tokens < point.prompt_tokens
