"""One import path per name: the documented public names import from their packages, and no module re-exports a
lit_trainer name it does not use itself (the shims left by file splits are gone)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_trainer"

# the public API the README and the notebooks import from the package level
PUBLIC = {
    "lit_trainer": ["CausalLMModule", "DPOModule", "GRPOModule"],
    "lit_trainer.data": [
        "BaseDataModule",
        "BatchRebalanceSampler",
        "LengthGroupedSampler",
        "PreferenceDataModule",
        "PromptDataModule",
        "RepeatSampler",
        "SFTDataModule",
    ],
    "lit_trainer.callbacks": [
        "BEMA",
        "BestCheckpoint",
        "EvalOnStart",
        "ExactResume",
        "HFExport",
        "JITCheckpoint",
        "JITCheckpointExit",
        "NEFTune",
        "RunIdentity",
        "resolve_resume",
        "resolve_resume_checkpoint",
    ],
    "lit_trainer.losses": ["causal_lm_loss", "dpo_loss", "grpo_advantages", "grpo_policy_loss"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_import_from_their_package(package):
    module = importlib.import_module(package)
    assert set(PUBLIC[package]) <= set(module.__all__)
    for name in PUBLIC[package]:
        assert getattr(module, name) is not None


def _unused_lit_trainer_imports(path: Path) -> list[str]:
    """Names imported from ``lit_trainer.*`` by ``path`` that its code never references nor lists in ``__all__``."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.asname or alias.name: f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_trainer")
        for alias in node.names
    }
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {  # a public-API module (`callbacks/pytorch_lightning.py`) declares its exports in `__all__`
        elt.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        for elt in getattr(node.value, "elts", [])
        if isinstance(elt, ast.Constant)
    }
    used |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    return sorted(f"{name} (from {source})" for name, source in imported.items() if name not in used)


def test_no_module_re_exports_a_name_it_does_not_use():
    offenders = {
        str(path.relative_to(PACKAGE)): unused
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py" and (unused := _unused_lit_trainer_imports(path))
    }
    assert offenders == {}, "import these names from their defining module instead of re-exporting them"


def test_the_check_finds_a_shim(tmp_path):
    shim = tmp_path / "shim.py"
    shim.write_text(
        "from lit_trainer.data.samplers.rebalance import microbatch_cost, balance_step  # noqa: F401\n"
        "def f():\n    return balance_step\n"
    )
    assert _unused_lit_trainer_imports(shim) == [
        "microbatch_cost (from lit_trainer.data.samplers.rebalance.microbatch_cost)"
    ]
