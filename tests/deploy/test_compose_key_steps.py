"""The compose instructions make the cluster key before `up`, where compose looks for it, for the
uid the image runs as, in a form the key loader accepts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from common.cluster_auth import ClusterKey

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _readme_compose_block() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    block = next(b for b in blocks if "docker compose -f deploy/docker-compose.yml up" in b)
    return block.strip().splitlines()


def test_the_readme_makes_the_key_before_compose_up(tmp_path: Path) -> None:
    lines = _readme_compose_block()
    make = next(i for i, line in enumerate(lines) if "> deploy/cluster.key" in line)
    up = next(i for i, line in enumerate(lines) if "docker compose" in line)
    assert make < up
    secret = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["secrets"]["cluster_key"]["file"]
    assert (DEPLOY / secret).resolve() == ROOT / "deploy" / "cluster.key"  # relative to the compose file
    command = lines[make].replace("deploy/cluster.key", str(tmp_path / "cluster.key"))
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    ClusterKey.load(tmp_path / "cluster.key")  # what every service does at start


def test_the_key_goes_to_the_uid_the_image_runs_as() -> None:
    uid = re.search(r"useradd --system --uid (\d+)", (DEPLOY / "Dockerfile").read_text()).group(1)
    assert f"chown {uid} deploy/cluster.key" in "\n".join(_readme_compose_block())
    assert f"chown {uid} deploy/cluster.key" in (DEPLOY / "docker-compose.yml").read_text()
