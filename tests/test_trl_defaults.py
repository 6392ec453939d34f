"""The defaults that differ from TRL 1.16 are exactly the rows of the table in ``docs/trl_differences.md``.

Our side is read from the constructors (``inspect.signature`` over each class's ``__init__`` chain: a subclass's
default wins over its base's), the Lightning ``Trainer`` as built with no argument, and the CLI's seed; TRL's side
from its config dataclasses' field defaults (``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``RewardConfig``, which
extend ``TrainingArguments``). An option is compared when the TRL config has a field of the same name or of the
aliased name below. Values are compared after the normalisations listed in ``_ours`` and ``_theirs`` (each says
which TRL rule it applies, e.g. ``bf16=None`` resolves to True). Any difference missing from the table, any row that
no longer differs, and any value the table shows that is no longer the code's, fails the test: the table cannot go
stale. Tests only: the library never imports trl.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lit_trainer import (
    CausalLMModule,
    CPOModule,
    DistillationModule,
    DPOModule,
    GRPOModule,
    KTOModule,
    ORPOModule,
    RewardModule,
    RLOOModule,
)
from lit_trainer.cli.app import DEFAULT_SEED
from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule, UnpairedPreferenceDataModule

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOConfig  # noqa: E402
from trl.experimental.gkd import GKDConfig  # noqa: E402
from trl.experimental.orpo import ORPOConfig  # noqa: E402
from trl.trainer.base_config import _BaseConfig  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trl_differences.md"
#: our class -> the TRL configs whose fields it shares (PreferenceDataModule serves DPO and reward models)
PAIRS = [
    (CausalLMModule, trl.SFTConfig),
    (SFTDataModule, trl.SFTConfig),
    (DPOModule, trl.DPOConfig),
    (PreferenceDataModule, trl.DPOConfig),
    (PreferenceDataModule, trl.RewardConfig),
    (GRPOModule, trl.GRPOConfig),
    (PromptDataModule, trl.GRPOConfig),
    (RewardModule, trl.RewardConfig),
    (KTOModule, trl.KTOConfig),
    (UnpairedPreferenceDataModule, trl.KTOConfig),
    (ORPOModule, ORPOConfig),
    (CPOModule, CPOConfig),
    (PreferenceDataModule, ORPOConfig),
    (RLOOModule, trl.RLOOConfig),
    (PromptDataModule, trl.RLOOConfig),
    (DistillationModule, GKDConfig),
    (SFTDataModule, GKDConfig),
]
#: our option -> TRL/TrainingArguments fields of the same meaning under another name (the first one present is used)
ALIASES = {
    "scheduler": ["lr_scheduler_type"],
    "batch_size": ["per_device_train_batch_size"],
    "eval_batch_size": ["per_device_eval_batch_size"],
    "num_workers": ["dataloader_num_workers"],
    "pin_memory": ["dataloader_pin_memory"],
    "persistent_workers": ["dataloader_persistent_workers"],
    "prefetch_factor": ["dataloader_prefetch_factor"],
    "drop_last": ["dataloader_drop_last"],
    "seed": ["data_seed"],
    "sampling": ["group_by_length"],
    "text_column": ["dataset_text_field"],
    "packing": ["packing", "padding_free"],
    "val_size": ["eval_strategy"],
}
#: options TRL 1.16 has no field for, with the behaviour it has instead: (our class, option, TRL config) ->
#: (the field name it would have, the value that behaviour corresponds to); the test checks the field is still absent
NO_FIELD = {
    (PromptDataModule, "max_length", trl.GRPOConfig): ("max_prompt_length", None),  # prompts never dropped nor cut
    (PreferenceDataModule, "truncation_mode", trl.RewardConfig): ("truncation_mode", "drop"),  # pairs that don't fit
    (PreferenceDataModule, "drop_identical_pairs", trl.DPOConfig): ("drop_identical_pairs", False),  # always kept
    (PreferenceDataModule, "drop_identical_pairs", trl.RewardConfig): ("drop_identical_pairs", False),
}


def field_defaults(config: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def signature_defaults(cls: type) -> dict[str, Any]:
    """Every keyword default of ``cls``'s ``__init__`` and its bases' (a subclass's own default wins)."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass.__module__.split(".")[0] != "lit_trainer":
            continue
        for name, p in inspect.signature(init).parameters.items():
            if p.default is not inspect.Parameter.empty:
                out[name] = p.default
    return out


def _ours(name: str, value: Any, defaults: dict[str, Any], reference: Any) -> Any:
    if name == "packing":
        return value != "none"  # TRL's packing / padding_free flags
    if name == "eval_batch_size" and value is None:
        return defaults["batch_size"]  # None: the training batch size
    if isinstance(value, str) and isinstance(reference, list):
        return [value]  # DPOConfig.loss_type: TRL wraps a single name in a list
    return value


def _theirs(field: str, value: Any, fields: dict[str, Any]) -> Any:
    if field == "lr_scheduler_type":
        return str(getattr(value, "value", value))  # a SchedulerType member
    if field == "data_seed" and value is None:
        return fields["seed"]  # TrainingArguments: the data order follows `seed` when `data_seed` is None
    if field == "group_by_length":
        return "group_by_length" if value else "random"
    if field == "pad_to_multiple_of" and value == "auto":
        return None  # "auto" is 128 on Neuron devices, None elsewhere
    if field == "bf16" and value is None:
        return True  # _BaseConfig.__post_init__: bf16 = not fp16
    if field == "eval_strategy":
        # "no": no evaluation, and no held-out rows: TRL trains on every row of the training set
        return 0 if str(getattr(value, "value", value)) == "no" else value
    return value


def option_differences() -> dict[tuple[str, str], tuple[Any, Any]]:
    """``{(our "Class.option", TRL "Config.field"): (our value, TRL value)}`` for every differing default."""
    out = {}
    for ours_cls, config in PAIRS:
        ours, theirs = signature_defaults(ours_cls), field_defaults(config)
        for name, value in ours.items():
            field = next((f for f in ALIASES.get(name, [name]) if f in theirs), None)
            if (ours_cls, name, config) in NO_FIELD:
                field, behaviour = NO_FIELD[ours_cls, name, config]
                assert field not in theirs, f"TRL now has {config.__name__}.{field}: compare with its default"
                theirs = {**theirs, field: behaviour}
            if field is None:
                continue
            reference = _theirs(field, theirs[field], theirs)
            mine = _ours(name, value, ours, reference)
            if mine != reference:
                out[(f"{ours_cls.__name__}.{name}", f"{config.__name__}.{field}")] = (mine, reference)
    return out


def trainer_differences() -> dict[tuple[str, str], tuple[Any, Any]]:
    """The Lightning ``Trainer`` built with no argument, and the CLI's seed, against TRL's shared config defaults."""
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    base = field_defaults(_BaseConfig)
    bf16 = _theirs("bf16", base["bf16"], base)
    # max_epochs None with max_steps -1: Lightning's fit loop trains 1000 epochs (its `_parse_loop_limits`)
    epochs = 1000 if trainer.max_epochs is None and trainer.max_steps == -1 else trainer.max_epochs
    pairs = [
        ("Trainer.precision", "bf16", trainer.precision, "bf16-mixed" if bf16 else "32-true"),
        ("Trainer.log_every_n_steps", "logging_steps", trainer.log_every_n_steps, base["logging_steps"]),
        ("Trainer.max_epochs", "num_train_epochs", epochs, base["num_train_epochs"]),
        ("LitTrainerCLI.seed_everything", "seed", DEFAULT_SEED, base["seed"]),
    ]
    return {(ours, f"_BaseConfig.{field}"): (a, b) for ours, field, a, b in pairs if a != b}


ROW = re.compile(
    r"^\|\s*`(?P<ours>[\w.-]+)`\s*\|\s*`(?P<trl>[\w.]+)`\s*\|\s*`(?P<mine>[^`]*)`\s*\|\s*`(?P<theirs>[^`]*)`"
)


def documented() -> dict[tuple[str, str], tuple[str, str]]:
    """The table's rows: ``{(our option, TRL field): (our value, TRL value)}`` as written."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            key = (match["ours"], match["trl"])
            assert key not in rows, f"{key} is listed twice in {DOCS.name}"
            rows[key] = (match["mine"], match["theirs"])
    return rows


def shown(value: Any) -> str:
    """How the table writes a value: strings bare, everything else as its Python repr."""
    return value if isinstance(value, str) else repr(value)


def test_every_default_that_differs_from_trl_is_in_the_docs_table_and_nothing_else():
    actual = {**option_differences(), **trainer_differences()}
    table = documented()
    missing = sorted(set(actual) - set(table))
    stale = sorted(set(table) - set(actual))
    assert not missing, f"defaults that differ from TRL 1.16 but are not in {DOCS.name}: {missing}"
    assert not stale, f"rows of {DOCS.name} whose defaults no longer differ (or are named wrongly): {stale}"
    for key, (mine, theirs) in actual.items():
        assert table[key] == (shown(mine), shown(theirs)), f"{key}: the table shows {table[key]}, the code has"


def test_the_comparison_sees_known_differences_and_agreements():
    """The machinery can fail: it finds a difference we know (precision) and agrees where we know both match."""
    actual = {**option_differences(), **trainer_differences()}
    assert ("Trainer.precision", "_BaseConfig.bf16") in actual
    assert ("DPOModule.learning_rate", "DPOConfig.learning_rate") not in actual  # both 1e-6
    assert signature_defaults(DPOModule)["beta"] == field_defaults(trl.DPOConfig)["beta"] == 0.1
    assert signature_defaults(GRPOModule)["learning_rate"] == field_defaults(trl.GRPOConfig)["learning_rate"]
