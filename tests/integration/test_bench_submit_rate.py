"""bench.submit_rate runs end to end (its own etcd and controller) and writes its keys."""

from __future__ import annotations

import json

from bench import submit_rate


def test_submit_rate_small_run_writes_every_key(tmp_path):
    out = tmp_path / "rate.json"
    assert submit_rate.main(["--clients", "4", "--jobs", "40", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    for key in ("jobs_per_s", "p50_ms", "p99_ms", "etcd_txn_per_s"):
        assert fig[key] > 0, key
    assert fig["submitted"] == 40
    assert fig["p99_ms"] >= fig["p50_ms"]
