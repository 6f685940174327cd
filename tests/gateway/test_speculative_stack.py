"""Speculative decoding through the real stack (block manager, executor with
``--speculative-config``, n-gram, a draft model or an EAGLE-3 head, gateway): OpenAI
completions give transformers' greedy text, the gateway's ``/metrics`` carries vLLM's
``spec_decode`` counters, and ``bench serve`` prints the acceptance summary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from pagedserve.tools.eagle3_head import write_random_head
from services.bench.serve import main as bench_serve
from tests.gateway.conftest import stack_executor_args


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle3"])
def spec_stack(
    request, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServiceProcess]]:
    """The stack with n-gram drafts, with a draft model (the model itself: it loads in the
    executor process beside the target, its cache sized with the target's), or with a random
    EAGLE-3 head (its pool registered over gRPC with a prefix hit margin of one block)."""
    if request.param == "ngram":
        spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    elif request.param == "draft_model":
        spec = json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 4})
    else:
        head = write_random_head(tiny_model_dir, tmp_path_factory.mktemp("eagle3") / "head")
        spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 4})
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    executor = ServiceProcess(
        stack_executor_args(
            tiny_model_dir,
            "--blockmgr-address",
            blockmgr.address,
            "--pool-id",
            "spec-stack",
            "--speculative-config",
            spec,
        ),
        "executor_ready",
    )
    gateway = ServiceProcess(gateway_args(tiny_model_dir, executor.address), "gateway_listening")
    http_port = int(gateway.wait_for_event("http_listening")["http_port"])
    wait_serving(gateway.address)
    yield f"http://127.0.0.1:{http_port}", executor
    for proc in (gateway, executor, blockmgr):
        assert proc.stop() == 0, proc.args[0]


def _counters(root: str) -> dict[str, float]:
    text = httpx.get(f"{root}/metrics").text
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("pagedserve_spec_decode_num_") and "{" not in line
    }


def test_completions_are_transformers_greedy_and_the_counters_move(
    spec_stack, tokenizer, hf_greedy
) -> None:
    root, _ = spec_stack
    passage = tokenizer("the cat sat on the mat and the dog ran", add_special_tokens=False)
    ids = [tokenizer.bos_token_id, *passage.input_ids, *passage.input_ids[:4]]
    before = _counters(root)
    r = httpx.post(
        f"{root}/v1/completions",
        json={"model": "tiny-llama", "prompt": ids, "max_tokens": 80, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    expected = tokenizer.decode(hf_greedy(ids, 80), skip_special_tokens=True)
    assert r.json()["choices"][0]["text"] == expected
    after = _counters(root)
    drafts = after["pagedserve_spec_decode_num_drafts_total"]
    assert drafts > before.get("pagedserve_spec_decode_num_drafts_total", 0)
    assert (
        after["pagedserve_spec_decode_num_accepted_tokens_total"]
        <= after["pagedserve_spec_decode_num_draft_tokens_total"]
    )


def test_bench_serve_reports_the_acceptance_of_the_run(spec_stack, tiny_model_dir, tmp_path):
    root, _ = spec_stack
    argv = [
        "--backend", "openai", "--base-url", root, "--tokenizer", str(tiny_model_dir),
        "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "60",
        "--ignore-eos", "--request-rate", "inf", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "out.json",
    ]  # fmt: skip
    assert bench_serve(argv) == 0
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["spec_decode_num_drafts"] > 0
    assert r["spec_decode_acceptance_length"] == pytest.approx(
        1 + r["spec_decode_accepted_tokens"] / r["spec_decode_num_drafts"]
    )
    assert 0 <= r["spec_decode_acceptance_rate"] <= 1
