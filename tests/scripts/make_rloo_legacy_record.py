"""Record what a run of the former ``RLOOModule`` (a subclass of ``GRPOModule``) left in its checkpoint and run folder,
for ``tests/test_rloo_legacy.py``.

That class stored ``loss_type="grpo"`` among its hyper-parameters, and ``lit-trainer fit`` listed GRPOModule's other
options (at their defaults) in the run's ``config.yaml`` and in the checkpoint's run record. Today's ``RLOOModule``
has none of them; its checkpoints must still load and resume. A whole checkpoint of the preset model is too large for
the repository, so this script keeps the small parts: the checkpoint's ``hyper_parameters``, its run record and the
model section of the run's ``config.yaml``, as JSON (``tests/data/rloo_legacy_record.json``). The test writes a
checkpoint with today's code and puts these parts in it.

Run it on the code to record (the commit before ``RLOOModule`` stopped inheriting GRPOModule)::

    PYTHONPATH=<that tree> python tests/scripts/make_rloo_legacy_record.py
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import yaml

OUT = Path(__file__).resolve().parents[1] / "data" / "rloo_legacy_record.json"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rloo.yaml"


def main() -> None:
    from lit_trainer.cli import LitTrainerCLI

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        LitTrainerCLI(args=[
            "fit", "--config", str(CONFIG), "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.val_check_interval", "null",
            "--trainer.limit_val_batches", "0", "--model.init_args.max_completion_length", "2",
            "--data.init_args.batch_size", "16", "--data.init_args.eval_batch_size", "16",
            "--trainer.default_root_dir", tmp,
        ])  # fmt: skip
        run = Path(tmp) / "rloo" / "version_0"
        checkpoint = torch.load(next(run.glob("checkpoints/*.ckpt")), weights_only=False, map_location="cpu")
        config = yaml.safe_load((run / "config.yaml").read_text())
    record = {
        "hyper_parameters": dict(checkpoint["hyper_parameters"]),
        "lit_trainer_run": checkpoint["lit_trainer_run"],
        "config_model": config["model"],
    }
    OUT.write_text(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
