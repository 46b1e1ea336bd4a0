"""The operator's metrics kit: every metric that docs/metrics.md, the alert rules and the
Grafana dashboard name is one the server serves, and the files are well formed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bhangar_[a-z_]+\b")
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_info", "_created")


def served(api: httpx.Client) -> set[str]:
    """Metric family names in /metrics (from its # TYPE lines, so empty families count)."""
    text = api.get("/metrics").text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def check(names: set[str], families: set[str], where: str) -> None:
    unknown = sorted(n for n in names if n not in families and family(n) not in families)
    assert not unknown, f"{where} names metrics the server does not serve: {unknown}"


def test_alert_rules_name_served_metrics(api: httpx.Client) -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    [group] = rules["groups"]
    alerts = {r["alert"] for r in group["rules"]}
    assert {"HangarDown", "HangarPoolEmpty", "HangarNearVMCap", "HangarDiskLow"} <= alerts
    for r in group["rules"]:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
    exprs = " ".join(str(r["expr"]) for r in group["rules"])
    check(set(NAME.findall(exprs)), served(api), "alerts.yml")


def test_dashboard_names_served_metrics(api: httpx.Client) -> None:
    dash = json.loads((ROOT / "deploy/grafana/hangar.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    check(set(NAME.findall(exprs)), served(api), "hangar.json")


def test_every_served_metric_is_documented(api: httpx.Client) -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    documented = {family(n) for n in NAME.findall(doc)}
    check(set(NAME.findall(doc)), served(api), "docs/metrics.md")
    missing = sorted(f for f in served(api) if f.startswith("hangar_") and family(f) not in documented
                     and f not in documented)
    assert not missing, f"docs/metrics.md does not document {missing}"
