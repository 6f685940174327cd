"""``deploy/k8s``: the manifests validate against the Kubernetes schemas (offline, with
``kubernetes-validate``), every container command parses with the CLI's own parser, and the
manifests' commands run as local processes, two executors behind one gateway.

No cluster runs here: the run rewrites only what Kubernetes provides (as the compose test
does): service names -> 127.0.0.1 and free ports, ``--executor-dns`` -> the executors the
headless Service would resolve to, ``$(POD_NAME)`` -> the pod's name, the
mounted model -> a tiny one, ``--device cuda`` -> cpu (the GPU memory share dropped), the
internal token from the Secret -> a test token. Kustomize itself is not run: the base's
resources are read as listed in its kustomization.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import grpc
import yaml

from pagedserve.testing.procs import ServiceProcess, wait_serving
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc
from services.blockmgr.client import GrpcClient
from services.blockmgr.service.config import BlockManagerServiceConfig
from services.executor.service.config import ExecutorConfig
from services.gateway.service.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "example"
K8S_VERSION = "1.30.0"
TOKEN = "k8s-test-token"
PARSERS = {
    "blockmgr": BlockManagerServiceConfig.parser,
    "executor": ExecutorConfig.parser,
    "gateway": GatewayConfig.parser,
}


def _docs(kustomization_dir: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((kustomization_dir / "kustomization.yaml").read_text())
    docs = []
    for resource in k["resources"]:
        path = kustomization_dir / resource
        if path.is_dir():
            continue  # another kustomization (the base)
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _workloads() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _docs(BASE) if "template" in d.get("spec", {})}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    docs = _docs(BASE) + _docs(OVERLAY)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Deployment",
            "Service",
            "StatefulSet",
            "Service",
            "PodDisruptionBudget",
            "Deployment",
            "Service",
            "Namespace",
            "PersistentVolumeClaim",
        ]
    )
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomizations_name_files_that_exist() -> None:
    for directory in (BASE, OVERLAY):
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for resource in k["resources"]:
            assert (directory / resource).exists(), resource
    overlay = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    (secret,) = overlay["secretGenerator"]
    assert secret["name"] == "pagedserve-internal"
    assert all((OVERLAY / f.split("=")[-1]).is_file() for f in secret["files"])


def test_every_container_command_parses_with_the_cli_parser() -> None:
    for name, workload in _workloads().items():
        args = [a.replace("$(POD_NAME)", f"{name}-0") for a in _container(workload)["args"]]
        assert args[0] == name
        PARSERS[name]().parse_args(args[1:])  # exits (fails the test) on a bad flag


def test_probes_gpus_secrets_and_disruption_budget() -> None:
    workloads = _workloads()
    for name, workload in workloads.items():
        container = _container(workload)
        port = container["ports"][0]["containerPort"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (name, probe)
        token = next(e for e in container["env"] if e["name"] == "PAGEDSERVE_INTERNAL_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "pagedserve-internal", "key": "token"}
        requests = container["resources"]["requests"]
        assert ("nvidia.com/gpu" in requests) == (name == "executor")
    assert workloads["executor"]["kind"] == "StatefulSet"
    services = {d["metadata"]["name"]: d for d in _docs(BASE) if d["kind"] == "Service"}
    assert services["executor"]["spec"]["clusterIP"] == "None"  # headless: stable pod names
    (pdb,) = [d for d in _docs(BASE) if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"] == workloads["executor"]["spec"]["selector"]
    gateway_args = _container(workloads["gateway"])["args"]
    dns = gateway_args[gateway_args.index("--executor-dns") + 1]
    assert dns == f"{services['executor']['metadata']['name']}:50061"  # every executor pod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(
    args: list[str], pod: str, hosts: dict[str, str], model: Path, executors: list[str]
) -> list[str]:
    """One container's args as a local command (the rewrites of the module docstring)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--gpu-memory-utilization":
            skip = True
            continue
        if a == "--executor-dns":  # what the headless Service's name resolves to
            skip = True
            for address in executors:
                out += ["--executor", address]
            continue
        a = a.replace("$(POD_NAME)", pod)
        a = {"0.0.0.0": "127.0.0.1", "/models/model": str(model), "cuda": "cpu"}.get(a, a)
        out.append(hosts.get(a, a))
    return out


def test_manifest_commands_run_two_executors_behind_one_gateway(tmp_path: Path) -> None:
    from pagedserve.tools.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    workloads = _workloads()
    replicas = workloads["executor"]["spec"]["replicas"]
    ports = {
        "blockmgr": _free_port(),
        "gateway": _free_port(),
        **{f"executor-{i}": _free_port() for i in range(replicas)},
    }
    hosts = {
        "blockmgr:50052": f"127.0.0.1:{ports['blockmgr']}",
        "50052": str(ports["blockmgr"]),
        "50051": str(ports["gateway"]),
        "9090": "-1",
        "8000": str(_free_port()),
    }
    executors = [f"127.0.0.1:{ports[f'executor-{i}']}" for i in range(replicas)]
    env = {"PAGEDSERVE_INTERNAL_TOKEN": TOKEN}
    procs: list[ServiceProcess] = []
    try:
        args = _local(_container(workloads["blockmgr"])["args"], "blockmgr-0", hosts, model, [])
        procs.append(ServiceProcess(args, "blockmgr_listening", env=env))
        for i in range(replicas):
            pod = f"executor-{i}"
            args = _local(
                _container(workloads["executor"])["args"],
                pod,
                {**hosts, "50061": str(ports[pod])},
                model,
                [],
            )
            procs.append(ServiceProcess(args, "executor_ready", env=env))
        args = _local(
            _container(workloads["gateway"])["args"], "gateway-0", hosts, model, executors
        )
        gateway = ServiceProcess(args, "gateway_listening", env=env)
        procs.append(gateway)
        wait_serving(gateway.address)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        results: list[int] = []

        def stream(i: int) -> None:
            req = G.GenerateRequest(
                prompt=f"Hello {i}",
                sampling_params=G.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            )
            results.append(sum(len(r.token_ids) for r in stub.Generate(req, timeout=60)))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [24] * 8
        client = GrpcClient(f"127.0.0.1:{ports['blockmgr']}", internal_token=TOKEN)
        pools = {p.pool_id for p in client.info().pools}
        client.close()
        assert pools == {f"executor-{i}" for i in range(replicas)}  # one pool per pod
    finally:
        for p in reversed(procs):
            p.stop()
