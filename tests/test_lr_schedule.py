"""Learning-rate schedules: transformers' own schedulers per optimizer step, and the logged rate is the one used."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from transformers import get_scheduler

from helpers.accumulation import accum_datamodule
from helpers.models import tiny_llama
from lit_trainer.modules.causal_lm import CausalLMModule

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "limit_val_batches": 0,
}


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate each ``step`` actually applies."""

    used: list[float]

    def step(self, closure=None):
        loss = closure() if closure is not None else None  # Lightning's closure runs the last micro-batch
        self.used.append(float(self.param_groups[0]["lr"]))
        super().step()
        return loss


class LogSpy(CausalLMModule):
    """Keeps every logged ``learning_rate``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logged: list[float] = []

    def log_dict(self, values, *args, **kwargs):
        if "learning_rate" in values:
            self.logged.append(float(values["learning_rate"]))
        return super().log_dict(values, *args, **kwargs)


def _fit(tokenizer, steps: int, **module_kwargs) -> tuple[list[float], list[float]]:
    """(rates the optimizer applied, rates logged) over ``steps`` optimizer steps, logging every step."""
    used: list[float] = []

    def make_optimizer(params):
        optimizer = RecordingSGD(params, lr=1.0)
        optimizer.used = used
        return optimizer

    module = LogSpy(tiny_llama(1), tokenizer=tokenizer, optimizer=make_optimizer, **module_kwargs)
    pl.Trainer(max_steps=steps, log_every_n_steps=1, **QUIET).fit(module, datamodule=accum_datamodule(tokenizer, 1))
    return used, module.logged


def _hf_rates(name: str, warmup: int, total: int, kwargs: dict | None = None) -> list[float]:
    """The rates transformers' scheduler gives ``total`` optimizer steps (peak 1.0)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(
        name, optimizer, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=kwargs or {}
    )
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_logged_learning_rate_is_the_rate_each_step_used(tokenizer):
    used, logged = _fit(tokenizer, 6, warmup_steps=3, scheduler="linear")
    # HF linear warmup s / w from 0, then linear decay to 0 at the last step: 0, 1/3, 2/3, 1, 2/3, 1/3
    assert used == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 2 / 3, 1 / 3])
    assert logged == pytest.approx(used)


@pytest.mark.parametrize(
    ("name", "warmup", "kwargs"),
    [
        ("cosine", 0.25, None),  # a fraction of the 8 steps: ceil(2.0) = 2 warmup steps
        ("cosine_with_min_lr", 3, {"min_lr_rate": 0.1}),
        ("warmup_stable_decay", 2, {"num_decay_steps": 3}),
        ("polynomial", 1, {"power": 2.0, "lr_end": 0.05}),
    ],
)
def test_rates_per_step_equal_transformers_get_scheduler(tokenizer, name, warmup, kwargs):
    used, logged = _fit(tokenizer, 8, warmup_steps=warmup, scheduler=name, scheduler_kwargs=kwargs)
    expected = _hf_rates(name, 2 if warmup == 0.25 else warmup, 8, kwargs)
    assert used == pytest.approx(expected, abs=1e-12)
    assert logged == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheduler": "reduce_lr_on_plateau"}, "steps on a validation metric"),
        ({"scheduler": "greedy"}, "steps on a validation metric"),
        ({"scheduler": "cosine_annealing"}, "`scheduler='cosine_annealing'` is invalid"),
        ({"scheduler": "constant", "warmup_steps": 10}, "use `scheduler='constant_with_warmup'`"),
        ({"scheduler": "cosine_with_min_lr"}, r"needs `scheduler_kwargs` with one of \['min_lr', 'min_lr_rate'\]"),
        ({"scheduler": "warmup_stable_decay"}, "num_decay_steps"),
        ({"scheduler": "linear", "scheduler_kwargs": {"min_lr_rate": 0.1}}, "does not take"),
        ({"warmup_steps": -1}, "`warmup_steps=-1` is invalid"),
    ],
)
def test_schedule_options_are_checked_when_the_module_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalLMModule(tiny_llama(), **kwargs)
