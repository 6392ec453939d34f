"""Which step writes a run's export, for the message when a chained recipe's input is missing.

A recipe that starts from another run's export names it by its folder, ``runs/<run name>/version_<n>/hf_model``
(``configs/grpo_rm.yaml`` reads ``runs/sft/version_0/hf_model`` and ``runs/reward/version_0/hf_model``).
When that folder does not exist, :func:`missing_export_message` says which run it belongs to, what the run folder
holds instead, and the command that writes it (:data:`RECIPE_STEPS` for the shipped recipes' runs).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath

RECIPE_STEPS: dict[str, str] = {
    "sft": "lit-trainer fit --config configs/sft.yaml",
    "reward": "lit-trainer fit --config configs/reward.yaml",
    "sft_tool_chat": "lit-trainer fit --config configs/sft_tool_chat.yaml",
    "sft_vl": "lit-trainer fit --config configs/sft_vl.yaml",
    "sft_vl_partial": (
        "lit-trainer fit --config configs/sft_vl.yaml --trainer.max_steps 30 --trainer.val_check_interval 30 "
        "--run_name sft_vl_partial"
    ),
    "smollm2_sft": "lit-trainer fit --config configs/smollm2_sft.yaml",
    "smollm2_dpo": "lit-trainer fit --config configs/smollm2_dpo.yaml",
    "smollm2_sft_lora": (
        "lit-trainer fit --config configs/smollm2_sft.yaml --config configs/overlays/smollm2_lora.yaml "
        "--model.init_args.learning_rate 0.0005 --run_name smollm2_sft_lora"
    ),
    "smollm2_dpo_lora": (
        "lit-trainer fit --config configs/smollm2_dpo.yaml --config configs/overlays/smollm2_lora.yaml "
        "--model.init_args.model runs/smollm2_sft_lora/version_0/hf_model --model.init_args.learning_rate 0.0001 "
        "--run_name smollm2_dpo_lora"
    ),
}
"""The command that writes ``runs/<run name>/`` for each run whose export a shipped recipe or page loads (run from the
repository root; ``tests/test_chained_recipes.py`` checks that every such path is here and that each command writes
that run)."""
_VERSION = re.compile(r"^version_\d+$")
EXPORT_DIR = "hf_model"  # the folder HFExport writes inside a run folder


def run_of_export(path: str) -> tuple[Path, str, str] | None:
    """``(root, run name, version folder)`` of a path shaped ``<root>/<run name>/version_<n>/hf_model``, else None.

    Example:
        >>> run_of_export("runs/reward/version_0/hf_model")
        (PosixPath('runs'), 'reward', 'version_0')
        >>> run_of_export("org/model") is None
        True
    """
    parts = PurePath(path.rstrip("/\\")).parts
    if len(parts) < 4 or parts[-1] != EXPORT_DIR or not _VERSION.match(parts[-2]):
        return None
    return Path(*parts[:-3]), parts[-3], parts[-2]


def step_command(root: Path, run: str) -> str:
    """The command that writes ``<root>/<run>/``: the shipped recipe's (:data:`RECIPE_STEPS`) or a generic form."""
    command = RECIPE_STEPS.get(run, f"lit-trainer fit --config <the recipe of that run> --run_name {run}")
    return command if root == Path("runs") else f"{command} --trainer.default_root_dir {root}"


def missing_export_message(path: str) -> str | None:
    """What to do about a missing run export ``path`` (None when ``path`` is not shaped like one).

    Names the run and its folder, what that folder holds instead (other versions, or a run without ``hf_model/``,
    i.e. one that has not finished) and the command to run first.
    """
    parsed = run_of_export(path)
    if parsed is None:
        return None
    root, run, version = parsed
    run_root, command = root / run, step_command(root, run)
    others = sorted((p for p in run_root.glob("version_*") if (p / EXPORT_DIR).is_dir()), key=_version_key)
    where = " (in this directory)" if not root.is_absolute() else ""
    if others:  # a finished run of that name exists under another number: say how to use it
        newest = others[-1] / EXPORT_DIR
        return (
            f"Model path {path!r} does not exist: it is the export of run '{run}', and {run_root}/ holds the exports "
            f"of {', '.join(p.name for p in others)}. Point the recipe at one of them: replace {path} by {newest} "
            "where the config names it (--model.init_args.model for the policy, its entry of "
            "--model.init_args.reward_funcs for a reward model), or run the step that writes it and then pass the "
            f"version it prints{where}: `{command}`."
        )
    if (run_root / version).is_dir():
        state = (
            f"{run_root / version} exists but has no {EXPORT_DIR}/: that run has not finished (HFExport writes "
            f"{EXPORT_DIR}/ when fit ends). Finish it (its command with --ckpt_path last) or run the step again"
        )
    else:
        state = f"it is the export of run '{run}', and {run_root}/ has no run. Run the step that writes it first"
    return (
        f"Model path {path!r} does not exist: {state}{where}: `{command}`; or point the recipe at another export "
        "(--model.init_args.model PATH for the policy, an entry of --model.init_args.reward_funcs for a reward model)."
    )


def _version_key(folder: Path) -> int:
    return int(folder.name.removeprefix("version_"))
