"""Runtime input edges: a BOM-prefixed gpt corpus, a peft executor handed a multi-rank world."""

from __future__ import annotations

import codecs
import io
import json

from agent.runtime.data import make_source, read_corpus
from agent.runtime.peft.workload import run as peft_run
from agent.runtime.report import Reporter, parse_line


def test_gpt_corpus_with_a_utf8_bom_is_read_without_it(tmp_path):
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": f"s{i} héllo"}) + "\n" for i in range(3)), encoding="utf-8-sig")
    assert read_corpus(str(jl)) == "s0 héllo\ns1 héllo\ns2 héllo".encode()
    x, _ = make_source({"kind": "file", "path": str(jl)}, 256, 0).batch(0, 2, 4)
    assert x.shape == (2, 4)
    txt = tmp_path / "c.txt"
    txt.write_bytes(codecs.BOM_UTF8 + b"abc")
    assert read_corpus(str(txt)) == b"abc"


def test_peft_executor_refuses_a_world_of_more_than_one_rank(tmp_path):
    wl = {"type": "peft", "steps": 2, "batch_size": 2,
          "model": {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 16, "heads": 2},
          "peft": {"tasks": [{"name": "a", "dataset": {"min_len": 4}}]}}
    buf = io.StringIO()
    rc = peft_run({"job_id": "j", "workload": wl, "checkpoint_dir": str(tmp_path), "threads": 1,
                   "dist": {"rank": 1, "world_size": 2}}, Reporter(buf))
    ev = [e for e in map(parse_line, buf.getvalue().splitlines()) if e]
    assert rc == 2 and ev[-1]["event"] == "error" and ev[-1]["field"] == "resources.devices"
    assert not (tmp_path / "peft").exists()  # nothing trained, nothing written
