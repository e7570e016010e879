"""Manifest validation: defaults, every error names its field, lossless proto round trip."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera import manifest
from tessera.errors import SpecError

BASE = {"apiVersion": "tessera/v1", "kind": "Job", "name": "a", "tenant": "t",
        "workload": {"type": "gpt", "steps": 10}, "resources": {"devices": 1, "device_kind": "cpu"}}


def doc(**patch):
    d = copy.deepcopy(BASE)
    for path, v in patch.items():
        cur = d
        keys = path.split("__")
        for k in keys[:-1]:
            cur = cur.setdefault(k, {})
        cur[keys[-1]] = v
    return d


def test_defaults_are_filled():
    d = manifest.validate(doc())
    assert d["workload"]["plan"] == {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1}
    assert d["workload"]["data"] == {"kind": "synthetic"}
    assert d["workload"]["batch_size"] == 8 and d["workload"]["model"]["vocab"] == 256


@pytest.mark.parametrize("patch,field", [
    ({"workload__steps": -1}, "workload.steps"),
    ({"workload__steps": "ten"}, "workload.steps"),
    ({"workload__stepz": 3}, "workload.stepz"),
    ({"bogus": 1}, "bogus"),
    ({"name": "UPPER"}, "name"),
    ({"apiVersion": "tessera/v2"}, "apiVersion"),
    ({"kind": "Pod"}, "kind"),
    ({"workload__type": "bert"}, "workload.type"),
    ({"workload__model__hidden": 30}, "workload.model.heads"),
    ({"workload__model__layers": True}, "workload.model.layers"),
    ({"workload__learning_rate": 0}, "workload.learning_rate"),
    ({"workload__data": {"kind": "file"}}, "workload.data.path"),
    ({"workload__data": {"kind": "file", "path": "rel.txt"}}, "workload.data.path"),
    ({"workload__plan": {"dp": 2}}, "resources.devices"),
    ({"resources__devices": 0}, "resources.devices"),
    ({"resources__device_kind": "tpu"}, "resources.device_kind"),
    ({"resources__gpus": 1}, "resources.gpus"),
    ({"workload__peft": {}}, "workload.peft"),
    ({"workload__step_delay_s": -0.5}, "workload.step_delay_s"),
    ({"workload__step_delay_s": "1s"}, "workload.step_delay_s"),
    ({"workload__step_delay_s": 0.5, "workload__type": "multimodal"}, "workload.step_delay_s"),
])
def test_errors_name_the_field(patch, field):
    with pytest.raises(SpecError) as e:
        manifest.validate(doc(**patch))
    assert e.value.field == field, str(e.value)


def test_yaml_file_errors(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("apiVersion: tessera/v1\nname: [unclosed\n")
    with pytest.raises(SpecError):
        manifest.load_file(p)


@given(steps=st.integers(1, 10**9), bs=st.integers(1, 4096), lr=st.floats(1e-6, 1.0),
       seed=st.integers(0, 2**31), dp=st.sampled_from([1, 2, 4]))
def test_proto_round_trip(steps, bs, lr, seed, dp):
    d = manifest.validate(doc(workload__steps=steps, workload__batch_size=bs * dp, workload__learning_rate=lr,
                              workload__seed=seed, workload__plan={"dp": dp}, resources__devices=dp))
    assert manifest.validate(manifest.from_proto(manifest.to_proto(d))) == d


def test_step_delay_round_trips_and_is_omitted_when_zero():
    d = manifest.validate(doc(workload__step_delay_s=0.25))
    assert d["workload"]["step_delay_s"] == 0.25
    assert manifest.validate(manifest.from_proto(manifest.to_proto(d))) == d
    assert "step_delay_s" not in manifest.validate(doc(workload__step_delay_s=0))["workload"]


def test_examples_are_valid():
    for p in sorted(manifest.Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml")):
        manifest.load_file(p)


@pytest.mark.parametrize("patch,field", [
    ({"workload__batch_size": 2**32}, "workload.batch_size"),
    ({"workload__batch_size": 2**31}, "workload.batch_size"),
    ({"workload__steps": 2**63}, "workload.steps"),
    ({"workload__seed": 2**63}, "workload.seed"),
    ({"workload__checkpoint_every": 2**64}, "workload.checkpoint_every"),
    ({"workload__plan": {"micro_batches": 2**31}}, "workload.plan.micro_batches"),
    ({"resources__devices": 2**31}, "resources.devices"),
    ({"workload__model__vocab": 2**31}, "workload.model.vocab"),
    ({"workload__model__seq_len": 10**9}, "workload.model.seq_len"),
    ({"workload__model__layers": 10**6}, "workload.model.layers"),
    ({"workload__model__hidden": 2**30, "workload__model__heads": 4}, "workload.model.hidden"),
    ({"workload__type": "peft", "workload__peft": {"tasks": [{"name": "a", "rank": 2**60}]}},
     "workload.peft.tasks[0].rank"),
])
def test_values_beyond_their_proto_field_are_refused_by_name(patch, field):
    d = doc(**patch)
    with pytest.raises(SpecError) as e:
        manifest.validate(d)
    assert e.value.field == field, str(e.value)


def test_largest_int_values_fit_the_proto():
    d = manifest.validate(doc(workload__batch_size=2**31 - 1, workload__steps=2**63 - 1, workload__seed=2**63 - 1,
                              workload__checkpoint_every=2**63 - 1))
    assert manifest.validate(manifest.from_proto(manifest.to_proto(d))) == d


@pytest.mark.parametrize("v", [float("inf"), float("-inf"), float("nan"), 10**400])
def test_learning_rate_must_be_finite(v):
    with pytest.raises(SpecError) as e:
        manifest.validate(doc(workload__learning_rate=v))
    assert e.value.field == "workload.learning_rate"


def test_yaml_inf_learning_rate_is_refused(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("apiVersion: tessera/v1\nname: a\nworkload: {type: gpt, steps: 1, learning_rate: .inf}\n")
    with pytest.raises(SpecError) as e:
        manifest.load_file(p)
    assert e.value.field == "workload.learning_rate"


def test_non_utf8_manifest_is_a_spec_error_naming_the_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_bytes(b"apiVersion: tessera/v1\nname: \xff\xfe\n")
    with pytest.raises(SpecError) as e:
        manifest.load_file(p)
    assert e.value.field == str(p) and "UTF-8" in e.value.message


def test_a_peft_rank_above_the_model_hidden_size_is_refused_at_validation(tmp_path):
    def peft(rank, hidden=64):
        return doc(workload__type="peft", workload__model__hidden=hidden,
                   workload__peft={"tasks": [{"name": "a", "rank": 4}, {"name": "b", "rank": rank}]})

    assert manifest.validate(peft(64))["workload"]["peft"]["tasks"][1]["rank"] == 64
    with pytest.raises(SpecError) as e:
        manifest.validate(peft(65))
    assert e.value.field == "workload.peft.tasks[1].rank" and "64" in e.value.message
    # The bound is the workload's own model, not a default.
    manifest.validate(peft(128, hidden=128))
    # The CLI refuses it before sending anything: exit 2, the field named.
    from tessera import cli

    p = tmp_path / "m.yaml"
    p.write_text("apiVersion: tessera/v1\nname: a\nworkload:\n  type: peft\n  steps: 2\n"
                 "  model: {hidden: 16, heads: 2}\n  peft: {tasks: [{name: a, rank: 17}]}\n")

    def no_client(address):
        raise AssertionError("nothing may be sent for an invalid manifest")

    err = cli.Console(record=True, width=200)
    assert cli.main(["submit", str(p)], client_factory=no_client, err=err) == 2
    assert "workload.peft.tasks[0].rank" in err.export_text()


def _peft(tasks, **workload):
    d = doc(workload__type="peft", workload__peft={"tasks": tasks})
    d["workload"].update(workload)
    return d


@pytest.mark.parametrize("tasks,workload,field,says", [
    # A task inheriting the workload's batch size is bound by the peft cap (65536): the
    # workload field is at fault, and the task that inherits it is named too.
    ([{"name": "a"}], {"batch_size": 65537}, "workload.batch_size", "workload.peft.tasks[0].batch_size"),
    ([{"name": "a"}], {"steps": 2**31}, "workload.steps", "workload.peft.tasks[0].steps"),
    ([{"name": "a"}, {"name": "b"}], {"seed": 2**31 - 1}, "workload.seed", "workload.peft.tasks[1].dataset.seed"),
    # A task's own value is named as before.
    ([{"name": "a", "batch_size": 65537}], {}, "workload.peft.tasks[0].batch_size", "65536"),
    # chunk_size (null = model.seq_len) bounds every sequence.
    ([{"name": "a", "dataset": {"min_len": 65}}], {"model": {"seq_len": 64}},
     "workload.peft.tasks[0].dataset.min_len", "64"),
    ([{"name": "a", "dataset": {"max_len": 65}}], {"model": {"seq_len": 64}},
     "workload.peft.tasks[0].dataset.max_len", "64"),
])
def test_peft_tasks_are_checked_with_what_they_inherit(tasks, workload, field, says):
    with pytest.raises(SpecError) as e:
        manifest.validate(_peft(tasks, **workload))
    assert e.value.field == field and says in e.value.message


def test_peft_chunk_size_above_seq_len_is_refused():
    d = _peft([{"name": "a"}], model={"seq_len": 32})
    d["workload"]["peft"]["chunk_size"] = 33
    with pytest.raises(SpecError) as e:
        manifest.validate(d)
    assert e.value.field == "workload.peft.chunk_size"


def test_peft_inherited_values_within_bounds_are_accepted_and_stay_null():
    # A task's own batch size overrides a workload value above the cap; nulls are kept
    # (the executor resolves them), so the section still validates to itself.
    d = manifest.validate(_peft([{"name": "a", "batch_size": 4}, {"name": "b"}], batch_size=65536))
    tasks = d["workload"]["peft"]["tasks"]
    assert tasks[0]["batch_size"] == 4 and tasks[1]["batch_size"] is None
    assert manifest.validate(d) == d
    d = manifest.validate(_peft([{"name": "a", "batch_size": 4}], batch_size=65537))
    assert d["workload"]["batch_size"] == 65537


@pytest.mark.parametrize("tasks,workload", [
    ([{"name": "a"}], {"batch_size": 65537}),
    ([{"name": "a"}], {"steps": 2**31}),
    ([{"name": "a"}, {"name": "b"}], {"seed": 2**31 - 1}),
    ([{"name": "a", "dataset": {"min_len": 65}}], {"model": {"seq_len": 64}}),
    ([{"name": "a", "batch_size": 4}], {"batch_size": 65537}),
    ([{"name": "a"}], {"batch_size": 65536, "steps": 2**31 - 1, "seed": 2**31 - 1}),
])
def test_submit_and_executor_agree_on_peft_specs(tasks, workload):
    """What validation accepts, the peft executor's own parse accepts (it would otherwise
    fail the job with exit 2 after placement), and what it refuses, the executor refuses."""
    pytest.importorskip("torch")
    from agent.runtime.peft.workload import parse

    d = _peft(tasks, **workload)
    # What the executor would be handed: the workload as given, the model's defaults filled.
    w = {**manifest.validate(_peft([{"name": "a"}]))["workload"], **workload}
    w["model"] = {**manifest.MODEL_DEFAULTS, **workload.get("model", {})}
    w["peft"] = {"tasks": tasks}
    try:
        spec = manifest.validate(d)
    except SpecError:
        with pytest.raises(SpecError):
            parse(w)
        return
    parse(spec["workload"])


# What an executor would refuse as a spec error (exit 2) after placement is refused here,
# at submission, naming the field the executor names.
PEFT = {"type": "peft", "steps": 2, "model": {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 16, "heads": 2},
        "peft": {"tasks": [{"name": "a", "dataset": {"min_len": 4}}]}}
MM = {"type": "multimodal", "steps": 1, "batch_size": 2,
      "model": {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 32, "heads": 2}, "multimodal": {}}


def test_peft_on_more_than_one_device_is_refused():
    assert manifest.validate(doc(workload=PEFT))["resources"]["devices"] == 1
    with pytest.raises(SpecError) as e:
        manifest.validate(doc(workload=PEFT, resources__devices=2))
    assert e.value.field == "resources.devices" and "one device" in str(e.value) and "got 2" in str(e.value)


def test_colocated_multimodal_on_more_than_one_device_is_refused():
    ok = {**MM, "model": {**MM["model"], "seq_len": 64}}
    manifest.validate(doc(workload={**ok, "multimodal": {"mode": "disaggregated"}}, resources__devices=2))
    for mm in ({}, {"mode": "colocated"}):
        with pytest.raises(SpecError) as e:
            manifest.validate(doc(workload={**ok, "multimodal": mm}, resources__devices=2))
        assert e.value.field == "resources.devices" and "colocated" in str(e.value)


def test_multimodal_sample_longer_than_seq_len_is_refused_like_the_runtime():
    from agent.runtime.multimodal.workload import parse as mm_parse
    with pytest.raises(SpecError) as e:
        manifest.validate(doc(workload=MM))
    with pytest.raises(SpecError) as rt:
        mm_parse(MM)
    assert e.value.field == rt.value.field == "workload.multimodal.data.max_images"
    manifest.validate(doc(workload={**MM, "model": {**MM["model"], "seq_len": 64}}))


def test_gpt_file_data_needs_a_byte_vocab():
    with pytest.raises(SpecError) as e:
        manifest.validate(doc(workload__data={"kind": "file", "path": "/x.txt"}, workload__model={"vocab": 64}))
    assert e.value.field == "workload.model.vocab" and "256" in str(e.value)
    manifest.validate(doc(workload__data={"kind": "file", "path": "/x.txt"}, workload__model={"vocab": 256}))
