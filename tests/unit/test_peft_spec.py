"""validate_peft: defaults, idempotence, and errors that name the exact field."""

from __future__ import annotations

import pytest

from tessera.errors import SpecError
from tessera.spec.peft import validate_peft, validate_task

DEFAULTS = {"learning_rate": 0.003, "batch_size": 8, "steps": 100, "seed": 5}


def test_defaults_filled_and_inherited():
    out = validate_peft({"tasks": [{"name": "a"}, {"name": "b", "rank": 4, "steps": 7}]}, defaults=DEFAULTS)
    a, b = out["tasks"]
    assert out["mode"] == "spatial" and out["chunk_size"] is None
    assert a["rank"] == 8 and a["alpha"] == 16.0 and a["target_modules"] == ["qkv", "proj"]
    assert (a["learning_rate"], a["batch_size"], a["steps"]) == (0.003, 8, 100)
    assert b["steps"] == 7 and b["alpha"] == 8.0
    assert a["dataset"]["seed"] == 5 and b["dataset"]["seed"] == 6  # workload seed + index
    assert a["dataset"] == {"kind": "synthetic", "seed": 5, "min_len": 8, "max_len": None,
                            "distribution": "uniform", "path": None, "field": None}


def test_without_defaults_inheritable_fields_stay_null_and_revalidate():
    once = validate_peft({"mode": "temporal", "chunk_size": 32, "tasks": [{"name": "a"}]})
    assert once["tasks"][0]["learning_rate"] is None and once["tasks"][0]["steps"] is None
    assert validate_peft(once) == once
    filled = validate_peft(once, defaults=DEFAULTS)
    assert filled["tasks"][0]["steps"] == 100 and filled["tasks"][0]["dataset"]["seed"] == 5
    assert validate_peft(filled, defaults=DEFAULTS) == filled


def test_file_dataset():
    out = validate_peft({"tasks": [{"name": "f", "dataset": {"kind": "jsonl", "path": "/d/x.jsonl"}}]})
    assert out["tasks"][0]["dataset"]["field"] == "text"


T = "workload.peft.tasks"


@pytest.mark.parametrize("section,field", [
    ({"tasks": [{"name": "a"}], "bogus": 1}, "workload.peft.bogus"),
    ({"mode": "diagonal", "tasks": [{"name": "a"}]}, "workload.peft.mode"),
    ({"chunk_size": 1, "tasks": [{"name": "a"}]}, "workload.peft.chunk_size"),
    ({"chunk_size": "64", "tasks": [{"name": "a"}]}, "workload.peft.chunk_size"),
    ({}, "workload.peft.tasks"),
    ({"tasks": []}, "workload.peft.tasks"),
    ({"tasks": "a"}, "workload.peft.tasks"),
    ({"tasks": [{"rank": 4}]}, f"{T}[0].name"),
    ({"tasks": [{"name": "Bad Name"}]}, f"{T}[0].name"),
    ({"tasks": [{"name": "a"}, {"name": "b"}, {"name": "c", "rank": 0}]}, f"{T}[2].rank"),
    ({"tasks": [{"name": "a", "rank": True}]}, f"{T}[0].rank"),
    ({"tasks": [{"name": "a", "rank": 2.5}]}, f"{T}[0].rank"),
    ({"tasks": [{"name": "a", "alpha": -1}]}, f"{T}[0].alpha"),
    ({"tasks": [{"name": "a", "learning_rate": 0}]}, f"{T}[0].learning_rate"),
    ({"tasks": [{"name": "a", "batch_size": -3}]}, f"{T}[0].batch_size"),
    ({"tasks": [{"name": "a", "steps": 0}]}, f"{T}[0].steps"),
    ({"tasks": [{"name": "a", "target_modules": []}]}, f"{T}[0].target_modules"),
    ({"tasks": [{"name": "a", "target_modules": ["qkv", "lm_head"]}]}, f"{T}[0].target_modules[1]"),
    ({"tasks": [{"name": "a", "target_modules": ["fc", "fc"]}]}, f"{T}[0].target_modules[1]"),
    ({"tasks": [{"name": "a", "lr": 0.1}]}, f"{T}[0].lr"),
    ({"tasks": [{"name": "a"}, {"name": "a"}]}, f"{T}[1].name"),
    ({"tasks": [{"name": "a", "dataset": {"kind": "csv"}}]}, f"{T}[0].dataset.kind"),
    ({"tasks": [{"name": "a", "dataset": {"min_len": 1}}]}, f"{T}[0].dataset.min_len"),
    ({"tasks": [{"name": "a", "dataset": {"min_len": 9, "max_len": 8}}]}, f"{T}[0].dataset.max_len"),
    ({"chunk_size": 16, "tasks": [{"name": "a", "dataset": {"max_len": 32}}]}, f"{T}[0].dataset.max_len"),
    ({"tasks": [{"name": "a", "dataset": {"distribution": "zipf"}}]}, f"{T}[0].dataset.distribution"),
    ({"tasks": [{"name": "a", "dataset": {"kind": "jsonl"}}]}, f"{T}[0].dataset.path"),
    ({"tasks": [{"name": "a", "dataset": {"kind": "text", "path": "rel.txt"}}]}, f"{T}[0].dataset.path"),
    ({"tasks": [{"name": "a", "dataset": {"path": "/x"}}]}, f"{T}[0].dataset.path"),
    ({"tasks": [{"name": "a", "dataset": {"kind": "text", "path": "/x", "field": "t"}}]}, f"{T}[0].dataset.field"),
    ({"tasks": [{"name": "a", "dataset": {"seed": -1}}]}, f"{T}[0].dataset.seed"),
    ({"tasks": [{"name": "a", "dataset": {"size": 3}}]}, f"{T}[0].dataset.size"),
    ({"tasks": [{"name": "a"}, {"name": "j-0123456789ab_t0"}]}, f"{T}[1].name"),
    ({"tasks": [{"name": "a", "rank": 10**400}]}, f"{T}[0].rank"),  # was an OverflowError (alpha = 2 * rank)
    ({"tasks": [{"name": "a", "steps": 2**31}]}, f"{T}[0].steps"),
    ({"tasks": [{"name": "a", "batch_size": 65537}]}, f"{T}[0].batch_size"),
    ({"tasks": [{"name": "a", "batch_size": 2**31 - 1}]}, f"{T}[0].batch_size"),
])
def test_errors_name_the_field(section, field):
    with pytest.raises(SpecError) as ei:
        validate_peft(section, "workload.peft")
    assert ei.value.field == field


def test_manifest_uses_validator():
    from tessera.manifest import load_file

    doc = load_file("examples/lora-8tasks.yaml")
    peft = doc["workload"]["peft"]
    assert len(peft["tasks"]) == 8 and peft["chunk_size"] == 64


def test_fused_task_name_prefix_is_reserved():
    with pytest.raises(SpecError) as ei:
        validate_peft({"tasks": [{"name": "j-0123456789ab_t0"}]})
    assert ei.value.field == "workload.peft.tasks[0].name" and "reserved for fused tasks" in str(ei.value)
    # Only the exact fused form is reserved; the fusion path itself may use it.
    ok = ["j-0123_t0", "j-0123456789ab", "j-0123456789ag_t0", "job-0123456789ab_t0", "xj-0123456789ab_t0"]
    assert [t["name"] for t in validate_peft({"tasks": [{"name": n} for n in ok]})["tasks"]] == ok
    assert validate_task({"name": "j-0123456789ab_t0"}, "t", fused=True)["name"] == "j-0123456789ab_t0"


def test_task_count_is_capped():
    from tessera.spec.peft import MAX_TASKS

    validate_peft({"tasks": [{"name": f"t{i}"} for i in range(MAX_TASKS)]})
    with pytest.raises(SpecError) as e:
        validate_peft({"tasks": [{"name": f"t{i}"} for i in range(MAX_TASKS + 1)]})
    assert e.value.field == "workload.peft.tasks" and str(MAX_TASKS) in e.value.message


def test_largest_peft_spec_fits_one_etcd_value():
    # etcd refuses a request over ~1.5 MiB; keep the biggest valid spec well below it.
    from tessera import manifest
    from tessera.spec.peft import MAX_TASKS

    name = "x" * 40
    tasks = [{"name": f"{name}-{i:03d}", "target_modules": ["qkv", "proj", "fc", "out"],
              "dataset": {"kind": "jsonl", "path": "/" + "p" * 200, "field": "f" * 50}} for i in range(MAX_TASKS)]
    d = manifest.validate({"apiVersion": "tessera/v1", "name": "a",
                           "workload": {"type": "peft", "steps": 1, "peft": {"tasks": tasks}}})
    assert len(manifest.to_proto(d).SerializeToString()) < 512 * 1024


def test_rank_is_bounded_by_the_model_hidden_size():
    # A rank-r factor on a width-`hidden` linear is only meaningful for r <= hidden.
    ok = validate_peft({"tasks": [{"name": "a", "rank": 32}]}, hidden=32)
    assert ok["tasks"][0]["rank"] == 32 and validate_peft(ok, hidden=32) == ok
    for rank in (33, 2**31 - 1):
        with pytest.raises(SpecError) as ei:
            validate_peft({"tasks": [{"name": "a"}, {"name": "b", "rank": rank}]}, hidden=32)
        assert ei.value.field == "workload.peft.tasks[1].rank" and "<= 32" in str(ei.value)
    with pytest.raises(SpecError) as ei:
        validate_task({"name": "c", "rank": 64}, "control[0].task", hidden=32)
    assert ei.value.field == "control[0].task.rank"
    assert validate_peft({"tasks": [{"name": "a", "batch_size": 65536}]})["tasks"][0]["batch_size"] == 65536
