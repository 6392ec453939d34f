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

from lit_trainer.core.dist import gather_from_all_ranks
from lit_trainer.core.stop_request import stop_check, stop_in_step
from lit_trainer.data.prompt import PROMPTS
from lit_trainer.data.samplers.repeat_sampler import needs_old_logps
from lit_trainer.generation import Round
from lit_trainer.generation import engines as rollout
from lit_trainer.generation.agentic import AgenticRound
from lit_trainer.modules.grpo._completion_table import render_text
from lit_trainer.modules.grpo._logps import chunked_logps
from lit_trainer.modules.grpo._reward_calls import score_completions
from lit_trainer.rewards import is_conversational


class GRPORolloutMixin:
    """Generation rounds of :class:`~lit_trainer.modules.online_rl.OnlineRLModule` (reads ``self._buffer``,
    ``self._seed``, ``self.rollout_geometry``, ``self.ref_model``, ``self.reward_names`` and the hyperparameters;
    calls ``self.completion_logps`` and ``self.rollouts``)."""

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
        """Left-padded prompt ids and mask for ``generate``, rendered again with ``chat_template_kwargs``
        (:meth:`~lit_trainer.generation.RolloutGenerator.prompt_inputs`)."""
        return self.rollouts.prompt_inputs(batch, self.device)

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

    def _sample_round(self, batch: dict[str, Any], seed: int, should_stop: Any = None) -> Round:
        """Sample one round's rows on the RNG seeded with ``seed``: ``self.rollouts``'s
        :meth:`~lit_trainer.generation.RolloutGenerator.sample_round` with this module's tools, environments and
        ``rollout_func`` (which gets the module as its second argument). The rollout worker process runs the same
        method of its own generator on its copy of the policy (:mod:`lit_trainer.modules.grpo._async`), so a round is
        the same computation in either process."""
        return self.rollouts.sample_round(
            self.model, batch, seed, device=self.device, tools=self.tools, environments=self.environments,
            rollout_func=self.rollout_func, caller=self, reduce=self._reduce(), owner=type(self).__name__,
            should_stop=should_stop,
        )  # fmt: skip

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
        options = self.rollouts.options
        return self.rollouts.tool_round(
            self.model, batch, config, eos, tools=list(self.tools), environments=self.environments,
            chat_template_kwargs=options.chat_template_kwargs,
            max_tool_calling_iterations=options.max_tool_calling_iterations,
            device=self.device, reduce=self._reduce(), owner=type(self).__name__, should_stop=should_stop,
        )  # fmt: skip

    def _chunked_logps(self, model: Any, rows: dict[str, Tensor]) -> Tensor:
        """Log-probs of the whole generation batch in chunks of one micro-batch (no grad)."""
        size = max(1, rows["prompt_ids"].shape[0] // self.rollout_geometry.steps_per_generation)
        return chunked_logps(lambda m, r: self.completion_logps(m, r)[0], model, rows, size)
