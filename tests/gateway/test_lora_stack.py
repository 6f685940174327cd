"""Multi-LoRA serving through the real stack: a block manager, two executors each serving
its own adapters (``--enable-lora --lora-modules``), a gateway routing prefix-aware in front
of both with ``--allow-runtime-lora-updating``. The official ``openai`` client names an
adapter in ``model`` and gets PEFT's greedy text; ``/v1/models`` lists the adapters with
their parent; adapters load and unload at runtime; an unknown adapter is a 404 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from pagedserve.tools.lora_adapter import write_random_adapter
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from tests.gateway.conftest import stack_executor_args

# PEFT is the oracle (a dev dependency); a host without its wheel skips these tests.
PeftModel = pytest.importorskip("peft").PeftModel
MODEL = "tiny-llama"


@dataclass
class LoraStack:
    root: str  # the gateway's HTTP root
    grpc_address: str
    adapters: dict[str, Path]  # a, b (loaded at start-up, one per executor), c (not loaded)


@pytest.fixture(scope="module")
def lora_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoraStack]:
    root = tmp_path_factory.mktemp("lora_stack")
    adapters = {
        name: write_random_adapter(tiny_model_dir, root / name, rank=8 + 8 * (i % 2), seed=20 + i)
        for i, name in enumerate("abc")
    }
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    executors = [
        ServiceProcess(
            stack_executor_args(
                tiny_model_dir,
                "--blockmgr-address",
                blockmgr.address,
                "--pool-id",
                f"lora-{name}",
                "--enable-lora",
                "--max-loras",
                "2",
                "--lora-modules",
                f"{name}={adapters[name]}",
            ),
            "executor_ready",
        )
        for name in "ab"
    ]
    gateway = ServiceProcess(
        gateway_args(
            tiny_model_dir,
            executors[0].address,
            "--executor",
            executors[1].address,
            "--routing",
            "prefix-aware",
            "--blockmgr-address",
            blockmgr.address,
            "--allow-runtime-lora-updating",
        ),
        "gateway_listening",
    )
    http_port = int(gateway.wait_for_event("http_listening")["http_port"])
    wait_serving(gateway.address)
    yield LoraStack(f"http://127.0.0.1:{http_port}", gateway.address, adapters)
    for proc in (gateway, *executors, blockmgr):
        assert proc.stop() == 0, proc.args[0]


@pytest.fixture(scope="module")
def peft_text(tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase, lora_stack: LoraStack):  # type: ignore[no-untyped-def]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    names = list(lora_stack.adapters)
    model = PeftModel.from_pretrained(base, lora_stack.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(lora_stack.adapters[name], adapter_name=name)

    def run(prompt: list[int], max_tokens: int, adapter: str) -> str:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                adapter_names=[adapter or "__base__"],
            )
        return tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)

    return run


PROMPT = [1, *range(40, 80)]


def test_the_openai_client_gets_each_adapters_greedy_text_from_the_executor_serving_it(
    lora_stack: LoraStack, peft_text
) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{lora_stack.root}/v1", api_key="unused")
    texts = {}
    for model in (MODEL, "a", "b", "a", "b"):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        texts.setdefault(model, set()).add(out.choices[0].text)
    for model, adapter in ((MODEL, ""), ("a", "a"), ("b", "b")):
        assert texts[model] == {peft_text(PROMPT, 12, adapter)}, model
    assert len({t for ts in texts.values() for t in ts}) == 3  # the adapters change the text


def test_models_lists_the_adapters_with_their_parent(lora_stack: LoraStack) -> None:
    listed = httpx.get(f"{lora_stack.root}/v1/models").json()["data"]
    by_id = {m["id"]: m for m in listed}
    assert set(by_id) >= {MODEL, "a", "b"}
    assert by_id["a"]["parent"] == MODEL and by_id["a"]["root"] == str(lora_stack.adapters["a"])
    assert httpx.get(f"{lora_stack.root}/v1/models/b").json()["parent"] == MODEL


def test_an_unknown_adapter_is_a_404_naming_the_model(lora_stack: LoraStack) -> None:
    client = openai.OpenAI(base_url=f"{lora_stack.root}/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="zz", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "zz" in str(err.value) and err.value.body["param"] == "model"  # type: ignore[index]


def test_an_adapter_loaded_at_runtime_serves_then_unloads(lora_stack: LoraStack, peft_text) -> None:  # type: ignore[no-untyped-def]
    root = lora_stack.root
    body = {"lora_name": "c", "lora_path": str(lora_stack.adapters["c"])}
    r = httpx.post(f"{root}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 200, r.text
    again = httpx.post(f"{root}/v1/load_lora_adapter", json=body, timeout=60)
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused")
    out = client.completions.create(model="c", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == peft_text(PROMPT, 12, "c")
    r = httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)
    bad = httpx.post(
        f"{root}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/nonexistent"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"


def test_grpc_clients_name_the_adapter_and_list_them(lora_stack: LoraStack, peft_text) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(lora_stack.grpc_address) as channel:
        adapters = generation_pb2_grpc.AdaptersStub(channel).ListAdapters(
            generation_pb2.ListLoraAdaptersRequest(), timeout=30
        )
        by_name = {a.name: a for a in adapters.adapters}
        assert by_name["a"].num_executors == 1 and by_name["b"].rank == 16
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
            sampling_params=generation_pb2.SamplingParams(max_tokens=12, temperature=0),
            lora_name="b",
        )
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        text = "".join(r.text for r in stream)
        assert text == peft_text(PROMPT, 12, "b")
        with pytest.raises(grpc.RpcError) as err:
            request.lora_name = "nope"
            list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_metrics_name_the_adapters_like_vllms_lora_requests_info(lora_stack: LoraStack) -> None:
    text = httpx.get(f"{lora_stack.root}/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("pagedserve_lora_requests_info")]
    assert lines and 'max_lora="2"' in lines[0]
