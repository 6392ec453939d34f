"""The notebooks run top to bottom in a real Jupyter kernel and print the numbers they claim.

Each notebook is executed with ``nbclient`` in fast mode (``LIT_TRAINER_NOTEBOOK_FAST=1``: a few steps per stage,
the same code as the full run) in a temporary working directory. The kernel is started from THIS interpreter
(``sys.executable -m ipykernel_launcher``) through a one-kernel spec manager, so it imports the same ``lit_trainer``
and torch as the test process, whatever kernel specs the machine has installed (a fresh CI venv has none but the one
``ipykernel`` ships, whose ``python`` may resolve to another interpreter on ``PATH``).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 600
_LINE = re.compile(r"^(?P<key>[A-Z_]+)(?: (?P<name>[^:\n]+))?: (?P<value>\S+)$", re.MULTILINE)


class _ThisInterpreter(KernelSpecManager):
    """Every kernel name resolves to an IPython kernel run by the test's own interpreter."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name=f"Python ({sys.executable})",
            language="python",
        )


def _execute(name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[nbformat.NotebookNode, str]:
    """Run ``notebooks/<name>`` in fast mode inside ``workdir``; return the executed notebook and its stdout."""
    monkeypatch.setenv("LIT_TRAINER_NOTEBOOK_FAST", "1")  # inherited by the kernel process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the suite runs test files in parallel on few cores
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    manager = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreter())
    client = NotebookClient(nb, km=manager, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError (with the cell and traceback) if any cell fails
    stdout = "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )
    return nb, stdout


def _tagged(stdout: str, key: str) -> dict[str | None, str]:
    """``{name: value}`` of the printed lines ``KEY name: value`` (``name`` None for ``KEY: value``)."""
    return {m["name"]: m["value"] for m in _LINE.finditer(stdout) if m["key"] == key}


def _images(nb: nbformat.NotebookNode) -> int:
    return sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


@pytest.mark.parametrize("name", ["quickstart.ipynb", "callbacks_in_your_project.ipynb"])
def test_committed_notebooks_carry_no_outputs(name: str) -> None:
    # outputs (PNG figures, logs) belong to a run, not to the repository
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{name} has no code cell"
    assert all(not cell.outputs and cell.execution_count is None for cell in code), f"clear the outputs of {name}"
    assert "LIT_TRAINER_NOTEBOOK_FAST" in code[0].source, "the fast-mode switch must be read in the first code cell"


@pytest.mark.slow
def test_quickstart_runs_and_sft_beats_the_untrained_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb, stdout = _execute("quickstart.ipynb", tmp_path, monkeypatch)
    scores: dict[Any, float] = {name: float(value) for name, value in _tagged(stdout, "EXACT_MATCH").items()}
    expected = {
        "untrained",
        "after SFT",
        "after DPO (sigmoid)",
        "after DPO (RPO)",
        "continued SFT (time of RPO)",
        "after GRPO",
        "continued SFT (time of RPO + GRPO)",
    }
    assert set(scores) == expected, stdout
    assert all(0.0 <= s <= 1.0 and math.isfinite(s) for s in scores.values()), scores
    # a randomly initialised model never produces "<sum></s>"; 150 SFT steps already solve a few percent
    assert scores["after SFT"] > scores["untrained"], scores
    assert _images(nb) >= 2, "the accuracy bar chart and the training curves must be drawn"
    runs = tmp_path / "runs" / "quickstart"
    for run, column in [("sft", "train_loss"), ("dpo_rpo", "logps/chosen"), ("grpo", "reward")]:
        header = (runs / run / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
        assert column in header, (run, header)


@pytest.mark.slow
def test_callbacks_notebook_runs_and_the_resumed_run_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, stdout = _execute("callbacks_in_your_project.ipynb", tmp_path, monkeypatch)
    assert _tagged(stdout, "RESUMED_EQUALS_UNINTERRUPTED") == {None: "True"}, stdout
    assert _tagged(stdout, "EVAL_ON_START_STEP") == {None: "0"}, stdout
    kept = int(_tagged(stdout, "BEST_CHECKPOINTS_KEPT")[None])
    assert 1 <= kept <= 2, stdout  # save_total_limit=2
    assert _tagged(stdout, "NEFTUNE_NOISE_WITHIN_BOUND") == {None: "True"}, stdout
    for key in ("LIVE_VAL_MSE", "BEMA_VAL_MSE"):
        assert math.isfinite(float(_tagged(stdout, key)[None])), stdout
    work = tmp_path / "runs" / "callbacks_in_your_project"
    assert len(list((work / "best").glob("*.ckpt"))) == kept
    assert [p.name for p in (work / "jit").glob("last-jit-*.ckpt")], "JITCheckpoint wrote no checkpoint"
