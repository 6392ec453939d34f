"""DistillationModule: on-policy knowledge distillation from a frozen teacher (GKD; TRL 1.16's ``DistillationTrainer``
and the experimental ``GKDTrainer``).

Each training micro-batch is a batch of prompt/completion rows of the SFT data module (labels ``-100`` on the prompt).
With probability ``lmbda`` (drawn per micro-batch from a seeded stream, the same on every rank) the student samples
its own completions for the prompts (on-policy); otherwise the dataset's completions are used, or the teacher's with
``seq_kd``. The loss is the generalised JSD (:func:`~lit_trainer.losses.distillation.generalized_jsd_loss`) between
the student's and the teacher's next-token distributions at every completion token, summed and divided by the
optimizer step's completion-token count over all micro-batches and ranks: a token mean, exact under accumulation,
DDP and FSDP2. A sampled completion's length is only known after sampling, so the micro-batches of a step divide by
the data module's count of dataset completion tokens and the step's last micro-batch rescales the step's gradient by
``provisional / exact`` (:meth:`~lit_trainer.modules.base.BaseModule.rescale_step_gradients`); the difference of the
two counts is summed over ranks per sampled micro-batch and kept in checkpoints, so a checkpoint written inside an
accumulation window resumes exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from lightning.pytorch import Callback
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer.core import sharding as _sharding
from lit_trainer.core.seeding import derive_seed
from lit_trainer.data.collate import SFTCollator
from lit_trainer.data.loader import NUM_ITEMS_KEY
from lit_trainer.generation import RolloutGenerator, SamplingOptions, make_engine
from lit_trainer.generation import engines as rollout
from lit_trainer.losses.causal_lm import count_target_tokens
from lit_trainer.losses.distillation import chunked_token_divergence, generalized_jsd_loss
from lit_trainer.losses.logprobs import IGNORE_INDEX
from lit_trainer.metrics import greedy_batch_matches
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.base import BaseModule, _logits, _positions
from lit_trainer.modules.reference import disable_dropout_in_model

__all__ = ["DistillationModule"]

_STATE_KEY = "lit_trainer_distillation"
_LMBDA_STREAM, _SAMPLING_STREAM = 0x6B64, 0x5EED  # two unrelated seeded streams (hashed with the batch)


def _vocabulary_problem(student: Any, teacher: Any, student_tok: Any, teacher_tok: Any) -> str | None:
    """A sentence saying how the two models' vocabularies differ, or None when they match."""
    sizes = [m.config.get_text_config().vocab_size for m in (student, teacher)]
    heads = [getattr(_logits.output_head(m), "out_features", None) for m in (student, teacher)]
    if sizes[0] != sizes[1] or heads[0] != heads[1]:
        return f"the student has vocab_size {sizes[0]} (head {heads[0]}) and the teacher {sizes[1]} (head {heads[1]})"
    if student_tok is not None and teacher_tok is not None and student_tok.get_vocab() != teacher_tok.get_vocab():
        return "the two tokenizers map tokens to different ids"
    return None


class DistillationModule(BaseModule):
    """Distil a frozen teacher into the student with the generalised JSD, on- or off-policy (TRL 1.16's GKD).

    Per micro-batch (:mod:`lit_trainer.modules.distillation`): with probability ``lmbda`` the student samples the
    completions of the batch's prompts (``temperature``, ``max_new_tokens``, top-k 0 and top-p 1 as TRL's GKD), else
    the dataset's completions are used (``seq_kd=True``: the teacher samples them instead), sampled through
    ``self.rollouts`` (a :class:`~lit_trainer.generation.RolloutGenerator`: ``generate``, or vLLM with
    ``rollout_engine="vllm"``, docs/vllm.md). The student (with
    gradient) and the teacher (``torch.no_grad``, eval mode) score the same rows; the loss is the generalised JSD of
    their temperature-scaled next-token distributions at every completion token (EOS included), a token mean over the
    optimizer step. ``beta=0`` is the forward KL(teacher || student), ``beta=1`` the reverse KL.

    The teacher is ``self.teacher_model``: frozen (no gradient, never in the optimizer nor in clipping), always in eval
    mode, and left out of checkpoints (it never changes; a resumed run loads it again from ``teacher_model``). It must
    share the student's vocabulary (checked at construction). With a large vocabulary (``chunked_logits``, as the other
    modules) the divergence is computed from both models' last hidden states a chunk of positions at a time
    (:func:`~lit_trainer.losses.distillation.chunked_token_divergence`), so neither model's full ``B x T x V`` logits
    exist. Runs on one device, under DDP (each rank samples for its own rows) and under ``ModelParallelStrategy``
    (FSDP2): the teacher is sharded like the student (:meth:`networks_to_shard`), generation keeps the ranks in step
    (``synced_gpus``), and the chunked path gathers the teacher's head (``full_tensor``) while the student's head is
    used inside its own forward, where FSDP2 has gathered it.

    Validation logs ``val_loss`` (the divergence on the dataset completions, a token mean) and, with
    ``eval_exact_match``, ``val_exact_match`` (greedy completions of the validation prompts).

    Args:
        model: the student: a preset name, local directory, hub id or ``PreTrainedModel``.
        teacher_model: the teacher: a preset name, local directory, hub id or ``PreTrainedModel`` (a causal LM with
            the student's tokenizer).
        lmbda: per micro-batch probability of on-policy (student-sampled) completions, in [0, 1] (TRL's ``lmbda``).
        beta: generalised JSD interpolation in [0, 1].
        temperature: sampling temperature and the softmax temperature of the divergence (> 0).
        max_new_tokens: most tokens sampled per completion (TRL ``DistillationConfig.max_completion_length``).
        seq_kd: off-policy micro-batches use teacher-sampled completions instead of the dataset's.
        rollout_engine: what samples the student's completions: ``"generate"`` (transformers) or ``"vllm"``
            (:class:`~lit_trainer.generation.vllm.VLLMEngine` in the training process, reloaded after every optimizer
            step; a sharded student is gathered on every rank for its own server; not with ``seq_kd``).
        rollout_engine_options: keyword arguments of :class:`~lit_trainer.generation.vllm.VLLMEngine`.
        generation_seed: seed of the ``lmbda`` draws and of sampling; None = the torch initial seed at fit start.
        disable_dropout: zero every dropout of the student and the teacher (TRL's GKD default).
        eval_exact_match: also log ``val_exact_match`` (a greedy ``generate`` per validation batch).
        eval_max_new_tokens: generation budget of that metric.
        learning_rate: peak learning rate (TRL's default 1e-6 is tuned for large pretrained students).
        trust_remote_code: passed to ``from_pretrained`` for both models.
        **kwargs: optimizer, scheduler and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: an option out of range, a teacher with another vocabulary, the student object as the teacher; at
            setup, a sequence (the longest row, or when sampling the longest prompt + ``max_new_tokens``) past the
            student's or the teacher's learned position table (warned for rotary positions).

    Example::

        module = DistillationModule("tiny-64", teacher_model="runs/sft/version_0/hf_model", lmbda=0.5, beta=0.5)
        trainer = lightning.Trainer(max_steps=300)
        trainer.fit(module, datamodule=SFTDataModule(tokenizer="tiny-64", dataset="builtin:addition", max_length=32))
    """

    RUN_NAME: ClassVar[str] = "distill"  # the run folder `lit-trainer fit` uses without --run_name

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        teacher_model: str | PreTrainedModel = "tiny",
        lmbda: float = 0.5,
        beta: float = 0.5,
        temperature: float = 0.9,
        max_new_tokens: int = 128,
        seq_kd: bool = False,
        rollout_engine: Literal["generate", "vllm"] = "generate",
        rollout_engine_options: dict[str, Any] | None = None,
        generation_seed: int | None = None,
        disable_dropout: bool = True,
        eval_exact_match: bool = False,
        eval_max_new_tokens: int = 16,
        learning_rate: float = 1e-6,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        # the base records this frame's arguments as hparams: keep a model object out (Lightning would deep-copy it)
        teacher, teacher_model = teacher_model, teacher_model if isinstance(teacher_model, str) else None
        super().__init__(model, learning_rate=learning_rate, trust_remote_code=trust_remote_code, **kwargs)
        for name, value in (("lmbda", lmbda), ("beta", beta)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`DistillationModule({name}={value})` is invalid: use a value in [0, 1].")
        if temperature <= 0 or max_new_tokens < 1 or eval_max_new_tokens < 1:
            raise ValueError(
                f"`DistillationModule(temperature={temperature}, max_new_tokens={max_new_tokens}, "
                f"eval_max_new_tokens={eval_max_new_tokens})` is invalid: the temperature must be > 0 and the token "
                "budgets >= 1."
            )
        if rollout_engine not in ("generate", "vllm"):
            raise ValueError(
                f"`DistillationModule(rollout_engine={rollout_engine!r})` is not an engine: use 'generate' or 'vllm'."
            )
        if rollout_engine == "vllm" and seq_kd:
            raise ValueError(
                "`DistillationModule(rollout_engine='vllm', seq_kd=True)`: with seq_kd the teacher samples too, and "
                "one vLLM engine holds one model. Use rollout_engine='generate' with seq_kd, or seq_kd=False."
            )
        if teacher is self.model:
            raise ValueError(
                "`DistillationModule(teacher_model=...)` is the student object itself: pass another model."
            )
        if disable_dropout:
            disable_dropout_in_model(self.model)
        self.teacher_model = self._load_teacher(teacher, trust_remote_code)
        disable_dropout_in_model(self.teacher_model)  # the teacher is in eval mode anyway
        self.val_metrics.add("loss", MeanMetric())
        self.val_metrics.add("exact_match", MeanMetric())
        self._seed = generation_seed
        # on-policy (and seq_kd) sampling: one generate call per micro-batch, plain temperature sampling
        options = SamplingOptions(
            max_completion_length=max_new_tokens, temperature=temperature, top_p=1.0, top_k=0, min_p=None,
            repetition_penalty=1.0,
        )  # fmt: skip
        engine = make_engine(False, None, None if rollout_engine == "generate" else "vllm", rollout_engine_options)
        self.rollouts = RolloutGenerator(engine, options, self.tokenizer)
        # the optimizer step's window in progress: (epoch, first batch index), and over its micro-batches so far and
        # all ranks (so the same on every rank, and in a checkpoint written inside the window) the tokens trained on
        # minus the dataset's tokens they replaced (0 for dataset micro-batches), and whether any micro-batch sampled
        self._window: tuple[int, int] | None = None
        self._window_extra: Tensor | float = 0.0
        self._window_sampled = False

    def _load_teacher(self, teacher: Any, trust_remote_code: bool) -> torch.nn.Module:
        teacher_tok = None
        if isinstance(teacher, str):
            teacher_tok = load_tokenizer(teacher, trust_remote_code=trust_remote_code)
            teacher = load_model(teacher, trust_remote_code=trust_remote_code)
        if not isinstance(teacher, torch.nn.Module) or _logits.output_head(teacher) is None:
            raise ValueError(
                f"`DistillationModule(teacher_model=...)` must be a causal LM (a preset, a path, a hub id or a "
                f"PreTrainedModel), got {type(teacher).__name__}."
            )
        problem = _vocabulary_problem(self.model, teacher, self.tokenizer, teacher_tok)
        if problem is not None:
            raise ValueError(
                f"The teacher does not share the student's vocabulary: {problem}. Distillation compares the two "
                "models' full next-token distributions token id by token id, so both must use the same tokenizer. "
                "Pick a teacher trained with the student's tokenizer (or a student with the teacher's)."
            )
        teacher.eval()
        return teacher.requires_grad_(False)

    # ------------------------------------------------------------------------------------------ teacher lifecycle
    @override
    def train(self, mode: bool = True) -> DistillationModule:
        """Set the student's mode; the teacher always stays in eval mode."""
        super().train(mode)
        self.teacher_model.eval()
        return self

    @override
    def networks_to_shard(self) -> list[torch.nn.Module]:
        return [self.model, self.teacher_model]

    @override
    def sequence_budget(self, longest_row: int, positions: int) -> tuple[int, str, str]:
        """The longest row, or when completions are sampled (``lmbda > 0`` or ``seq_kd``) the longest prompt plus
        ``max_new_tokens`` if that is longer (see :meth:`BaseModule.sequence_budget`)."""
        tokens, what, fix = super().sequence_budget(longest_row, positions)
        hp = self.hparams
        datamodule = getattr(self.trainer, "datamodule", None)
        prompt = datamodule.longest_prompt() if callable(getattr(datamodule, "longest_prompt", None)) else None
        if (hp.lmbda == 0 and not hp.seq_kd) or prompt is None or prompt + hp.max_new_tokens <= longest_row:
            return tokens, what, fix
        budget = prompt + hp.max_new_tokens
        what = f"the longest prompt ({prompt} tokens) + max_new_tokens={hp.max_new_tokens} = {budget} tokens (sampled)"
        room = positions - prompt
        fix = f"lower max_new_tokens to at most {room}, or" if room > 0 else "lower"
        return budget, what, f"{fix} the data module's `max_length`"

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)  # the student's positions (BaseModule.setup)
        datamodule = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and self.hparams.lmbda > 0:  # the student samples: e.g. vLLM's environment and length
            prompt = datamodule.longest_prompt() if callable(getattr(datamodule, "longest_prompt", None)) else None
            self.rollouts.engine.check_fit(type(self).__name__, prompt, self.hparams.max_new_tokens)
        longest = datamodule.longest_row() if callable(getattr(datamodule, "longest_row", None)) else None
        positions = _positions.max_positions(self.teacher_model)
        if stage == "fit" and longest is not None and positions is not None:  # the teacher scores the same rows
            tokens, what, fix = self.sequence_budget(longest, positions)
            _positions.check_positions(self.teacher_model, tokens, f"DistillationModule (teacher): {what}", fix)
        strategy = self.trainer.strategy
        if not _sharding.has_local_grads(strategy):
            raise ValueError(
                f"DistillationModule runs on one device, under DDP or under ModelParallelStrategy (FSDP2); "
                f"{type(strategy).__name__} is not supported: the step-end token correction rescales the gradients "
                "in `param.grad`, which it keeps elsewhere. Use strategy='ddp' or ModelParallelStrategy."
            )

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self._seed is None:
            self._seed = torch.initial_seed()

    @override
    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        self.rollouts.engine.close()  # a vLLM server stops with the fit

    @override
    def configure_callbacks(self) -> list[Callback]:
        """A vLLM engine is closed when fitting fails, too (:class:`~lit_trainer.generation.engines.CloseEngines`)."""
        return [*super().configure_callbacks(), *rollout.close_on_failure(self.rollouts.engine)]

    @override
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The module's state dict; once the teacher is sharded (``ModelParallelStrategy``) without the teacher: the
        strategy writes and reads its distributed checkpoints through this state dict, so they hold the student only,
        as the one-device and DDP ones (:meth:`on_save_checkpoint`)."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if _sharding.is_sharded(self.teacher_model):
            for name in [k for k in state if k.startswith(f"{prefix}teacher_model.")]:
                del state[name]
        return state

    @override
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, the live teacher's weights standing in for teacher keys the state dict
        lacks (checkpoints leave the teacher out), so a strict load of a checkpoint works; given teacher keys win."""
        missing = {
            f"teacher_model.{k}": v
            for k, v in self.teacher_model.state_dict().items()
            if f"teacher_model.{k}" not in state_dict
        }
        if missing:
            metadata = getattr(state_dict, "_metadata", None)
            state_dict = type(state_dict)({**state_dict, **missing}) if isinstance(state_dict, dict) else state_dict
            if metadata is not None:
                state_dict._metadata = metadata
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Leave the frozen teacher out of the checkpoint (it never changes) and keep the generation seed."""
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get("state_dict", {})
        for name in [k for k in state if k.startswith("teacher_model.")]:
            del state[name]
        # the window in progress: a checkpoint written inside it (a validation between two of its micro-batches)
        # resumes with the earlier micro-batches' token counts (ExactResume restores their gradients)
        extra = float(self._window_extra) if self._window is not None else 0.0
        window = None if self._window is None else [*self._window, extra, self._window_sampled]
        checkpoint[_STATE_KEY] = {"seed": self._seed, "window": window}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the generation seed and the window in progress (the teacher's weights, which checkpoints leave out,
        come from the live teacher in :meth:`load_state_dict`)."""
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(_STATE_KEY)
        if saved is not None and saved.get("seed") is not None:
            self._seed = int(saved["seed"])
        if saved is not None and saved.get("window") is not None:
            epoch, start, extra, sampled = saved["window"]
            self._window, self._window_extra, self._window_sampled = (
                (int(epoch), int(start)),
                float(extra),
                bool(sampled),
            )

    # -------------------------------------------------------------------------------------------- completions
    def on_policy_draw(self, epoch: int, batch_idx: int) -> bool:
        """Whether micro-batch ``batch_idx`` of ``epoch`` uses student-sampled completions: a uniform draw from a
        stream seeded by ``(generation_seed, epoch, batch_idx)`` below ``lmbda`` (no rank: every rank agrees; a resumed
        run draws the same)."""
        seed = torch.initial_seed() if self._seed is None else self._seed
        generator = torch.Generator().manual_seed(derive_seed(seed, _LMBDA_STREAM, epoch, batch_idx))
        return bool(torch.rand((), generator=generator) < self.hparams.lmbda)

    def sample_completions(self, model: Any, batch: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
        """Replace the batch's completions by ``model``'s samples for its prompts (the tokens before each row's first
        target token). Returns right-padded ``input_ids``/``attention_mask``/``labels`` rows (``-100`` on the prompt
        and padding), completions cut after their first EOS (kept)."""
        ids, labels = batch["input_ids"], batch["labels"]
        targets = labels != IGNORE_INDEX
        if not bool(targets.any(dim=1).all()):
            raise ValueError("A distillation row has no completion token: every row needs a prompt and a completion.")
        prompt_lengths = targets.int().argmax(dim=1).tolist()
        if min(prompt_lengths) == 0:
            raise ValueError(
                "On-policy distillation samples completions for the rows' prompts, but a row has no prompt (its "
                "first token is already a target): give prompt/completion rows (SFTDataModule with `prompt` and "
                "`completion` columns), or set lmbda=0 and seq_kd=False."
            )
        prompts = [row[:n].tolist() for row, n in zip(ids.cpu(), prompt_lengths)]
        eos = self.rollouts.eos_token_ids(self.model)
        pad = self._pad_token_id(eos)
        o = self.rollouts.options
        config = rollout.sampling_config(
            pad, eos, max_completion_length=o.max_completion_length, temperature=o.temperature, top_p=o.top_p,
            top_k=o.top_k, min_p=o.min_p, repetition_penalty=o.repetition_penalty,
        )  # fmt: skip
        prompt_ids = torch.stack([torch.tensor([pad] * (max(prompt_lengths) - len(p)) + p) for p in prompts])
        prompt_mask = torch.stack([torch.tensor([0] * (max(prompt_lengths) - len(p)) + [1] * len(p)) for p in prompts])
        completions = self.rollouts.generate(  # sharded: every forward is a collective, keep ranks in step
            model, prompt_ids.to(self.device), prompt_mask.to(self.device), config, eos, seed=seed,
            device=self.device, synced=_sharding.is_sharded(model),
        )  # fmt: skip
        return self.rows_with_completions(prompts, completions.ids, completions.mask, pad)

    def rows_with_completions(
        self, prompts: list[list[int]], completion_ids: Tensor, completion_mask: Tensor, pad_token_id: int
    ) -> dict[str, Tensor]:
        """Right-padded training rows ``prompt + completion`` (labels on the completion only), as the SFT collator
        builds them, on the module's device."""
        kept = [row[m.bool()].tolist() for row, m in zip(completion_ids.cpu(), completion_mask.cpu())]
        rows = [{"input_ids": p + c, "prompt_length": len(p)} for p, c in zip(prompts, kept)]
        return {k: v.to(self.device) for k, v in SFTCollator(pad_token_id)(rows).items()}

    def _pad_token_id(self, eos: list[int]) -> int:
        for pad in (getattr(self.tokenizer, "pad_token_id", None), self.model.generation_config.pad_token_id):
            if pad is not None:
                return int(pad[0] if isinstance(pad, (list, tuple)) else pad)
        return eos[0]

    def _training_rows(self, batch: dict[str, Any], batch_idx: int) -> tuple[dict[str, Tensor], str]:
        """The micro-batch's rows and where their completions come from (``student``, ``teacher`` or ``dataset``)."""
        epoch = self.trainer.current_epoch
        if self.hparams.lmbda > 0 and self.on_policy_draw(epoch, batch_idx):
            seed = derive_seed(self._seed, _SAMPLING_STREAM, epoch, batch_idx, self.global_rank)
            return self.sample_completions(self.model, batch, seed), "student"
        if self.hparams.seq_kd:
            seed = derive_seed(self._seed, _SAMPLING_STREAM, epoch, batch_idx, self.global_rank)
            return self.sample_completions(self.teacher_model, batch, seed), "teacher"
        return batch, "dataset"

    # ------------------------------------------------------------------------------------------------- training
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        new_window = self._enter_window(batch_idx)
        start, stop = self.step_window(batch_idx)
        if (self.trainer.current_epoch, start) != self._window:  # a checkpoint inside the window restores it
            self._window, self._window_extra, self._window_sampled = (self.trainer.current_epoch, start), 0.0, False
        num_items = self._global_num_items(batch.pop(NUM_ITEMS_KEY, None), new_window)
        dataset_labels = batch["labels"]
        rows, source = self._training_rows(batch, batch_idx)
        if source != "dataset":  # every rank samples the same micro-batches (the draw has no rank): one collective
            extra = (count_target_tokens(rows["labels"]) - count_target_tokens(dataset_labels)).float()
            if self.trainer.world_size > 1:
                extra = self.trainer.strategy.reduce(extra, reduce_op="sum")
            self._window_extra, self._window_sampled = self._window_extra + extra, True
        loss, metrics = self.compute_loss(rows, num_items)
        metrics["on_policy"] = torch.tensor(float(source == "student"), device=self.device)
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size
        contribution = loss if num_items is not None else loss / scale
        self._track(contribution.detach(), metrics, rows)
        step_ends = batch_idx + 1 == stop or self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if num_items is not None and step_ends and self._window_sampled:
            # the loader's count is the window's dataset tokens over ranks; the sampled micro-batches changed it by
            # the extra: exact = provisional + extra
            exact = num_items + torch.as_tensor(self._window_extra, device=num_items.device)
            self.rescale_step_gradients(num_items.clamp(min=1.0) / exact.clamp(min=1.0))
        return contribution * scale

    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``sum of per-token generalised JSD / num_items_in_batch`` (the local token mean when it is None)."""
        targets = _logits.next_token_targets(batch["labels"])
        total, count = self.divergence_sum(batch, targets)
        normaliser = count if num_items_in_batch is None else num_items_in_batch
        loss = total / torch.as_tensor(normaliser, device=total.device).clamp(min=1)
        return loss, {"completion_tokens": count.float()}

    def divergence_sum(self, batch: dict[str, Tensor], targets: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum over the scored positions of D_beta, their count)`` for rows ``batch`` and ``targets`` (``(B, T)``,
        ``-100`` = not scored): the teacher under ``no_grad``; full logits or, with ``chunked_logits``, from the
        hidden states a chunk at a time."""
        hp = self.hparams
        if "position_ids" in batch:
            raise ValueError(
                "DistillationModule does not take packed batches (rows flattened with `position_ids`): the teacher "
                "and the on-policy sampling need whole rows. Use SFTDataModule(packing='none')."
            )
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "use_cache": False}
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        setting = hp.get("chunked_logits", "auto")  # both heads must take the chunked path ("on" raises otherwise)
        if not (_logits.wants_chunked(self.model, setting) and _logits.wants_chunked(self.teacher_model, setting)):
            with torch.no_grad():
                teacher_logits = self.teacher_model(**inputs).logits
            student_logits = self.model(**inputs).logits
            options = {"beta": hp.beta, "temperature": hp.temperature, "reduction": "sum"}
            return generalized_jsd_loss(student_logits, teacher_logits, targets, **options), count
        with torch.no_grad():
            teacher_hidden = self._hidden_states(self.teacher_model, inputs)[valid]
            # the teacher's head is a DTensor shard outside its forward under FSDP2: gather it (no grad), as TRL does
            teacher_head = _logits.output_head(self.teacher_model)
            teacher_weight = _sharding.full(teacher_head.weight)
            teacher_bias = None if teacher_head.bias is None else _sharding.full(teacher_head.bias)
        student_head, result = _logits.output_head(self.model), {}

        def forward(hidden: Tensor) -> Tensor:
            # inside the student's own forward: under FSDP2 its head's weight is gathered here, and the gradient
            # reaches the sharded parameter through FSDP2's own backward (as the other modules' chunked path)
            result["per_token"] = chunked_token_divergence(
                hidden[valid], student_head.weight, teacher_hidden, teacher_weight,
                student_bias=student_head.bias, teacher_bias=teacher_bias, beta=hp.beta,
                temperature=hp.temperature, chunk_size=hp.get("logits_chunk_size"),
            )  # fmt: skip
            return hidden[..., :1]  # a 1-wide stand-in for the logits

        with _logits._head_forward(student_head, forward):
            self.model(**inputs)
        return result["per_token"].sum(), count

    @staticmethod
    def _hidden_states(model: Any, inputs: dict[str, Any]) -> Tensor:
        """The last hidden states the output head receives (the head returns a 1-wide stand-in: no logits)."""
        head, captured = _logits.output_head(model), {}

        def forward(hidden: Tensor) -> Tensor:
            captured["hidden"] = hidden
            return hidden[..., :1]

        with _logits._head_forward(head, forward):
            model(**inputs)
        return captured["hidden"]

    # ----------------------------------------------------------------------------------------------- validation
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        rows = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        total, count = self.divergence_sum(rows, _logits.next_token_targets(rows["labels"]))
        if count:
            self.val_metrics["loss"].update(total / count, weight=count)
        if self.hparams.eval_exact_match and "prompt_input_ids" in batch:
            matches = self._greedy_matches(batch)
            if matches.numel():
                self.val_metrics["exact_match"].update(matches.float())

    def _greedy_matches(self, batch: dict[str, Any]) -> Tensor:
        eos = rollout.eos_token_ids(self.model, self.tokenizer)
        return greedy_batch_matches(
            self.model, batch, max_new_tokens=self.hparams.eval_max_new_tokens, pad_token_id=self._pad_token_id(eos),
            eos_token_id=eos, synced_gpus=_sharding.is_sharded(self.model),
        )  # fmt: skip
