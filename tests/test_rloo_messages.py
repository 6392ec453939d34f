"""RLOOModule is built on OnlineRLModule, the base it shares with GRPOModule, so it inherits the base's option checks:
their messages must name the class the user constructed (``RLOOModule(...)``), never the base or ``GRPOModule``. Its
CLI help lists its own options and the base's, not GRPOModule's."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_trainer.modules.rloo import RLOOModule
from lit_trainer.rewards import arithmetic_reward

BAD_OPTIONS = [
    ({"temperature": 0.0}, "`RLOOModule(temperature=0.0)` is invalid"),
    ({"num_generations": 1}, "`RLOOModule(num_generations=1)` is invalid"),
    ({"top_p": 2.0}, "`RLOOModule(top_p=2.0)` is invalid"),
    ({"cache_implementation": "paged"}, "`RLOOModule(cache_implementation='paged')` is invalid"),
    ({"sync_ref_model": True, "beta": 0.0}, "`RLOOModule(sync_ref_model=True)` with beta=0.0 is invalid"),
    ({"ref_model_mixup_alpha": 2.0, "sync_ref_model": True}, "`RLOOModule(ref_model_mixup_alpha=2.0"),
]


@pytest.mark.parametrize(("options", "expected"), BAD_OPTIONS, ids=[next(iter(o)) for o, _ in BAD_OPTIONS])
def test_inherited_option_errors_name_rloo_module(options, expected):
    with pytest.raises(ValueError) as raised:
        RLOOModule("tiny", reward_funcs=[arithmetic_reward], **options)
    message = str(raised.value)
    assert message.startswith(expected), message
    assert "GRPOModule" not in message


def test_the_missing_data_module_error_names_rloo_module():
    module = RLOOModule("tiny", reward_funcs=[arithmetic_reward])
    loader = torch.utils.data.DataLoader([{"prompt": "1+2="}], batch_size=1)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"^RLOOModule needs a PromptDataModule") as raised:
        trainer.fit(module, train_dataloaders=loader)
    assert "GRPOModule" not in str(raised.value)


def test_cli_model_help_lists_rloo_and_base_options_not_grpo_ones(capsys):
    from lit_trainer.cli import LitTrainerCLI

    with pytest.raises(SystemExit) as done:
        LitTrainerCLI(args=["fit", "--model.help", "lit_trainer.RLOOModule"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for own in ("normalize_advantages", "reward_clip_range", "epsilon_high", "top_p", "tools", "warmup_steps"):
        assert f"--model.{own} " in text or f"--model.init_args.{own} " in text, own  # RLOO's, the base's, BaseModule's
    for grpo_only in ("loss_type", "scale_rewards", "entropy_coef", "max_staleness", "off_policy_mask_threshold"):
        assert grpo_only not in text, grpo_only
