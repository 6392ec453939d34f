"""2-process DDP on CPU (gloo) with TrackioLogger: the store gets each step, and each table, exactly once (rank 0
writes; see tests/scripts/ddp_trackio.py)."""

from __future__ import annotations

import pytest

from helpers.ddp import output_tail, run_script
from helpers.trackio_store import new_project, rows, runs, steps_of

pytestmark = pytest.mark.ddp


def test_ddp_writes_each_step_and_table_once_from_rank_zero(tmp_path):
    pytest.importorskip("trackio")
    project = new_project()
    proc = run_script("ddp_trackio.py", tmp_path, project, timeout=300)
    assert proc.returncode == 0, output_tail(proc)
    (run,) = runs(project)
    assert run["name"] == "ddp-version_0"
    assert steps_of(project, run["id"], "train_loss") == [0, 1, 2, 3, 4]
    tables = [row["samples"]["_value"] for row in rows(project, run["id"]) if "samples" in row]
    assert tables == [[{"rank": 0, "step": 2}], [{"rank": 0, "step": 4}]]
