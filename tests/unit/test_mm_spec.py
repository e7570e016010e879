"""validate_multimodal fills defaults and names the exact field at fault."""

from __future__ import annotations

import pytest

from tessera.errors import SpecError
from tessera.spec.multimodal import media_tokens_max, validate_multimodal


def test_defaults_and_idempotence():
    out = validate_multimodal({})
    assert out["mode"] == "colocated"
    assert out["colocated"]["encoder_quota"] == 0.5
    assert out["colocated"]["pin"] is True
    assert out["disaggregated"]["encoder_ranks"] == "auto"
    assert out["mix"] == [{"step": 0, "image_prob": 0.5, "audio_prob": 0.0}]
    assert validate_multimodal(out) == out
    assert validate_multimodal(None) == out
    assert media_tokens_max(out) == 4 * 4


@pytest.mark.parametrize(
    "section, field",
    [
        ({"bogus": 1}, "workload.multimodal.bogus"),
        ({"mode": "both"}, "workload.multimodal.mode"),
        ({"micro_batches": 0}, "workload.multimodal.micro_batches"),
        ({"micro_batches": "4"}, "workload.multimodal.micro_batches"),
        ({"micro_batches": True}, "workload.multimodal.micro_batches"),
        ({"image": {"sise": 3}}, "workload.multimodal.image.sise"),
        ({"image": []}, "workload.multimodal.image"),
        ({"image": {"patch": 5}}, "workload.multimodal.image.patch"),
        ({"image": {"pool": 3}}, "workload.multimodal.image.pool"),
        ({"encoder": {"heads": 3}}, "workload.multimodal.encoder.heads"),
        ({"audio": {"enabled": "yes"}}, "workload.multimodal.audio.enabled"),
        ({"audio": {"frames": 30}}, "workload.multimodal.audio.pool"),
        ({"data": {"min_text": 1}}, "workload.multimodal.data.min_text"),
        ({"data": {"min_text": 30, "max_text": 20}}, "workload.multimodal.data.min_text"),
        ({"mix": []}, "workload.multimodal.mix"),
        ({"mix": [{"step": 1, "image_prob": 0.5}]}, "workload.multimodal.mix[0].step"),
        ({"mix": [{"step": 0}]}, "workload.multimodal.mix[0].image_prob"),
        ({"mix": [{"step": 0, "image_prob": 0.2}, {"step": 5, "image_prob": 1.5}]}, "workload.multimodal.mix[1].image_prob"),
        ({"mix": [{"step": 0, "image_prob": 0.2}, {"step": 0, "image_prob": 0.5}]}, "workload.multimodal.mix[1].step"),
        ({"mix": [{"step": 0, "image_prob": 0.2, "video_prob": 1}]}, "workload.multimodal.mix[0].video_prob"),
        ({"colocated": {"encoder_quota": 1.0}}, "workload.multimodal.colocated.encoder_quota"),
        ({"colocated": {"pin": 1}}, "workload.multimodal.colocated.pin"),
        ({"colocated": {"encoder_quota": "half"}}, "workload.multimodal.colocated.encoder_quota"),
        ({"disaggregated": {"encoder_ranks": 0}}, "workload.multimodal.disaggregated.encoder_ranks"),
        ({"disaggregated": {"encoder_ranks": "many"}}, "workload.multimodal.disaggregated.encoder_ranks"),
        ({"disaggregated": {"adaptive": 1}}, "workload.multimodal.disaggregated.adaptive"),
        ({"reorder": {"group_batches": 0}}, "workload.multimodal.reorder.group_batches"),
    ],
)
def test_errors_name_the_field(section, field):
    with pytest.raises(SpecError) as e:
        validate_multimodal(section)
    assert e.value.field == field


def test_custom_path_and_ints_accepted_as_floats():
    out = validate_multimodal({"colocated": {"encoder_quota": 0.25}, "mix": [{"step": 0, "image_prob": 1}]}, "x.mm")
    assert out["mix"][0]["image_prob"] == 1.0
    with pytest.raises(SpecError) as e:
        validate_multimodal({"mode": 3}, "x.mm")
    assert e.value.field == "x.mm.mode"


def test_examples_for_both_modes_are_valid_jobs():
    # The two multimodal manifests `tessera demo` runs: valid as jobs and as executor workloads.
    import glob
    import os

    import yaml

    from agent.runtime.multimodal.workload import parse
    from tessera.manifest import validate

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    modes = {}
    for path in sorted(glob.glob(os.path.join(root, "examples", "mm-*.yaml"))):
        with open(path) as f:
            doc = yaml.safe_load(f)
        validate(doc)
        _, mm, _ = parse(doc["workload"])
        modes[mm["mode"]] = doc["resources"]["devices"]
    assert modes.get("colocated") == 1
    assert modes.get("disaggregated", 0) >= 2
