"""The rollout mixin of :class:`~lit_trainer.modules.online_rl.OnlineRLModule` (GRPO's and RLOO's rounds): the
shared steps of one generation round (sample with a seeded RNG, score with the reward functions gathered over ranks,
compute log-probs in chunks, shuffle and buffer the round's micro-batches; each module's ``_make_rollouts`` puts them
together with its advantages), and the generation padding id validation uses too. The small
stateless pieces are in :mod:`lit_trainer.generation.engines`, the sampling options and engine in
:class:`~lit_trainer.generation.RolloutGenerator` (``self.rollouts``); the buffer is
:class:`~lit_trainer.modules.grpo._rollout_buffer.RolloutBuffer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_trainer.core import sharding as _sharding
from lit_trainer.core.dist import gather_from_all_ranks
from lit_trainer.core.stop_request import stop_check, stop_in_step
from lit_trainer.data.chat import render
from lit_trainer.data.prompt import PROMPT_IDS, PROMPT_MASK, PROMPTS
from lit_trainer.data.samplers.repeat_sampler import needs_old_logps
from lit_trainer.data.vision import prompt as vision_prompt
from lit_trainer.generation import engines as rollout
from lit_trainer.generation.agentic import AgenticRound, agentic_batch
from lit_trainer.modules.grpo._completion_table import render_text
from lit_trainer.modules.grpo._reward_calls import score_completions
from lit_trainer.modules.grpo._rollout_buffer import ATTENTION
from lit_trainer.rewards import is_conversational


class GRPORolloutMixin:
    """Generation rounds of :class:`~lit_trainer.modules.online_rl.OnlineRLModule` (reads ``self._buffer``,
    ``self._seed``, ``self.rollout_geometry``, ``self.ref_model``, ``self.reward_names`` and the hyperparameters;
    calls ``self.completion_logps`` and ``self._prompt_rows``)."""

    def _gather_rows(self, local: Tensor) -> Tensor:
        """Rows of every rank, rank order (the reference gathers rewards before normalising)."""
        if self.trainer.world_size == 1:
            return local
        return self.all_gather(local).reshape(-1, *local.shape[1:])

    def _sampling_config(self, eos: list[int]) -> Any:
        """The ``GenerationConfig`` of the training rollouts (and of a sampled validation): ``self.rollouts``'s."""
        return self.rollouts.sampling_config(self.model, eos)

    def _image_token_ids(self) -> list[int]:
        """A vision-language policy's image token id, never sampled; empty for a text model."""
        return self.rollouts.image_token_ids(self.model)

    def _prompt_inputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and mask for ``generate``: the data module's, or, for conversational prompts with
        ``chat_template_kwargs``, the prompts rendered again with them (TRL 1.16 renders its prompts with
        ``GRPOConfig.chat_template_kwargs``; the data module does not know the module's options)."""
        options = self.hparams.chat_template_kwargs
        if not options or not is_conversational(batch[PROMPTS]):
            return batch[PROMPT_IDS], batch[PROMPT_MASK]
        rows = self._prompt_rows(
            [render(self.tokenizer, p, add_generation_prompt=True, **options) for p in batch[PROMPTS]]
        )
        return rows["prompt_ids"], rows["prompt_mask"]

    def _stores_old_logps(self) -> bool:
        """Whether a round keeps its generation-time log-probs (used across optimizer steps); read per round, since a
        ``GradientAccumulationScheduler`` may change ``accumulate_grad_batches`` at an epoch start."""
        return needs_old_logps(
            self.trainer.accumulate_grad_batches,
            self.rollout_geometry.steps_per_generation,
            self.hparams.num_iterations,
        )

    def _generate_rows(self, batch: dict[str, Any], can_stop: bool) -> tuple:
        """Sample this rank's rows of one round in this process (:meth:`_sample_round`), seeded by round and rank;
        ``can_stop``: a stop request may cut the generation short, and the run then stops here."""
        seed = rollout.rollout_seed(self._seed, self._buffer.next_round_index, self.global_rank)
        should_stop = stop_check(self.trainer) if can_stop else None
        sampled = self._sample_round(batch, seed, should_stop)
        if should_stop is not None:
            stop_in_step(self.trainer)  # raises when the run stops here; the partial round is dropped
        return sampled

    def _sample_round(self, batch: dict[str, Any], seed: int, should_stop: Any = None) -> tuple:
        """Sample one round's rows on the RNG seeded with ``seed``: tools, environments and ``rollout_func``, or the
        engine (``generate`` or continuous batching). With ``mask_truncated_completions`` truncated completions leave
        the completion mask here, before any log-prob. Returns ``(rows, completions, the batch the reward functions
        read, the decoded agentic texts or None, tool metrics)``.

        The rollout worker process runs this same method on its copy of the policy
        (:mod:`lit_trainer.modules.grpo._async`), so a round is the same computation in either process."""
        hp = self.hparams
        prompt_ids, prompt_mask = self._prompt_inputs(batch)
        eos = rollout.eos_token_ids(self.model, self.tokenizer)
        config = self._sampling_config(eos)
        custom = self.agentic or self.rollout_func is not None
        images = {k: batch[k] for k in vision_prompt.row_image_keys(batch)}  # per row (refused with custom rounds)
        with rollout.seeded_rng(seed, self.device):
            if self.rollout_func is not None:
                agentic = self._custom_round(batch, eos, config.pad_token_id)
            elif self.agentic:
                agentic = self._tool_round(batch, config, eos, should_stop)
            else:
                completions = self.rollouts.generate(
                    self.model,
                    prompt_ids,
                    prompt_mask,
                    config,
                    eos,
                    synced=_sharding.is_sharded(self.model),
                    should_stop=should_stop,
                    images=vision_prompt.model_image_inputs(images),
                )
        if custom:
            rows, completions = agentic.rows, agentic.completions
            scoring = (agentic_batch(batch, agentic), (agentic.texts, agentic.kept, agentic.reward_kwargs))
            tool_metrics = agentic.tool_metrics
        else:
            rows = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completions.ids}
            rows["completion_mask"] = completions.mask
            rows.update(images)  # the image inputs follow their rows through the buffer's shuffle
            scoring, tool_metrics = (batch, None), {}
        if hp.mask_truncated_completions:
            kept = (~completions.truncated).unsqueeze(1).to(rows["completion_mask"])  # its dtype and device
            rows["completion_mask"] = rows["completion_mask"] * kept
        return rows, completions, scoring[0], scoring[1], tool_metrics

    def _buffer_round(self, rows: dict[str, Tensor], metrics: dict[str, Tensor]) -> None:
        """Shuffle the round's rows with a seeded generator, split them into micro-batches and buffer them with each
        micro-batch's completion-token count summed over ranks."""
        seed, round_index = self._seed, self._buffer.next_round_index
        shuffler = torch.Generator().manual_seed(rollout.rollout_seed(seed, round_index, self.global_rank, stream=1))
        slices = self._buffer.shuffle(rows, shuffler)
        tokens = torch.stack([s["completion_mask"].sum() for s in slices]).float()
        if self.trainer.world_size > 1:
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        self._buffer.fill(slices, tokens, metrics)

    def _gathered_scores(
        self, batch: dict[str, Any], completions: rollout.Completions, decoded: tuple | None, extra: Sequence = ()
    ) -> tuple[Tensor, int, list[Any], dict[str, Tensor]]:
        """Score this rank's rows and gather them over ranks: ``(table, number of reward functions, this rank's
        texts, the reward calls' logged metrics)``. The table's columns are the rewards (NaN = unscored), the
        completion length (``completions.mask``, the model's tokens), truncated (0/1), then ``extra`` ((rows, k)
        tensors of this rank), rank order.

        ``decoded``: ``(texts, kept ids, extra reward keywords)`` of an agentic round (else decoded here)."""
        if decoded is None:
            texts, kept = rollout.decode_completions(self.tokenizer, completions, is_conversational(batch[PROMPTS]))
            keywords = None
        else:
            texts, kept, keywords = decoded
        rewards, logged = score_completions(self, batch, texts, kept, keywords)
        lengths = completions.mask.sum(1, keepdim=True).float().to(self.device)
        truncated = completions.truncated.float().unsqueeze(1).to(self.device)
        table = self._gather_rows(torch.cat([rewards.to(self.device), lengths, truncated, *extra], dim=1))
        functions = rewards.shape[1]
        if torch.isnan(table[:, :functions]).all(dim=1).any():
            rank_zero_warn(
                "[lit_trainer] Every reward function returned None for some completions: their advantage is 0."
            )
        return table, functions, texts, logged

    def _record_completions(self, prompts: Sequence[Any], texts: Sequence[Any], rewards: Tensor, adv: Tensor) -> None:
        """Keep the round's table (rows of every rank, on rank 0) for ``log_completions``: prompt, completion, one
        column per reward function (NaN = unscored), advantage."""
        pairs = gather_from_all_ranks([(render_text(p), render_text(t)) for p, t in zip(prompts, texts)])
        if not self.trainer.is_global_zero:
            return
        pairs = [pair for rank in pairs for pair in rank]
        columns = ["prompt", "completion", *self.reward_names, "advantage"]
        values = torch.cat([rewards, adv.reshape(-1, 1).to(rewards)], dim=1).cpu().tolist()
        self.completion_table = (columns, [[p, c, *v] for (p, c), v in zip(pairs, values)])

    def _pad_token_id(self, eos: list[int]) -> int:
        """Padding id for generation (:meth:`~lit_trainer.generation.RolloutGenerator.pad_token_id`)."""
        return self.rollouts.pad_token_id(self.model, eos)

    def _reduce(self) -> Any:
        """``tensor -> its sum over ranks`` for the agentic rounds, None on one process."""
        if self.trainer.world_size == 1:
            return None
        return lambda t: self.trainer.strategy.reduce(t, reduce_op="sum")

    def _tool_round(self, batch: dict[str, Any], config: Any, eos: list[int], should_stop: Any = None) -> AgenticRound:
        """A tools / environments round of ``self.rollouts``
        (:meth:`~lit_trainer.generation.RolloutGenerator.tool_round`)."""
        hp = self.hparams
        return self.rollouts.tool_round(
            self.model, batch, config, eos, tools=list(self.tools), environments=self.environments,
            chat_template_kwargs=hp.chat_template_kwargs, max_tool_calling_iterations=hp.max_tool_calling_iterations,
            device=self.device, reduce=self._reduce(), owner=type(self).__name__, should_stop=should_stop,
        )  # fmt: skip

    def _custom_round(self, batch: dict[str, Any], eos: list[int], pad: int) -> AgenticRound:
        """A ``rollout_func`` round (:meth:`~lit_trainer.generation.RolloutGenerator.custom_round`); the function gets
        the module as its second argument."""
        return self.rollouts.custom_round(
            self.rollout_func, self, batch, eos, pad, tools=list(self.tools), device=self.device
        )

    def _prompt_rows(self, prompt_ids: list[list[int]]) -> dict[str, Tensor]:
        return self.rollouts.prompt_rows(prompt_ids, self.device)

    def _chunked_logps(self, model: Any, rows: dict[str, Tensor]) -> Tensor:
        """Log-probs of the whole generation batch in chunks of one micro-batch (no grad)."""
        size = max(1, rows["prompt_ids"].shape[0] // self.rollout_geometry.steps_per_generation)
        keys = [k for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", ATTENTION) if k in rows]
        keys += vision_prompt.row_image_keys(rows)
        chunks = [
            self.completion_logps(model, {k: rows[k][i : i + size] for k in keys})[0]
            for i in range(0, rows["prompt_ids"].shape[0], size)
        ]
        return torch.cat(chunks)
