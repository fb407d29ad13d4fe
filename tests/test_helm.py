"""The Helm chart (helm/iterserve): rendered with Helm's own SDK (helm-python-sdk, no binary),
validated against Kubernetes' schemas, KubeRay's CRDs and Serve's config schema, and its
serve config deployed to a real Ray cluster."""

from __future__ import annotations

import argparse
import copy
import functools
import json
import shutil
import tempfile
import time
from pathlib import Path

import helm_python as helm
import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deploy import chart_schema
from deploy.batch import _engine_config, add_arguments, apply_config
from deploy.config import AutoscalingConfig, ServiceConfig
from deploy.server import SERVE_ENV_DEFAULTS
from tests.ray_head import cli, ray, ray_env, start_head, stop_head
from tests.serving_app import free_port

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm/iterserve"
CRDS = Path(__file__).resolve().parent / "data/kuberay-crds"
K8S_VERSION = "1.34.0"
EXAMPLES = {
    "default": {},
    "cpu": yaml.safe_load((CHART / "values-cpu.yaml").read_text()),
    "gpu": yaml.safe_load((CHART / "values-gpu.yaml").read_text()),
}
SECTION = {"min_replicas": 2, "max_replicas": 6, "scale_down_delay_s": 300}
# The CPU example, autoscaled: its fixed count replaced by an autoscaling section.
EXAMPLES["autoscaled"] = {
    **EXAMPLES["cpu"],
    "config": {
        **{k: v for k, v in EXAMPLES["cpu"]["config"].items() if k != "num_replicas"},
        "autoscaling": SECTION,
    },
}
EVERYTHING_ON = {
    "ingress": {
        "enabled": True,
        "host": "llm.example.com",
        "tls": [{"hosts": ["llm.example.com"], "secretName": "tls"}],
    },
    "podMonitor": {"enabled": True},
    "apiKeysSecret": "keys",
    "modelVolume": {"hostPath": "/srv/models"},
    "adapterVolume": {"claimName": "adapters"},
    "batchJob": {
        "enabled": True,
        "input": "/data/in.jsonl",
        "output": "/data/out.jsonl",
        "claimName": "batch-data",
        "args": ["--ordered"],
    },
}


def render(values: dict) -> list[dict]:
    """Every object the chart renders with ``values``."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="demo", namespace="llm")
    return [
        doc
        for name, text in sorted(files.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


@functools.cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    """The v1 schema of KubeRay's CRD for ``kind``, as a validator: parsed and checked once
    (the CRD files are large; parsing one takes seconds)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML has it
    crd = yaml.load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_chart_lints_clean(example):
    result = helm.lint(str(CHART), values=EXAMPLES[example])
    assert result["errors"] == [] and result["messages"] == [], result


def test_values_schema_is_generated_from_service_config():
    committed = (CHART / "values.schema.json").read_text()
    assert committed == chart_schema.render(), "run: python -m deploy.chart_schema"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_standard_objects_pass_kubernetes_schemas(example):
    objs = render({**EXAMPLES[example], **EVERYTHING_ON})
    standard = [o for o in objs if o["apiVersion"].split("/")[0] in ("v1", "networking.k8s.io")]
    # The API's Service is declared inside the RayService; KubeRay creates it as written.
    standard += [
        {"apiVersion": "v1", "kind": "Service", **s["spec"]["serveService"]}
        for s in by_kind(objs, "RayService")
    ]
    assert sorted(o["kind"] for o in standard) == ["ConfigMap", "ConfigMap", "Ingress", "Service"]
    for obj in standard:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_ray_objects_pass_kuberay_crds(example):
    objs = render({**EXAMPLES[example], **EVERYTHING_ON})
    assert len(by_kind(objs, "RayService")) == len(by_kind(objs, "RayJob")) == 1
    for obj in by_kind(objs, "RayService") + by_kind(objs, "RayJob"):
        crd_validator(obj["kind"]).validate(obj)


def test_crd_check_catches_a_broken_manifest():
    (svc,) = by_kind(render({}), "RayService")
    svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="two"):
        crd_validator("RayService").validate(svc)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_serve_config_parses_with_serve_and_service_config(example):
    (svc,) = by_kind(render(EXAMPLES[example]), "RayService")
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "deploy.app:app_builder"
    config = ServiceConfig(**app["args"], **serve_config["http_options"])
    values = {
        **yaml.safe_load((CHART / "values.yaml").read_text())["config"],
        **EXAMPLES[example].get("config", {}),
    }
    # The app gets the service the values describe: every field, autoscaling included
    # (api_keys_file is the chart's: the mounted Secret).
    expected = ServiceConfig(**values)
    assert config.model_dump(exclude={"api_keys_file"}) == expected.model_dump(
        exclude={"api_keys_file"}
    )
    for key in ("model", "replica_num_cpus", "replica_num_gpus", "port"):
        assert getattr(config, key) == values[key]
    start = values["autoscaling"]["min_replicas"] if "autoscaling" in values else 1
    assert config.num_replicas == values.get("num_replicas", start)


def test_api_service_ingress_and_pod_monitor_use_the_serve_port():
    objs = render({**EXAMPLES["gpu"], **EVERYTHING_ON})
    (svc,) = by_kind(objs, "RayService")
    # KubeRay keeps a serveService port only under the head container's port name.
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"containerPort": 8000, "name": "serve"} in head["containers"][0]["ports"]
    assert [p["name"] for p in svc["spec"]["serveService"]["spec"]["ports"]] == ["serve"]
    (ing,) = by_kind(objs, "Ingress")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "demo-iterserve-api", "port": {"name": "serve"}}
    (mon,) = by_kind(objs, "PodMonitor")
    assert mon["spec"]["selector"]["matchLabels"]["ray.io/node-type"] == "head"
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] == "serve"


def test_every_pod_mounts_the_adapter_volume_read_only():
    # Each replica, one the autoscaler starts and the batch job's included, reads the
    # adapters' directories itself.
    objs = render({**EXAMPLES["cpu"], **EVERYTHING_ON})
    pods = []
    for kind in ("RayService", "RayJob"):
        (obj,) = by_kind(objs, kind)
        spec = obj["spec"]
        cluster = spec.get("rayClusterConfig") or spec["rayClusterSpec"]
        pods += [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        template = pod["template"]["spec"]
        assert {
            "name": "adapters",
            "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True},
        } in template["volumes"]
        (container,) = template["containers"]
        assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in container[
            "volumeMounts"
        ]
    assert not any(
        v["name"] == "adapters"
        for obj in by_kind(render({}), "RayService")
        for v in obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["volumes"]
    )


def test_pod_templates_carry_only_stable_labels():
    objs = render({})
    (svc,) = by_kind(objs, "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert set(group["template"]["metadata"]["labels"]) == {
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
        }


def test_gpu_example_requests_gpus_and_mounts_keys_and_models():
    (svc,) = by_kind(render(EXAMPLES["gpu"]), "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert group["replicas"] == 2 and group["rayStartParams"]["num-cpus"] == "8"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {m["mountPath"] for m in worker["volumeMounts"]} >= {
        "/models",
        "/etc/iterserve/api-keys",
    }
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["api_keys_file"] == "/etc/iterserve/api-keys/api_keys.yaml"
    assert "api_keys" not in args and cluster["authOptions"] == {"mode": "token"}


def test_pods_get_the_servers_serve_settings():
    (svc,) = by_kind(render({}), "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert SERVE_ENV_DEFAULTS.items() <= env.items()


def test_dashboard_configmap_is_the_dashboard():
    (cm,) = by_kind(render({}), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["iterserve.json"]) == json.loads(
        (REPO / "deploy/grafana/iterserve.json").read_text()
    )


def test_batch_job_runs_deploy_batch_with_the_service_config(tmp_path):
    objs = render({**EXAMPLES["gpu"], **EVERYTHING_ON})
    (job,) = by_kind(objs, "RayJob")
    config_path = "/etc/iterserve/batch/service.yaml"
    assert job["spec"]["entrypoint"].split() == [
        "python",
        "-m",
        "deploy.batch",
        "--config",
        config_path,
        "--input",
        "/data/in.jsonl",
        "--output",
        "/data/out.jsonl",
        "--ordered",
    ]
    (cm,) = [o for o in by_kind(objs, "ConfigMap") if "service.yaml" in o["data"]]
    # The file deploy.batch reads is the chart's config: model, replicas and engine section.
    (tmp_path / "service.yaml").write_text(cm["data"]["service.yaml"])
    args = argparse.ArgumentParser()
    add_arguments(args)
    args = args.parse_args(["-i", "in", "-o", "out", "--config", str(tmp_path / "service.yaml")])
    engine = _engine_config(args, apply_config(args))
    assert (args.model, args.num_replicas, args.replica_num_cpus, args.replica_num_gpus) == (
        "/models/Qwen2.5-7B-Instruct",
        2,
        8,
        1,
    )
    assert (engine["dtype"], engine["block_size"], engine["max_num_seqs"]) == ("bfloat16", 256, 256)
    for group in [
        job["spec"]["rayClusterSpec"]["headGroupSpec"],
        *job["spec"]["rayClusterSpec"]["workerGroupSpecs"],
    ]:
        mounts = group["template"]["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "batch-data", "mountPath": "/data"} in mounts


@pytest.mark.parametrize("auto", [False, True], ids=["section", "num_replicas-auto"])
def test_autoscaling_turns_on_kuberays_autoscaler_for_the_service(auto, tmp_path):
    values = copy.deepcopy(EXAMPLES["autoscaled"])
    if auto:
        values["config"]["num_replicas"] = "auto"
    objs = render({**values, **EVERYTHING_ON})
    (svc,) = by_kind(objs, "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaler"]
    assert cluster["enableInTreeAutoscaling"] is True
    resources = {"cpu": defaults["cpu"], "memory": defaults["memory"]}
    assert cluster["autoscalerOptions"] == {
        "upscalingMode": "Default",
        "idleTimeoutSeconds": defaults["idleTimeoutSeconds"],
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": resources, "limits": resources},
    }
    (group,) = cluster["workerGroupSpecs"]
    # One worker pod per replica: the pod holds one replica's CPUs.
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 6)
    assert group["rayStartParams"]["num-cpus"] == "2"
    # The app gets the section as written, and starts at min_replicas.
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["autoscaling"] == SECTION
    assert args.get("num_replicas") == ("auto" if auto else None)
    config = ServiceConfig(**args)
    assert config.autoscaling == AutoscalingConfig(**SECTION) and config.num_replicas == 2
    # The batch job's own cluster and config: a fixed fleet of max_replicas.
    (job,) = by_kind(objs, "RayJob")
    spec = job["spec"]["rayClusterSpec"]
    assert "enableInTreeAutoscaling" not in spec and "autoscalerOptions" not in spec
    (batch_group,) = spec["workerGroupSpecs"]
    assert [batch_group[k] for k in ("replicas", "minReplicas", "maxReplicas")] == [6, 6, 6]
    (cm,) = [o for o in by_kind(objs, "ConfigMap") if "service.yaml" in o["data"]]
    (tmp_path / "service.yaml").write_text(cm["data"]["service.yaml"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(
        ["-i", "in", "-o", "out", "--config", str(tmp_path / "service.yaml")]
    )
    apply_config(parsed)
    assert (parsed.num_replicas, parsed.replica_num_cpus) == (6, 2)
    assert "autoscaling" not in yaml.safe_load(cm["data"]["service.yaml"])


@pytest.mark.parametrize("example", ["default", "cpu", "gpu"])
def test_a_fixed_fleet_renders_no_autoscaler(example):
    objs = render({**EXAMPLES[example], **EVERYTHING_ON})
    n = EXAMPLES[example].get("config", {}).get("num_replicas", 1)
    (svc,) = by_kind(objs, "RayService")
    (job,) = by_kind(objs, "RayJob")
    for cluster in (svc["spec"]["rayClusterConfig"], job["spec"]["rayClusterSpec"]):
        assert "enableInTreeAutoscaling" not in cluster and "autoscalerOptions" not in cluster
        (group,) = cluster["workerGroupSpecs"]
        assert [group[k] for k in ("replicas", "minReplicas", "maxReplicas")] == [n, n, n]
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["num_replicas"] == n and "autoscaling" not in args


_SECTION_DEFAULTS = AutoscalingConfig()


@pytest.mark.parametrize(
    "config",
    [
        {"autoscaling": {"max_replicas": 3}},
        {"num_replicas": "auto", "autoscaling": {"max_replicas": 3}},
        {
            "autoscaling": {
                "min_replicas": 3,
                "max_replicas": 3,
                "window_s": 5,
                "decision_period_s": 5,
            }
        },
        {"num_replicas": 2, "autoscaling": {"max_replicas": 3}},
        {"num_replicas": "two"},
        {"num_replicas": 0},
        {"autoscaling": {"min_replicas": 4, "max_replicas": 3}},
        # Against the other field's default: the template's defaults are the model's.
        {"autoscaling": {"max_replicas": 3, "window_s": _SECTION_DEFAULTS.decision_period_s / 2}},
        {"autoscaling": {"max_replicas": 3, "decision_period_s": _SECTION_DEFAULTS.window_s * 2}},
        {"autoscaling": {"max_replicas": 3, "target_utilization": 1.5}},
        {"autoscaling": {"max_replicas": 3, "max_replica": 4}},
        {"autoscaling": None, "num_replicas": 2},
    ],
)
def test_chart_and_service_config_agree_on_replicas_and_autoscaling(config):
    """The chart renders exactly the sections ``iterserve serve`` accepts (with
    max_replicas, which the chart alone needs)."""
    try:
        ServiceConfig(**config, replica_num_cpus=2)
        accepted = True
    except ValueError:
        accepted = False
    try:
        render({"config": config})
        rendered = True
    except helm.HelmError:
        rendered = False
    assert rendered == accepted


@pytest.mark.parametrize(
    "values, message",
    [
        ({"config": {"num_replicas": -1}}, "at '/config/num_replicas': minimum: got -1, want 1"),
        ({"config": {"num_replicas": "two"}}, "at '/config/num_replicas': 'two' does not match"),
        (
            {"config": {"num_replicas": 2, "autoscaling": {"max_replicas": 3}}},
            "at '/config/num_replicas': value must be 'auto'",
        ),
        (
            {"config": {"autoscaling": {"min_replicas": 2}}},
            "config.autoscaling.max_replicas is required when the service autoscales",
        ),
        (
            {"config": {"num_replicas": "auto"}},
            "config.autoscaling.max_replicas is required when the service autoscales",
        ),
        (
            {"config": {"autoscaling": {"min_replicas": 4, "max_replicas": 3}}},
            "config.autoscaling.max_replicas=3 < min_replicas=4",
        ),
        (
            {"config": {"autoscaling": {"max_replicas": 3, "window_s": 1}}},
            "config.autoscaling.window_s must be >= decision_period_s",
        ),
        (
            {"config": {"engine": {"traffic_classes": {"interactive": {"ttft_slo": 1}}}}},
            "at '/config/engine/traffic_classes/interactive': additional properties 'ttft_slo'",
        ),
        (
            {"config": {"replica_num_gpus": 1, "engine": {"dtype": "float32"}}},
            "at '/config/engine/dtype': value must be one of 'auto', 'bfloat16', 'float16'",
        ),
        (
            {"config": {"api_keys": {"sk-1": {"tenant": "a"}}}},
            "at '/config': additional properties 'api_keys' not allowed",
        ),
        (
            {"batchJob": {"enabled": True, "input": "/d/i", "output": "/d/o"}},
            "batchJob.enabled needs batchJob.input, batchJob.output and batchJob.claimName",
        ),
    ],
)
def test_bad_values_fail_at_render_with_a_clear_error(values, message):
    with pytest.raises(helm.HelmError, match=message.replace("'", ".")):
        render(values)


def test_service_config_refuses_what_the_schema_refuses():
    with pytest.raises(ValueError, match="float32"):
        ServiceConfig(replica_num_gpus=1, engine={"dtype": "float32"})
    with pytest.raises(ValueError, match="device 'cpu'"):
        ServiceConfig(replica_num_gpus=1, engine={"device": "cpu"})
    with pytest.raises(ValueError, match="num_replicas: 2 with an autoscaling section"):
        ServiceConfig(num_replicas=2, autoscaling={"max_replicas": 3})
    with pytest.raises(ValueError, match="max_replicas=3 < min_replicas=4"):
        ServiceConfig(autoscaling={"min_replicas": 4, "max_replicas": 3})
    with pytest.raises(ValueError, match="window_s must be >= decision_period_s"):
        ServiceConfig(autoscaling={"max_replicas": 3, "window_s": 1})


@pytest.mark.slow
def test_rendered_serve_config_deploys_on_a_real_ray_cluster(tmp_path):
    """``serve deploy`` of the CPU example's serveConfigV2 on a Ray head of our own with the
    chart's pod environment, then a real completion through it. Only http_options change:
    loopback and a free port instead of the pod's 0.0.0.0:8000."""
    (svc,) = by_kind(render(EXAMPLES["cpu"]), "RayService")
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    port = free_port()
    serve_config["http_options"] = {"host": "127.0.0.1", "port": port}
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config))
    head_spec = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = ray_env(**{e["name"]: e["value"] for e in head_spec["containers"][0]["env"]})
    assert ray("get-auth-token", "--generate", env=env).returncode == 0
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths
    head, address = start_head(temp_dir, env)
    try:
        deployed = cli("serve", "deploy", str(config_file), "--address", address, env=env)
        assert deployed.returncode == 0, deployed.stderr[-2000:]
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, deadline=time.monotonic() + 300)
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=60,
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"].strip()
        print("through the rendered serve config:", json.dumps(body))
    finally:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_ready(url: str, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not serve /v1/models in time"
        time.sleep(2)
