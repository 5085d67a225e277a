"""``python -m adamkit.demo``: a short run trains every optimizer and reports on each."""

import json
import sys

import numpy as np
import pytest

from adamkit import demo

SMALL = ["--steps", "40", "--batch", "256", "--users", "2000", "--items", "300",
         "--lr", "0.03"]


def test_demo_main_trains_every_optimizer(tmp_path, capsys):
  results = demo.main(SMALL + ["--out", str(tmp_path), "--no-progress"])
  out = capsys.readouterr().out
  assert set(results) == set(demo.OPTIMIZERS)
  for name, r in results.items():
    assert len(r["losses"]) == 40
    assert np.mean(r["losses"][-5:]) < r["losses"][0] - 0.02, name  # the loss went down
    assert 0.5 < r["eval_auc"][-1] <= 1.0, name
    assert r["label"] in out  # one table row per optimizer
    # compilation is timed on its own; every one of the 40 steps is a compiled step
    assert r["compile_s"] > 0 and len(r["step_ms"]) == 40, name
    assert r["ms_per_step"] == pytest.approx(np.median(r["step_ms"]))
  assert "eval AUC" in out and "compile s" in out and "check: " in out
  if "adam_offload" in results:  # same maths as ak.adam, only the state's memory differs
    assert "host memory): max |w difference| after 40 steps = 0.0e+00" in out
  saved = json.loads((tmp_path / "results.json").read_text())
  assert set(saved) == set(results)
  assert all("compile_s" in r and len(r["step_ms"]) == 40 for r in saved.values())
  pytest.importorskip("matplotlib")
  png = tmp_path / "demo_loss.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # What the plot calls identical by design is so in this run.
  for name, r in results.items():
    same = demo.OPTIMIZERS[name].same_as
    if same is None:
      continue
    gap = np.max(np.abs(np.subtract(r["losses"], results[same[0]]["losses"])))
    assert gap == 0.0 if "bit for bit" in same[1] else gap < 5e-3, (name, gap)


def test_identical_by_design_notes_name_both_runs():
  results = {n: {"label": e.label} for n, e in demo.OPTIMIZERS.items()}
  notes = demo.identical_by_design(results)
  pairs = [(n, e.same_as[0]) for n, e in demo.OPTIMIZERS.items() if e.same_as]
  assert len(notes) == len(pairs) >= 1
  for (a, b), note in zip(pairs, notes):
    assert demo.OPTIMIZERS[a].label in note and demo.OPTIMIZERS[b].label in note
  # without the run it equals, nothing is claimed
  assert demo.identical_by_design({"adam_offload": results["adam_offload"]}) == []


def test_help_documents_every_flag_and_optimizer(capsys):
  parser = demo.build_parser()
  with pytest.raises(SystemExit):
    demo.parse_args(["--help"])
  text = capsys.readouterr().out
  for action in parser._actions:  # argparse has no public list of its arguments
    assert action.help, action.option_strings
    for flag in action.option_strings:
      assert flag in text
  for name, entry in demo.OPTIMIZERS.items():
    assert name in text and entry.label in text


def test_demo_subset_and_plain_progress(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed
  results = demo.main(SMALL + ["--steps", "10", "--out", str(tmp_path),
                               "--optimizers", "adamax", "--no-plot"])
  captured = capsys.readouterr()
  assert list(results) == ["adamax"]
  assert "1 optimizer(s), lockstep: compiled in" in captured.err
  assert "lockstep: step 10/10" in captured.err
  assert not (tmp_path / "demo_loss.png").exists()


def test_demo_rejects_unknown_optimizer(capsys):
  with pytest.raises(SystemExit):
    demo.parse_args(["--optimizers", "adam,sgd"])
  assert "sgd" in capsys.readouterr().err


def test_auc_matches_pairwise_definition():
  rng = np.random.default_rng(0)
  scores, labels = rng.normal(size=60), rng.random(60) < 0.4
  pos, neg = scores[labels], scores[~labels]
  pairwise = np.mean(pos[:, None] > neg[None, :])
  assert demo.auc(scores, labels) == pytest.approx(pairwise)
