"""Reward models as GRPO reward functions (TRL 1.16's model entries of ``reward_funcs``).

The scores are compared with ``trl.GRPOTrainer._calculate_rewards`` on the same completions (standard and
conversational prompts, a model mixed with a function), and with an independent forward pass inside a fit.
"""

from __future__ import annotations

import csv
import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from test_grpo_module import QUIET, data, grpo

from lit_trainer.models import build_preset_model, build_tokenizer, load_model
from lit_trainer.modules.online_rl._reward_calls import is_model_path, resolve_reward_funcs
from lit_trainer.rewards import RewardModelScorer, arithmetic_reward, call_reward_functions


def reward_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return build_preset_model("tiny-64", task="sequence_classification")


def saved_reward_model(path: Any, seed: int = 0) -> Any:
    """A reward model directory as ``HFExport`` writes one (model + tokenizer)."""
    model = reward_model(seed)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return model


def independent_scores(model: Any, texts: list[str]) -> list[float]:
    """One row at a time, no padding: the model's score at the last token of ``prompt + completion + EOS``, the text
    GRPO scores by default (as the reward model was trained; the presets' tokenizer adds no special token)."""
    tokenizer = build_tokenizer()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text + "</s>", add_special_tokens=False)["input_ids"]])
            out.append(model.eval()(input_ids=ids).logits[0, 0].item())
    return out


def lengths(completions: list, **_: Any) -> list[float]:
    return [float(len(str(c))) for c in completions]


@pytest.mark.slow  # importing trl takes several seconds
@pytest.mark.parametrize("conversational", [False, True])
def test_scores_equal_trl_grpo_trainer(tmp_path, conversational):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = reward_model(), build_tokenizer()
    if conversational:
        prompts = [[{"role": "user", "content": f"{a}+{a}=?"}] for a in (12, 40, 7)]
        completions = [[{"role": "assistant", "content": text}] for text in ("24", "8", "14 or so")]
    else:
        prompts = ["12+12=", "40+40=", "7+7="]
        completions = ["24", "8", "14 or so"]
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=3, num_generations=3, use_cpu=True
    )
    trainer = GRPOTrainer(
        model=build_preset_model("tiny-64"),
        reward_funcs=[model, lengths],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        reward_processing_classes=[tokenizer, None],
    )
    ids = [tokenizer(str(c), add_special_tokens=False)["input_ids"] for c in completions]
    inputs = [{"prompt": p} for p in prompts]
    expected = trainer._calculate_rewards(inputs, prompts, completions, ids).cpu()

    funcs = resolve_reward_funcs([model, lengths], [tokenizer, None], reward_model_inputs="trl")  # TRL's GRPO text
    ours = call_reward_functions(funcs, prompts, completions, ids)
    assert torch.equal(ours, expected)  # same ids through the same model in one padded pass: the same arithmetic
    assert ours[:, 0].unique().numel() == 3  # three different scores: the test would see a wrong row or position


def test_a_directory_is_a_reward_model_scored_at_the_last_real_token(tmp_path):
    model = saved_reward_model(tmp_path / "rm")
    scorer = resolve_reward_funcs([str(tmp_path / "rm")])[0]
    assert isinstance(scorer, RewardModelScorer) and scorer.__name__ == "rm"  # TRL's name: the path's last part
    texts = ["1+2=3", "10+20=30 and more", "5+5=10"]
    scores = scorer(prompts=[t[:4] for t in texts], completions=[t[4:] for t in texts])
    # padded batch vs one unpadded row at a time: the same positions read, rounding of another batch shape (1e-5 is
    # far below the spread of these scores, which a wrong position or padding read would change by > 1e-2)
    assert scores == pytest.approx(independent_scores(model, texts), abs=1e-5)
    assert max(scores) - min(scores) > 1e-2
    chunked = RewardModelScorer(str(tmp_path / "rm"), batch_size=1)(prompts=texts, completions=[""] * 3)
    assert chunked == pytest.approx(scores, abs=1e-5)
    assert not any(p.requires_grad for p in scorer.model.parameters()) and not scorer.model.training


def test_reward_model_names():
    from lit_trainer.rewards import reward_model_name

    assert reward_model_name("org/reward-model") == "reward-model"  # TRL's rule: the last part of the path
    assert reward_model_name("runs/reward/version_3/hf_model/") == "reward"  # a lit-trainer export: its run name
    assert reward_model_name("exports/hf_model") == "hf_model"


def test_reward_funcs_entries_resolve_to_functions_or_models(tmp_path):
    saved_reward_model(tmp_path / "rm")
    assert is_model_path(str(tmp_path / "rm")) and is_model_path("tiny-64") and is_model_path("org/reward-model")
    assert not is_model_path("lit_trainer.rewards.arithmetic_reward")
    funcs = resolve_reward_funcs(["lit_trainer.rewards.arithmetic_reward", "tiny-64", str(tmp_path / "rm")])
    assert funcs[0] is arithmetic_reward
    assert [type(f).__name__ for f in funcs[1:]] == ["RewardModelScorer"] * 2
    with pytest.raises(ValueError, match=r"has 1 entries for 2 reward functions"):
        resolve_reward_funcs([arithmetic_reward, "tiny-64"], [None])
    with pytest.raises(ValueError, match=r"tokenizers are for reward models only"):
        resolve_reward_funcs([arithmetic_reward], [build_tokenizer()])
    with pytest.raises(ValueError, match=r"not a sequence classifier with one label"):
        resolve_reward_funcs([load_model("tiny-64")])  # a causal LM is not a reward model
    with pytest.raises(ValueError, match=r"cannot be imported.*reward model an existing directory"):
        resolve_reward_funcs(["no_such_module.reward"])


class Recorder:
    """A function reward that records what it scored (to rescore the same rows independently)."""

    __name__ = "recorded_arithmetic"

    def __init__(self) -> None:
        self.rows: list[tuple[list, list, list]] = []

    def __call__(self, prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
        self.rows.append((list(prompts), list(completions), list(answer)))
        return arithmetic_reward(prompts, completions, [[]] * len(completions), answer=answer)


def test_fit_mixes_a_reward_model_with_a_function_and_weights(tmp_path):
    model = saved_reward_model(tmp_path / "rm")
    recorder = Recorder()
    module = grpo(reward_funcs=[str(tmp_path / "rm"), recorder], reward_weights=[0.5, 1.0], num_generations=4, beta=0.0)
    trainer = L.Trainer(max_steps=2, log_every_n_steps=1, **{**QUIET, "logger": CSVLogger(tmp_path, name="r")})
    trainer.fit(module, datamodule=data(8, batch_size=16))
    assert module.reward_names == ["rm", "recorded_arithmetic"]
    with open(tmp_path / "r" / "version_0" / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r.get("rewards/rm/mean")]
    assert len(logged) == len(recorder.rows) == 2  # one round per optimizer step, each logged once
    for row, (prompts, completions, answers) in zip(logged, recorder.rows):
        model_scores = independent_scores(model, [p + c for p, c in zip(prompts, completions)])
        function_scores = arithmetic_reward(prompts, completions, [[]] * len(completions), answer=answers)
        # float32 forward of another batch shape, then a mean of 16: 1e-5 (the scores spread over > 1e-2)
        assert float(row["rewards/rm/mean"]) == pytest.approx(sum(model_scores) / 16, abs=1e-5)
        total = [0.5 * m + f for m, f in zip(model_scores, function_scores)]
        assert float(row["reward"]) == pytest.approx(math.fsum(total) / 16, abs=1e-5)
    scorer = module.reward_funcs[0]
    assert torch.equal(scorer.model.score.weight, model.score.weight)  # frozen: never trained
    checkpoint_keys = module.state_dict().keys()
    assert not any("score" in k for k in checkpoint_keys)  # not in checkpoints: reloaded from its path
    assert module.hparams.reward_funcs == [str(tmp_path / "rm"), "recorded_arithmetic"]


@pytest.mark.slow
@pytest.mark.ddp
def test_each_rank_scores_its_own_rows_under_ddp_and_sharding(ddp_world):
    """2 CPU ranks: every rank runs the reward model on its own completions, and the round's reward metrics are over
    the rows of both ranks (DDP, and ModelParallelStrategy with a sharded policy)."""
    out = ddp_world.part("grpo_reward_model_ranks")  # tests/scripts/grpo_reward_model_ranks.py
    model = reward_model(0)  # the weights the script saved (saved_reward_model's default seed)
    for strategy in ("ddp", "model_parallel"):
        ranks = [torch.load(out / f"{strategy}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert [r["world_size"] for r in ranks] == [2, 2] and {r["device"] for r in ranks} == {"cpu"}
        assert [len(r["scored"]) for r in ranks] == [1, 1]  # one round each
        (p0, c0), (p1, c1) = ranks[0]["scored"][0], ranks[1]["scored"][0]
        assert len(p0) == len(p1) == 4 and set(p0).isdisjoint(p1)  # each rank its own prompts' rows
        scores = independent_scores(model, [p + c for p, c in zip(p0 + p1, c0 + c1)])
        for rank in ranks:
            metrics = rank["metrics"][0]
            # gathered over ranks: the mean of all 8 rows; 1e-5: another batch shape in float32 (scores spread > 1e-2)
            assert metrics["rewards/rm/mean"] == pytest.approx(sum(scores) / 8, abs=1e-5)
        assert max(scores) - min(scores) > 1e-2
