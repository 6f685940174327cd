"""``bench.llamacpp_bench`` without llama.cpp: it skips saying why, and its workloads are the
ones the comparison was specified with."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.llamacpp_bench import main, workload


def test_without_a_llama_cpp_tree_it_skips_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out.startswith("skipped: no --llama-cpp tree given")
    assert main(["--llama-cpp", str(tmp_path)]) == 0
    assert "convert_hf_to_gguf.py not found" in capsys.readouterr().out


def test_the_workloads_are_the_specified_ones() -> None:
    chat = workload("chat", 0)
    assert len(chat) == 64 and {r.output_len for r in chat} == {64}
    assert min(r.prompt_len for r in chat) >= 35 and max(r.prompt_len for r in chat) <= 254
    burst = workload("burst", 0)
    assert len(burst) == 200
    assert {(r.prompt_len, r.output_len) for r in burst} == {(128, 64)}
    assert workload("chat", 0) == chat  # seeded
