"""deploy/: every YAML parses, the manifests have what a GPU server needs, and every flag the files pass to
``twogrid serve`` exists.

The flag set comes from ``dispatcher.cli.build_parser()``'s ``serve`` subcommand when there is one, else from
SERVE_FLAGS below (the flags issue 13 names, with vLLM's spelling)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"

SERVE_FLAGS = frozenset({
    "--model", "--served-model-name", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--block-size", "--gpu-memory-utilization", "--compilation-config", "--speculative-config", "--enforce-eager",
    "--platform", "--host", "--port", "--api-key", "--step-trace", "--cudagraph-metrics", "--seed", "--log-level",
    "--shutdown-timeout", "--log-requests", "--num-kv-blocks", "--help",
})


def serve_flags() -> frozenset[str]:
    """The long options of ``twogrid serve``: from the CLI's parser when it has the subcommand."""
    from dispatcher.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction) and "serve" in action.choices:
            sub = action.choices["serve"]
            return frozenset(s for a in sub._actions for s in a.option_strings if s.startswith("--"))
    return SERVE_FLAGS


def flags_in(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def load_all(path: Path) -> list:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def k8s_docs() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in load_all(path):
            docs[doc["kind"]] = doc
    return docs


def serve_container() -> dict:
    return k8s_docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Dockerfile, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def systemd_exec_start() -> list[str]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "systemd" / "twogrid.service").read_text())
    line = next(v for k, _, v in (line.partition("=") for line in text.splitlines()) if k.strip() == "ExecStart")
    return shlex.split(line)


def readme_serve_args() -> list[list[str]]:
    """The ``twogrid serve`` arguments of every command in deploy/README.md's shell blocks: what follows
    ``twogrid serve``, or the image name in a ``docker run``."""
    text = (DEPLOY / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for command in re.sub(r"\\\n", " ", block).splitlines():
            words = shlex.split(command, comments=True)
            if words[:2] == ["docker", "run"]:
                image = next(i for i, w in enumerate(words) if w.startswith("twogrid:"))
                out.append(words[image + 1:])
            elif "serve" in words and any(w.endswith("twogrid") for w in words):
                out.append(words[words.index("serve") + 1:])
    return out


# ---------------------------------------------------------------------------------------------------------------


def test_every_yaml_parses():
    paths = sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml"))
    assert len(paths) >= 6, paths
    for path in paths:
        assert load_all(path), f"{path} has no document"


def test_every_flag_passed_to_serve_exists():
    known = serve_flags()
    sources = {
        "docker-compose.yml": load_all(DEPLOY / "docker-compose.yml")[0]["services"]["twogrid"]["command"],
        "k8s/deployment.yaml": serve_container()["args"],
        "Dockerfile CMD": json.loads(dict(dockerfile_instructions())["CMD"]),
        "systemd ExecStart": systemd_exec_start()[2:],
    }
    for i, args in enumerate(readme_serve_args()):
        sources[f"README.md command {i}"] = args
    assert len(sources) >= 6  # the README's two docker run examples were found
    for where, args in sources.items():
        unknown = flags_in([str(a) for a in args]) - known
        assert not unknown, f"deploy/{where} passes {sorted(unknown)}, which twogrid serve does not have"


def test_flag_check_catches_an_unknown_flag():
    assert flags_in(["--host", "0.0.0.0", "--bogus-flag=1"]) - serve_flags() == {"--bogus-flag"}


def test_dockerfile():
    ins = dockerfile_instructions()
    base = next(rest for word, rest in ins if word == "FROM")
    if base.startswith("${"):  # FROM ${CUDA_IMAGE}: the ARG's default
        name = base.strip("${}")
        base = next(rest for word, rest in ins if word == "ARG" and rest.startswith(name + "=")).split("=", 1)[1]
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert any(word == "RUN" and "pip install ." in rest for word, rest in ins)
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = [rest for word, rest in ins if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["twogrid", "serve"]
    assert (DEPLOY / "Dockerfile.dockerignore").is_file()


def test_compose_scrapes_metrics():
    compose = load_all(DEPLOY / "docker-compose.yml")[0]
    server = compose["services"]["twogrid"]
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert all(str(p).startswith("127.0.0.1:") for p in server["ports"])
    assert "/health" in " ".join(server["healthcheck"]["test"])
    prom = load_all(DEPLOY / "prometheus.yml")[0]
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "twogrid")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["twogrid:8000"]
    assert any("prometheus.yml" in v for v in compose["services"]["prometheus"]["volumes"])


def test_kubernetes_manifests():
    docs = k8s_docs()
    assert set(docs) >= {"Deployment", "Service", "ServiceMonitor"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "capture needs minutes"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    shutdown = int(c["args"][c["args"].index("--shutdown-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > shutdown
    assert pod["securityContext"]["runAsNonRoot"] is True
    port = docs["Service"]["spec"]["ports"][0]
    assert port["targetPort"] == "http" and c["ports"][0]["name"] == "http"
    endpoint = docs["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    selector = docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= docs["Service"]["metadata"]["labels"].items()
    kustomization = load_all(DEPLOY / "k8s" / "kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


def test_systemd_unit():
    words = systemd_exec_start()
    assert words[0].endswith("/twogrid") and words[1] == "serve"
    assert words[words.index("--host") + 1] == "127.0.0.1"
    text = (DEPLOY / "systemd" / "twogrid.service").read_text()
    assert "KillSignal=SIGTERM" in text and "User=twogrid" in text
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text).group(1))
    assert stop > int(words[words.index("--shutdown-timeout") + 1])


def test_readme_has_a_section_for_each():
    text = (DEPLOY / "README.md").read_text()
    for title in ("## Docker", "## Docker Compose", "## Kubernetes", "## systemd"):
        assert title in text
