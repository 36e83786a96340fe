"""Goodput across restarts (titanlite/goodput.py, scripts/goodput.py): records written by hand and
the report computed by hand. A real run with a hang and a restart: tests/test_health.py."""

import json
import subprocess
import sys

import pytest

from helpers import REPO
from titanlite.goodput import GoodputClock, read, report

ZERO = {"skipped_steps": 0, "skipped_s": 0.0, "validation_s": 0.0}


def start(step, wall, startup, load):
    return {"event": "start", "step": step, "wall": wall, "startup_s": startup, "load_s": load}


def progress(step, wall, steps, step_s, save_s, data_s, event="progress", **more):
    return {"event": event, "step": step, "wall": wall, "steps": steps, "step_s": step_s, "save_s": save_s,
            "data_s": data_s} | ZERO | more


# Attempt 0 trains steps 1-3 and saves step 2; attempt 1 resumes from step 2 and ends at step 4.
TWO_ATTEMPTS = [
    start(0, 1000.0, 10.0, 0.0),
    progress(2, 1030.0, 2, 16.0, 2.0, 1.0),
    progress(3, 1040.0, 3, 24.0, 2.0, 1.5),
    start(2, 1100.0, 12.0, 3.0),
    progress(4, 1140.0, 2, 18.0, 2.0, 0.5, skipped_steps=1, skipped_s=4.0, validation_s=3.0),
    progress(4, 1141.0, 2, 18.0, 2.0, 0.5, event="end", skipped_steps=1, skipped_s=4.0, validation_s=3.0),
]


def test_a_restart_splits_the_wall_time_as_counted_by_hand():
    summary = report(TWO_ATTEMPTS)
    parts = summary["parts"]
    assert summary["wall_s"] == 141.0  # the first process's start to the last record
    assert parts["productive_s"] == 16.0 + 18.0  # steps 1-2 of attempt 0, 3-4 of attempt 1
    assert parts["lost_s"] == 24.0 - 16.0 and summary["lost_steps"] == 1  # step 3, trained twice
    assert summary["kept_steps"] == 4
    assert parts["down_s"] == 1100.0 - 1040.0
    assert (parts["startup_s"], parts["load_s"], parts["save_s"], parts["data_s"]) == (22.0, 3.0, 4.0, 2.0)
    assert (parts["skipped_s"], parts["validation_s"]) == (4.0, 3.0)
    assert parts["other_s"] == pytest.approx(141.0 - (34 + 22 + 3 + 4 + 8 + 60 + 2 + 4 + 3))
    assert summary["goodput"] == pytest.approx(34.0 / 141.0)
    assert summary["attempts"] == 2 and summary["ended"]


def test_a_later_resume_from_an_older_checkpoint_loses_what_an_earlier_attempt_kept():
    """Attempt 1 resumed from step 2 and trained to step 4; attempt 2 resumed from step 2 again (step
    4's checkpoint was damaged): attempt 1's steps are all lost, attempt 0 keeps steps 1-2 only."""
    rows = TWO_ATTEMPTS[:4] + [progress(4, 1140.0, 2, 18.0, 2.0, 0.5), start(2, 1200.0, 5.0, 1.0),
                               progress(4, 1230.0, 2, 17.0, 1.0, 0.5, event="end")]
    summary = report(rows)
    assert summary["kept_steps"] == 4 and summary["lost_steps"] == 1 + 2
    assert summary["parts"]["productive_s"] == 16.0 + 17.0
    assert summary["parts"]["lost_s"] == 8.0 + 18.0
    assert summary["parts"]["down_s"] == (1100.0 - 1040.0) + (1200.0 - 1140.0)


def test_a_cut_last_line_is_left_out_and_the_script_reports_and_plots(tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in TWO_ATTEMPTS) + '{"event": "progr'
    (tmp_path / "goodput.jsonl").write_text(text)
    assert read(tmp_path) == TWO_ATTEMPTS
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "goodput.py"), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "goodput 24.1% of 141.0s over 2 attempt(s), 1 step(s) lost" in out.stdout
    assert "| down between attempts | 60.0 | 42.6% |" in out.stdout
    assert (tmp_path / "goodput.png").stat().st_size > 0


def test_a_folder_without_records_is_one_line(tmp_path):
    (tmp_path / "goodput.jsonl").write_text(json.dumps(progress(1, 1.0, 1, 1.0, 0.0, 0.0)) + "\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "goodput.py"), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no start record" in out.stderr, out.stderr


def test_an_attempt_after_a_cut_line_starts_a_line_of_its_own(tmp_path):
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TWO_ATTEMPTS[:3]) + '{"event": "progr')
    GoodputClock(tmp_path, True, 1100.0).start(2, 3.0, 1112.0, fresh=False)
    assert read(tmp_path) == TWO_ATTEMPTS[:4]
