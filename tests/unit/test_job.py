"""aiayn.pipeline's results record: the keys of results.json (the job's schema, which scripts
and the docs read), present where they apply, and its report in words."""

from __future__ import annotations

import json

import pytest

from aiayn.errors import UserError
from aiayn.pipeline import JobOptions, Results

# results.json's keys, in the order the job fills them
ALWAYS = ["dataset", "direction", "preset", "test_set", "parameters", "train_steps",
          "train_epochs", "train_wall_s", "pipeline_wall_s", "decode_wall_s",
          "train_cpu_steal_pct", "threads", "precision", "decode_precision",
          "decode_precision_check", "beam_size", "shape", "averaged", "weights", "alpha",
          "valid_bleu_by_alpha", "valid_bleu_by_average", "text", "lr_schedule",
          "sacrebleu_bleu", "sacrebleu_chrf", "bleu_signature", "chrf_signature", "hypotheses",
          "valid_bleu_greedy_last"]


def _results(**changes) -> Results:
    base = dict(
        dataset="multi30k", direction="en-de", preset="tiny", test_set="test_2016_flickr",
        parameters=1000, train_steps=240, train_epochs=2.5, train_wall_s=61.2,
        pipeline_wall_s=90.0, decode_wall_s=3.4, train_cpu_steal_pct=None, threads=2,
        precision={"chosen": "fp32"}, decode_precision="fp32", decode_precision_check=None,
        beam_size=4, shape=None, averaged=["step-00000240"], weights="1", alpha=0.6,
        valid_bleu_by_alpha={"0.6": 12.5}, valid_bleu_by_average={"1": {"0.6": 12.5}},
        text="none", lr_schedule="noam", sacrebleu_bleu=11.0, sacrebleu_chrf=40.0,
        bleu_signature="nrefs:1|case:mixed", chrf_signature="chrF2", hypotheses="run/test.hyp.de",
        valid_bleu_greedy_last=10.0)
    return Results(**{**base, **changes})


def test_the_keys_of_results_json():
    single = _results()
    assert list(single.to_dict()) == ALWAYS
    assert json.loads(single.to_json()) == single.to_dict()
    members = [{"run_dir": "run/member-1", "seed": 1, "steps": 10, "epochs": 1.0,
                "valid_nll": None}]
    full = _results(ensemble=1, members=members, multi30k_tok_bleu=30.1,
                    multi30k_tok_reference="tok.de.gz")
    assert list(full.to_dict()) == ALWAYS + ["ensemble", "members", "multi30k_tok_bleu",
                                             "multi30k_tok_reference"]
    text = full.describe()
    assert "Multi30k literature protocol     BLEU 30.10" in text
    assert "ensemble member-1 (seed 1, 2 thread(s))" in text and "val nll nan" in text
    assert "aiayn translate --checkpoint run," in text
    lc = _results(text="lc-norm-tok", sacrebleu_bleu=None, bleu_signature=None).describe()
    assert "chrF 40.00 on that text" in lc and "sacreBLEU" not in lc


def test_bad_options_are_refused_by_name():
    with pytest.raises(UserError, match="--average must be at least 1, got 0"):
        JobOptions(average=[3, 0])
    with pytest.raises(UserError, match="--ensemble must be at least 1, got 0"):
        JobOptions(ensemble=0)
    with pytest.raises(UserError, match="--test-src and --test-tgt go together"):
        JobOptions(test_src="a.en")
    assert JobOptions(ensemble="auto").ensemble == "auto"
