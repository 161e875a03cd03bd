"""The Grafana dashboard names only metrics eagle3ray exports, and shows every one of them."""
import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "cluster" / "grafana" / "eagle3ray_dashboard.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> dict[str, str]:
    """{name as Prometheus sees it: base metric} from every ``_get(kind, name, ...)`` call in eagle3ray/metrics.py
    (Ray prefixes ``ray_``; Prometheus adds the counter and histogram suffixes)."""
    out = {}
    for node in ast.walk(ast.parse((ROOT / "eagle3ray" / "metrics.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_get":
            kind, name = (a.value for a in node.args[:2])
            for s in SUFFIXES[kind]:
                out[f"ray_{name}{s}"] = name
    return out


def test_every_query_names_an_exported_metric_and_every_metric_is_shown():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    named = set(re.findall(r"\bray_eagle3ray_\w+", " ".join(exprs)))
    known = exported()
    assert len(known) >= 10 and named, (known, named)
    assert not named - set(known), f"not exported by eagle3ray: {sorted(named - set(known))}"
    assert {known[n] for n in named} == set(known.values()), "metrics without a panel: " + \
        str(sorted(set(known.values()) - {known[n] for n in named}))
    assert all("$run" in e for e in exprs if "label_values" not in e)  # every panel follows the run selector
