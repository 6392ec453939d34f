"""Write the preference-module checkpoints that ``tests/test_preference_checkpoints.py`` loads.

The files in ``tests/data`` were written by this script run on the code before the reference model became a
component of its own (``DPOModule._precomputed``/``_release_reference`` then; the calls below are today's names for
the same state): later versions must keep reading them. ``PYTHONPATH=. python
tests/scripts/make_preference_checkpoints.py`` rewrites them. Each file is what ``Trainer.save_checkpoint`` writes for
a module built on a micro Llama (hidden size 8, about 15 KB of weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lit_trainer.modules import DPOModule, KTOModule
from tests.helpers.models import tiny_llama

OUT = Path(__file__).resolve().parents[1] / "data"


def save(module: L.LightningModule, name: str) -> None:
    trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(OUT / name, weights_only=False)


def main() -> None:
    # TR-DPO with the frozen copy as reference, its weights moved away from the policy's (as after a sync)
    dpo = DPOModule(tiny_llama(seed=0, hidden=8), sync_ref_model=True, ref_model_sync_steps=4, beta=0.2)
    with torch.no_grad():
        for p in dpo.ref_model.parameters():
            p.add_(0.5)
    save(dpo, "dpo_copy_sync.ckpt.pt")
    # precomputed reference log-probs, reference released: no ref_model.* keys, the columns in the checkpoint
    pre = DPOModule(tiny_llama(seed=0, hidden=8), precompute_ref_log_probs=True)
    entry = ("k" * 40, "data-fp", torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0]))
    pre.reference.precomputed.entries["train"] = entry
    pre.reference.release()
    assert pre.ref_model is None
    save(pre, "dpo_precomputed.ckpt.pt")
    # KTO with a separate reference model
    kto = KTOModule(tiny_llama(seed=0, hidden=8), ref_model=tiny_llama(seed=1, hidden=8), desirable_weight=2.0)
    save(kto, "kto_separate.ckpt.pt")


if __name__ == "__main__":
    main()
