"""e2e (issue 3's done-when): the 2-rank and 4-rank example manifests (examples/), submitted
with the CLI to a testbed of 2 agents x 2 CPU core-set partitions, succeed with their loss
falling; the 4-rank job spans both agents, one partition per rank."""

from __future__ import annotations

import json

import pytest
from _e2e import REPO

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("example,ranks", [("gpt-dp2.yaml", 2), ("gpt-4rank.yaml", 4)])
def test_example_succeeds_with_loss_falling(bed, example, ranks):
    r = bed.run("submit", str(REPO / "examples" / example), "--wait", "--timeout", "300", "-o", "json", timeout=330)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    job = json.loads(r.stdout)
    st = job["status"]
    assert st["phase"] == "SUCCEEDED", st
    assert int(st["step"]) == 150 and st["loss"] < st["first_loss"]
    parts = [(s["node"], p) for s in st["placement"] for p in s["partition_ids"]]
    assert len(parts) == len(set(parts)) == ranks
    if ranks == 4:
        assert sorted({n for n, _ in parts}) == ["node-1", "node-2"]
    assert st["last_decision"]["policy"] == "tessera" and st["last_decision"]["action"] == "place"
    # tessera get shows the decision and its reason
    g = bed.run("get", job["id"])
    assert g.returncode == 0 and "place:" in g.stdout and "tessera" in g.stdout


def test_nodes_show_partitions(bed):
    r = bed.run("nodes", "-o", "json")
    assert r.returncode == 0, r.stderr
    for n in json.loads(r.stdout)["nodes"]:
        assert [(p["id"], p["kind"], p["unit"]) for p in n["partitions"]] == [("cpu0", "cpuset", "cores"),
                                                                              ("cpu1", "cpuset", "cores")]
        assert all(p["capacity_units"] >= 1 for p in n["partitions"])
    r = bed.run("nodes")
    assert r.returncode == 0 and "cpuset" in r.stdout and "cores" in r.stdout
