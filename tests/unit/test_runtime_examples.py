"""The gpt example manifests are valid executor workloads for their device count."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from agent.runtime.train import parse_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "gpt-*.yaml")))


def test_the_three_examples_exist():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"gpt-small.yaml", "gpt-dp2.yaml", "gpt-4rank.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_parses_for_every_rank(path):
    with open(path) as f:
        m = yaml.safe_load(f)
    assert m["apiVersion"] == "tessera/v1" and m["kind"] == "Job"
    assert m["workload"]["type"] == "gpt"
    devices = m["resources"]["devices"]
    for rank in range(devices):
        job = parse_spec({"job_id": m["name"], "workload": m["workload"], "dist": {"rank": rank, "world_size": devices}})
        assert job.plan.world_size == devices
