"""Manifest input edges: names ending in a newline, integers too large for a double,
duplicate YAML keys and proto3 zeros. Each bad input is refused with the field at fault."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from tessera import manifest, yamlutil
from tessera.cli import main
from tessera.errors import SpecError

BASE = {"apiVersion": "tessera/v1", "name": "a", "workload": {"type": "gpt", "steps": 5}}
PEFT = {"apiVersion": "tessera/v1", "name": "p",
        "workload": {"type": "peft", "steps": 5, "peft": {"tasks": [{"name": "t1"}]}}}
MM = {"apiVersion": "tessera/v1", "name": "m", "workload": {"type": "multimodal", "steps": 5}}


def _refused(doc: dict, field: str) -> SpecError:
    with pytest.raises(SpecError) as ei:
        manifest.validate(doc)
    assert ei.value.field == field, ei.value
    return ei.value


# --- (newline) names: `$` matches before a final "\n"; fullmatch does not ----------------

@pytest.mark.parametrize("field", ["name", "tenant"])
@pytest.mark.parametrize("suffix", ["\n", "\r\n", " "])
def test_job_name_and_tenant_with_a_trailing_newline_are_refused(field, suffix):
    d = copy.deepcopy(BASE)
    d[field] = "gpt" + suffix
    _refused(d, field)


def test_peft_task_name_with_a_trailing_newline_is_refused():
    d = copy.deepcopy(PEFT)
    d["workload"]["peft"]["tasks"] = [{"name": "t1\n"}, {"name": "t1"}]
    _refused(d, "workload.peft.tasks[0].name")


@pytest.mark.parametrize("name, ok", [("node-1", True), ("a" * 63, True), ("node-1\n", False), ("node-1\r\n", False),
                                      ("", False), ("a" * 64, False), ("Node", False), (None, False), (1, False)])
def test_valid_name_is_a_whole_match(name, ok):
    assert manifest.valid_name(name) is ok


@pytest.mark.parametrize("name", ["node-1\n", "node-1\r\n", "a" * 64, ""])
def test_register_node_refuses_a_bad_name_before_anything_else(name):
    """Controller.register checks the name first (it touches no state before that)."""
    import asyncio

    from controller.core import Controller
    from tessera.api.v1 import controller_pb2

    req = controller_pb2.RegisterNodeRequest(name=name, agent_address="h:1")
    with pytest.raises(SpecError) as ei:
        asyncio.run(Controller.register(object(), req))
    assert ei.value.field == "name" and "must match" in ei.value.message


def test_names_without_the_newline_still_pass():
    d = copy.deepcopy(PEFT)
    d["tenant"] = "demo"
    d["workload"]["peft"]["tasks"] = [{"name": "t_1"}, {"name": "t-2"}]
    out = manifest.validate(d)
    assert out["name"] == "p" and out["tenant"] == "demo"


# --- (overflow) an int beyond the double range in a float field ---------------------------

BIG = 10 ** 400


@pytest.mark.parametrize("key", ["alpha", "learning_rate"])
def test_peft_float_field_with_a_huge_integer_names_the_field(key):
    d = copy.deepcopy(PEFT)
    d["workload"]["peft"]["tasks"][0][key] = BIG
    e = _refused(d, f"workload.peft.tasks[0].{key}")
    assert "finite number" in e.message


@pytest.mark.parametrize("section,key,value", [
    ("colocated", "encoder_quota", BIG),
    ("colocated", "encoder_quota", -BIG),
    ("colocated", "encoder_quota", math.inf),
    ("colocated", "encoder_quota", math.nan),
])
def test_multimodal_float_field_with_a_huge_or_non_finite_number_names_the_field(section, key, value):
    d = copy.deepcopy(MM)
    d["workload"]["multimodal"] = {section: {key: value}}
    _refused(d, f"workload.multimodal.{section}.{key}")


def test_multimodal_mix_probability_with_a_huge_integer_names_the_field():
    d = copy.deepcopy(MM)
    d["workload"]["multimodal"] = {"mix": [{"step": 0, "image_prob": BIG}]}
    e = _refused(d, "workload.multimodal.mix[0].image_prob")
    assert "finite number" in e.message


def test_cli_submit_with_a_huge_alpha_exits_2_naming_the_field(tmp_path, capsys):
    p = tmp_path / "m.yaml"
    p.write_text("apiVersion: tessera/v1\nname: p\nworkload:\n  type: peft\n  steps: 5\n  peft:\n    tasks:\n"
                 "    - name: t1\n      alpha: 1" + "0" * 400 + "\n")
    rc = main(["submit", str(p), "--controller", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "workload.peft.tasks[0].alpha" in err and "Traceback" not in err


# --- (duplicate keys) ----------------------------------------------------------------------

@pytest.mark.parametrize("text,field,line", [
    ("apiVersion: tessera/v1\nname: a\nname: b\nworkload:\n  type: gpt\n  steps: 10\n", "name", 3),
    ("apiVersion: tessera/v1\nname: a\nworkload:\n  type: gpt\n  steps: 10\n  steps: 100000\n",
     "workload.steps", 6),
    ("apiVersion: tessera/v1\nname: p\nworkload:\n  type: peft\n  steps: 5\n  peft:\n    tasks:\n"
     "    - name: t1\n      rank: 4\n      rank: 8\n", "workload.peft.tasks[0].rank", 10),
])
def test_duplicate_yaml_key_is_refused_naming_its_path(tmp_path, text, field, line):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as ei:
        manifest.load_file(p)
    assert ei.value.field == field
    assert "duplicate key" in ei.value.message and f"line {line}" in ei.value.message


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("apiVersion: tessera/v1\nname: a\nworkload:\n  type: gpt\n  steps: 10\n"
                 "  model: &m {vocab: 128, hidden: 32}\n  plan:\n    dp: 1\nresources:\n  devices: 1\n")
    assert manifest.load_file(p)["workload"]["model"]["vocab"] == 128
    # A key brought in by a merge (<<) may be overridden: that is what merges are for.
    doc = yaml.load("b: &b {type: gpt, steps: 10}\nw:\n  <<: *b\n  steps: 20\n", Loader=yamlutil.UniqueKeyLoader)
    assert doc["w"] == {"type": "gpt", "steps": 20}


def test_cli_submit_with_a_duplicate_key_exits_2(tmp_path, capsys):
    p = tmp_path / "m.yaml"
    p.write_text("apiVersion: tessera/v1\nname: a\nworkload:\n  type: gpt\n  steps: 10\n  steps: 100000\n")
    rc = main(["submit", str(p), "--controller", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "workload.steps" in err and "duplicate key" in err


# --- (proto zeros) 0 or unset = the documented default ------------------------------------

def _zeroed(setter) -> dict:
    spec = manifest.to_proto(manifest.validate(copy.deepcopy(BASE)))
    setter(spec)
    return manifest.validate(manifest.from_proto(spec))


@pytest.mark.parametrize("section,key,setter,default", [
    ("workload", "batch_size", lambda s: setattr(s.workload, "batch_size", 0), 8),
    ("workload", "learning_rate", lambda s: setattr(s.workload, "learning_rate", 0.0), 0.003),
    ("workload", "checkpoint_every", lambda s: setattr(s.workload, "checkpoint_every", 0), 50),
    ("workload", "seed", lambda s: setattr(s.workload, "seed", 0), 0),
    ("resources", "devices", lambda s: setattr(s.resources, "devices", 0), 1),
])
def test_proto_zero_means_the_documented_default(section, key, setter, default):
    """types.proto and the README say: 0 or unset = the default (proto3 has no presence)."""
    assert manifest.WORKLOAD_DEFAULTS.get(key, default) == default
    assert _zeroed(setter)[section][key] == default


def test_proto_zero_model_and_plan_fields_mean_their_defaults():
    def zero(s):
        for k in manifest.MODEL_DEFAULTS:
            setattr(s.workload.model, k, 0)
        for k in manifest.PLAN_DEFAULTS:
            setattr(s.workload.plan, k, 0)
    d = _zeroed(zero)
    assert d["workload"]["model"] == manifest.MODEL_DEFAULTS
    assert d["workload"]["plan"] == manifest.PLAN_DEFAULTS


def test_proto_zero_steps_is_refused():
    with pytest.raises(SpecError) as ei:
        _zeroed(lambda s: setattr(s.workload, "steps", 0))
    assert ei.value.field == "workload.steps"


def test_proto_comments_state_the_zero_defaults():
    from tessera import protogen
    text = (protogen.ROOT / "proto" / "tessera" / "api" / "v1" / "types.proto").read_text()
    for line in ("int32 batch_size = 4;         // > 0; 0 or unset = the default (8)",
                 "double learning_rate = 5;     // > 0; 0 or unset = the default (0.003)",
                 "int64 checkpoint_every = 9;   // steps between checkpoints; > 0; 0 or unset = the default (50)",
                 "int32 devices = 1;      // > 0; 0 or unset = the default (1)"):
        assert line in text
