"""Asynchronous GRPO rollouts: a worker process generates the next rounds while the trainer trains on this one.

With ``GRPOModule(max_staleness=k)`` each rank starts one rollout worker (a process forked from a ``forkserver``,
:func:`worker_context`, with its own copy of the policy, on ``rollout_worker_device``) when fitting starts. Rounds
keep the synchronous module's meaning (round ``q`` samples the prompts the loader gives at its first micro-step, with
the seed of ``(generation_seed, q, rank)``); only the weights that sample it change:

* **Versions.** The weights at the start of round ``r`` are version ``r``. Round ``q`` is sampled by version
  ``max(q - k, first)`` (``first``: the first round of this fit), so no round is ever more than ``k`` rounds stale and
  the worker waits for the weights it needs: nothing is dropped and the run does not depend on timing. ``k = 0`` is
  the synchronous run, computed in the worker: the same code on the same weights with the same seed (bit-exact on
  CPU). With the default ``steps_per_generation = accumulate_grad_batches`` a round is one optimizer step, so ``k``
  counts optimizer steps as TRL's ``max_staleness`` counts weight versions.
* **Flow, at the start of round r** (:meth:`AsyncRolloutMixin._async_rows`): publish the trainable weights as version
  ``r`` (LoRA: the adapters only) into shared memory, send the worker the rounds up to ``r + k`` it does not have yet
  (future prompts are read ahead from the loader, :meth:`~lit_trainer.data.loader.TrainLoader.peek`), then take round
  ``r``'s rows: prompts, completions and the worker's log-probs of them (the behaviour log-probs, computed with the
  trainer's own chunked forward). A round whose prompts are not the batch the loader actually gave (the read-ahead
  guessed wrong) is dropped and generated here, synchronously (``async/resampled_rounds``).
* **Weights** travel through :class:`~lit_trainer.modules.grpo._async._worker.SharedWeights`: ``k + 1`` slots in shared
  CPU memory, version ``v`` in slot ``v % (k + 1)``; a slot is overwritten only when the round that read it is already
  trained, so neither side waits for the other to copy.
* **Scoring** stays in the trainer (reward functions and models, gathered over ranks as in a synchronous round), as
  do the old log-probs, the importance-sampling correction of stale rounds and the sampler check (:mod:`.__init__`'s
  :meth:`AsyncRolloutMixin._off_policy_terms`).
* **Resume.** Rounds in flight are not checkpointed: a resumed run regenerates them from their seeds with the resumed
  weights (with ``k = 0`` that is exactly the uninterrupted run; with ``k > 0`` the first ``k`` rounds after a resume
  are fresher than they would have been).
* **Death.** A worker that dies without reporting an error (killed by a signal, e.g. SIGKILL) is noticed while the
  trainer waits for its round, at the start of an optimizer step: a ``JITCheckpoint`` among the callbacks saves the
  last finished step and the run stops with one line naming the worker, its signal or exit code and the round
  (:class:`~lit_trainer.callbacks.JITCheckpointFailure`); ``--ckpt_path last`` continues with a new worker.
* **Shutdown.** The worker is stopped when fitting ends or fails (``on_exception``, Ctrl-C, a signal); it ignores
  Ctrl-C and SIGTERM itself (a scheduler that signals every process of a job must reach the trainer's
  ``JITCheckpoint`` first) and exits on its own as soon as the training process dies, in any phase of a round.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lit_trainer.core import sharding as _sharding
from lit_trainer.core.stop_request import stop_check, stop_for_failure, stop_in_step
from lit_trainer.data.bad_rows import BadRowError
from lit_trainer.data.prompt import PROMPT_IDS, PROMPTS
from lit_trainer.generation import engines as rollout
from lit_trainer.losses.grpo_masks import sampling_importance_ratio, sampling_metrics
from lit_trainer.modules.grpo._async._errors import WorkerDied, death_message, failure_message
from lit_trainer.modules.grpo._async._worker import Deferred, RoundRequest, SharedWeights, WorkerSpec, worker_main
from lit_trainer.modules.online_rl._logps import CompletionScorer
from lit_trainer.modules.online_rl._rollout_buffer import SAMPLING_LOGPS

#: seconds the worker gets to finish its request and exit when fitting ends, before it is terminated
CLOSE_SECONDS = 5.0


def worker_context() -> Any:
    """The ``forkserver`` multiprocessing context, its server preloading the worker's imports.

    A worker is forked from a server process that has imported torch, transformers and the sampling code once (and
    never touched CUDA or started threads), so only the first worker of a training process pays the imports (about
    10 s on a small CPU machine); ``spawn`` would pay them for every fit. As with ``spawn``, the script that starts
    training is imported again by the child: keep its top-level code under ``if __name__ == "__main__":``.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        [
            "lit_trainer.modules.grpo._async._server_signals",  # first: the server ignores SIGTERM from here on
            "lit_trainer.modules.grpo._async._worker",
            "lit_trainer.modules.grpo",
        ]
    )
    return context


class RolloutWorker:
    """The training process's handle on one rollout worker process.

    Args:
        spec: what the worker builds its rollout generator from.
        weights: the shared weight slots (also held by the worker).
    """

    def __init__(self, spec: WorkerSpec, weights: SharedWeights) -> None:
        context = worker_context()
        self.weights = weights
        self.requests = context.Queue()
        self.results = context.Queue()
        args = (Deferred(spec), self.requests, self.results, weights)  # the spec unpickles where errors are reported
        self.process = context.Process(target=worker_main, args=args, daemon=True, name="lit-rollouts")
        self.process.start()
        self.pending: dict[int, RoundRequest] = {}  # submitted, not yet received
        self.ready: dict[int, Any] = {}  # received ahead of their turn

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def submit(self, request: RoundRequest) -> None:
        self.pending[request.round_index] = request
        self.requests.put(request)

    def receive(self, round_index: int, should_stop: Any = None) -> tuple[RoundRequest, dict[str, Any]] | None:
        """Round ``round_index``'s request and result (blocking); None when ``should_stop`` turned True while
        waiting.

        Raises:
            RuntimeError: the worker failed to start or failed on a round (the cause first, then its traceback).
            WorkerDied: (a ``RuntimeError``) the worker died without saying why; the message, one line, says how
                (:func:`~lit_trainer.modules.grpo._async._errors.death_message`).
        """
        while round_index not in self.ready:
            if should_stop is not None and should_stop():
                return None
            try:
                index, status, payload = self.results.get(timeout=0.2)
            except queue.Empty:
                if self.process.is_alive():
                    continue
                try:  # what it put just before it exited may have arrived since
                    index, status, payload = self.results.get(timeout=1.0)
                except queue.Empty:
                    raise WorkerDied(death_message(self.pid, self.process.exitcode, round_index)) from None
            if status == "error":
                raise RuntimeError(failure_message(self.pid, index, payload))
            if status == "ok":
                self.ready[index] = payload
        return self.pending.pop(round_index), self.ready.pop(round_index)

    def close(self) -> None:
        """Ask the worker to stop, then terminate it if it does not within :data:`CLOSE_SECONDS`."""
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.requests.put(None)
            self.process.join(CLOSE_SECONDS)
            if self.process.is_alive():
                self.process.kill()  # the worker ignores SIGTERM (_server_signals)
                self.process.join(CLOSE_SECONDS)
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()


class _StopWorker(Callback):
    """Stops the module's rollout worker when fitting fails (Lightning calls no module hook on an exception)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.module._close_worker()


def strip_hooks(model: torch.nn.Module) -> torch.nn.Module:
    """Drop forward/backward hooks from a copy of the policy (training-time hooks such as NEFTune's or gradient
    checkpointing's are not needed to sample, and often cannot be pickled to the worker)."""
    for module in model.modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, hooks, None):
                getattr(module, hooks).clear()
        for extra in ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            if getattr(module, extra, None):
                getattr(module, extra).clear()
    return model


class AsyncRolloutMixin:
    """The trainer side of asynchronous rollouts for :class:`~lit_trainer.modules.grpo.GRPOModule` (module
    docstring). Reads ``self.hparams.max_staleness`` and the ``rollout_*`` options."""

    _worker: RolloutWorker | None = None
    _async_first: int | None = None
    _check_warned: bool = False

    @property
    def is_async(self) -> bool:
        return self.hparams.get("max_staleness") is not None

    def configure_callbacks(self) -> list[Callback]:
        return [_StopWorker(self)] if self.is_async else []

    def _check_async(self) -> None:
        """Refuse what the worker cannot do, with the fix (called at setup)."""
        if not self.is_async:
            return
        why = None
        if self.rollout_func is not None:
            why = "a rollout_func runs in the training process (it receives the module)"
        elif self.is_quantized:
            why = "the policy is quantized and the worker cannot copy it"
        if why:
            raise ValueError(
                f"{type(self).__name__}(max_staleness={self.hparams.max_staleness}): {why}. Use max_staleness=None "
                "(synchronous rollouts), or an unquantized policy without rollout_func."
            )

    def _trainable(self) -> dict[str, Tensor]:
        """The parameters the worker is sent every round (FSDP2 shards stay ``DTensor``: gathered one at a time)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    _worker_model: tuple[torch.nn.Module, ...] = ()  # in a tuple: an attribute holding a Module would register it

    def configure_model(self) -> None:
        """Before FSDP2 shards the policy, keep a hook-free CPU copy of it for this rank's worker (a sharded model
        cannot be copied whole); the first published version brings it up to date after a checkpoint restore."""
        if self.is_async and self.device_mesh is not None and not _sharding.is_sharded(self.model):
            self._worker_model = (strip_hooks(copy.deepcopy(self.model)).to("cpu"),)
        super().configure_model()

    def _start_worker(self) -> None:
        """Start this rank's worker with a hook-free CPU copy of the policy (called when fitting starts)."""
        if not self.is_async or self._worker is not None:
            return
        hp = self.hparams
        device = hp.rollout_worker_device or str(self.device)
        if device == "cuda" and self.device.type == "cuda":
            device = str(self.device)
        copies, self._worker_model = self._worker_model, ()
        model = copies[0] if copies else strip_hooks(copy.deepcopy(self.model)).to("cpu")
        model.requires_grad_(False)
        spec = self._worker_spec(model, device)
        trainable = self._trainable()
        weights = SharedWeights({n: p.detach() for n, p in trainable.items()}, slots=hp.max_staleness + 1)
        # (a DTensor's shape and dtype are the full parameter's)
        self._worker = RolloutWorker(spec, weights)
        self._async_first = None

    def _worker_spec(self, model: torch.nn.Module, device: str) -> WorkerSpec:
        """What this rank's worker builds its rollout generator from: ``model`` (its copy of the policy), the
        module's sampling options, engine choice, tools, environments and :meth:`behaviour_scorer`."""
        hp = self.hparams
        forward = [n for n in ("completion_logps", "score_tokens") if _overrides(type(self), n)]
        if forward and not _overrides(type(self), "behaviour_scorer"):
            rank_zero_warn(
                f"[lit_trainer] {type(self).__name__} overrides {' and '.join(forward)} but not behaviour_scorer: "
                "the rollout worker scores its rounds with the default forward, and the sampler check will see the "
                "gap. Override behaviour_scorer to return a picklable (model, rows) -> log-probs running your forward."
            )
        return WorkerSpec(
            model=model,
            tokenizer=self.tokenizer,
            options=self.rollouts.options,
            continuous_batching=self.continuous_batching,
            continuous_batching_config=hp.transformers_continuous_batching_config,
            engine=hp.rollout_engine,
            tools=list(self.tools),
            environments=self.environments,
            scorer=self.behaviour_scorer(),
            group=hp.num_generations,
            steps_per_generation=self.rollout_geometry.steps_per_generation,
            owner=type(self).__name__,
            device=device,
            threads=hp.rollout_worker_threads or torch.get_num_threads(),
        )

    def behaviour_scorer(self) -> Callable[[Any, dict[str, Tensor]], Tensor]:
        """The forward the rollout worker runs for the behaviour log-probs of its rounds: ``scorer(model, rows)`` ->
        ``(B, C)`` per-token log-probs of the rows' completion tokens, as ``completion_logps(model, rows)[0]``
        computes them in the trainer (the sampler check compares the two). It is pickled to the worker process, so it
        must be picklable and its class importable there (a top-level class or function, not a lambda or a class
        defined in a notebook). Override it together with ``completion_logps`` (or ``score_tokens``); the default is
        :func:`~lit_trainer.modules.online_rl._logps.completion_logps` with the temperature and the ``chunked_logits``
        options, as this module runs it."""
        hp = self.hparams
        return CompletionScorer(hp.temperature, hp.get("chunked_logits", "auto"), hp.get("logits_chunk_size"))

    def _close_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def teardown(self, stage: str) -> None:
        self._close_worker()
        super().teardown(stage)

    # ------------------------------------------------------------------------------------------------ rounds
    def _round_starts(self, epoch: int, batch_idx: int, count: int) -> Iterator[tuple[int, int]]:
        """``(epoch, batch index)`` of the first micro-step of the next ``count`` rounds after the one at
        ``(epoch, batch_idx)`` (rounds restart at every epoch), stopping at ``max_epochs``."""
        length = self._buffer.round_length
        per_epoch = int(self.trainer.num_training_batches)
        max_epochs = self.trainer.max_epochs
        for _ in range(count):
            batch_idx += length
            if batch_idx >= per_epoch:
                epoch, batch_idx = epoch + 1, 0
                if max_epochs is not None and max_epochs >= 0 and epoch >= max_epochs:
                    return
            yield epoch, batch_idx

    def _version_of(self, round_index: int) -> int:
        return max(round_index - self.hparams.max_staleness, self._async_first)

    def _request(self, round_index: int, batch: dict[str, Any]) -> RoundRequest:
        seed = rollout.rollout_seed(self._seed, round_index, self.global_rank)
        batch = move_data_to_device(batch, "cpu")
        return RoundRequest(round_index, self._version_of(round_index), batch, seed, self.model.training)

    def _async_rows(self, batch: dict[str, Any], can_stop: bool, position: tuple[int, int]) -> tuple:
        """Round ``r``'s rows from the worker (module docstring): ``(rows, completions, scoring batch, decoded, tool
        metrics, behaviour log-probs, staleness in rounds)``; a stop request while waiting stops the run here."""
        worker, r = self._worker, self._buffer.next_round_index
        if self._async_first is None:
            self._async_first = r
        worker.weights.publish(r, self._trainable())
        if r not in worker.pending and r not in worker.ready:
            worker.submit(self._request(r, batch))
        loader = self.trainer.train_dataloader
        peek = getattr(loader, "peek", None)
        ahead = list(self._round_starts(*position, self.hparams.max_staleness)) if peek is not None else []
        for offset, (epoch, index) in enumerate(ahead, start=1):
            q = r + offset
            if q in worker.pending or q in worker.ready:
                continue
            try:
                future = peek(epoch, index)
            except BadRowError:  # a bad row ahead: stop reading ahead, the loader stops the run when it gets there
                break
            if future is None:
                break
            worker.submit(self._request(q, future))
        started = time.perf_counter()
        should_stop = stop_check(self.trainer) if can_stop else None
        try:
            received = worker.receive(r, should_stop)
            if received is None:  # a stop request came while waiting: the run stops here (the round is dropped)
                stop_in_step(self.trainer)
                received = worker.receive(r)  # the stop was not due on every rank: keep waiting
        except WorkerDied as died:
            if can_stop:  # nothing of this optimizer step is applied: the last finished one is saved, then stop
                stop_for_failure(self.trainer, str(died))
            raise
        waited = time.perf_counter() - started
        request, result = received
        resampled = not _same_prompts(request.batch, batch)
        if resampled:  # the read-ahead guessed another batch: generate this round here, on the current weights
            rows, completions, scoring, decoded, tool_metrics = self._generate_rows(batch, can_stop)
            behaviour, staleness = None, 0
        else:
            rows, completions, scoring, decoded, tool_metrics = (
                _to_device(result[k], self.device) for k in ("rows", "completions", "batch", "decoded", "tool_metrics")
            )
            scoring = {**batch, **{k: v for k, v in scoring.items() if k in (PROMPTS, PROMPT_IDS)}}
            behaviour = _to_device(result["sampling_logps"], self.device)
            staleness = r - int(result["version"])
        metrics = {
            "async/staleness": torch.tensor(float(staleness), device=self.device),
            "async/wait_seconds": torch.tensor(waited, device=self.device),
            "async/resampled_rounds": torch.tensor(float(resampled), device=self.device),
        }
        return rows, completions, scoring, decoded, {**tool_metrics, **metrics}, behaviour, staleness

    # ----------------------------------------------------------------------------------- off-policy terms
    def _off_policy_terms(
        self, rows: dict[str, Tensor], behaviour: Tensor, staleness: int, metrics: dict[str, Tensor]
    ) -> None:
        """Old log-probs, the importance-sampling correction and the sampler check of a worker round (in place).

        * ``old_logps`` (the trainer's log-probs at the start of the round) are stored when the synchronous rule
          needs them (the round spans optimizer steps); otherwise every micro-step of the round runs on the round's
          starting weights, so its own log-probs (detached) are the old ones, as in a synchronous round;
        * the correction (``rollout_importance_sampling_*``, TRL's ``vllm_importance_sampling_*`` computation) applies
          to a stale round, or to every round of an engine whose numerics are not the trainer's: the round keeps the
          behaviour log-probs (``sampling_logps``) and :meth:`compute_loss` multiplies the policy loss by the
          truncated or masked ratio ``exp(old - behaviour)``. Computed there, it needs no extra forward pass;
        * the sampler check (:meth:`_sampler_check`).
        """
        hp = self.hparams
        correct = hp.rollout_importance_sampling_correction and (staleness > 0 or not self.engine.same_numerics)
        if self._stores_old_logps():
            rows["old_logps"] = self._chunked_logps(self.model, rows)
        if correct:
            rows[SAMPLING_LOGPS] = behaviour
        if hp.sampler_check_threshold is not None:
            metrics.update(self._sampler_check(rows, behaviour, staleness))

    def _importance_ratio(
        self, batch: dict[str, Tensor], logps: Tensor, old: Tensor | None
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """The correction of one buffered micro-batch of a corrected round (None for other rounds) and TRL's
        ``sampling/...`` metrics: the ratio of the round's starting log-probs (``old``, else this step's own, detached:
        the same weights) to the worker's."""
        behaviour = batch.get(SAMPLING_LOGPS)
        if behaviour is None:
            return None, {}
        hp, mask = self.hparams, batch["completion_mask"]
        start = logps.detach() if old is None else old
        mode = hp.rollout_importance_sampling_mode
        ratio = sampling_importance_ratio(
            start, behaviour, mask, mode=mode,
            clip_min=hp.rollout_importance_sampling_clip_min, clip_max=hp.rollout_importance_sampling_clip_max,
        )  # fmt: skip
        return ratio, sampling_metrics(start, behaviour, mask, ratio, mode)

    def _sampler_check(self, rows: dict[str, Tensor], behaviour: Tensor, staleness: int) -> dict[str, Tensor]:
        """Compare the worker's log-probs with the trainer's for the weights version that sampled the round, on its
        first ``num_generations`` rows (the worker's first chunk, the same shapes: on the same weights the gap is 0,
        up to float32 rounding): a failed sync shows on any rows, and a few keep the extra forward pass small. For a
        stale round the trainer loads that version's weights for the pass. Logs ``sampler_check/logp_gap_mean|max``
        and warns once above ``sampler_check_threshold``."""
        size = self.hparams.num_generations
        first = {k: v[:size] for k, v in rows.items() if isinstance(v, Tensor) and v.dim() >= 1}
        if staleness == 0:
            mine = self.completion_logps(self.model, first)[0]
        else:
            version = self._buffer.next_round_index - staleness
            with self._weights_of(version):
                mine = self.completion_logps(self.model, first)[0]
        mask = first["completion_mask"].bool()
        gap = (mine - behaviour[:size]).abs()[mask]
        stats = torch.stack([gap.sum(), torch.tensor(float(gap.numel()), device=gap.device)])
        largest = gap.max() if gap.numel() else torch.zeros((), device=gap.device)
        if self.trainer.world_size > 1:
            stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
            largest = self.all_gather(largest).max()
        mean = stats[0] / stats[1].clamp(min=1.0)
        threshold = self.hparams.sampler_check_threshold
        if not self._check_warned and float(mean) > threshold:
            self._check_warned = True
            rank_zero_warn(
                f"[lit_trainer] The rollout worker's log-probs differ from the trainer's for the same weights (round "
                f"{self._buffer.next_round_index}, weights of round {self._buffer.next_round_index - staleness}): mean "
                f"|delta log p| = {float(mean):.4g} > sampler_check_threshold={threshold}, max {float(largest):.4g}. "
                "The sampler is not the policy being trained: a weight sync that did not reach the worker (e.g. LoRA "
                "adapters not loaded), or an engine with other numerics. Check the rollout_engine's load_weights; "
                "raise the threshold only if the gap is expected."
            )
        return {"sampler_check/logp_gap_mean": mean, "sampler_check/logp_gap_max": largest}

    @contextlib.contextmanager
    def _weights_of(self, version: int) -> Iterator[None]:
        """Run the block with the trainable weights of ``version`` (from shared memory), then restore them."""
        params = self._trainable()
        published = self._worker.weights.read(version)
        saved = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(_sharding.shard_like(published[name], p))
            try:
                yield
            finally:
                for name, p in params.items():
                    p.copy_(saved[name])


def _overrides(cls: type, name: str) -> bool:
    """Whether a subclass redefines method ``name`` below the class that first defines it."""
    return sum(name in vars(c) for c in cls.__mro__) > 1


def _same_prompts(sampled: dict[str, Any], actual: dict[str, Any]) -> bool:
    """Whether the worker's round sampled the prompts of the batch the loader gave."""
    ids = sampled.get(PROMPT_IDS)
    if ids is None or ids.shape != actual[PROMPT_IDS].shape or not torch.equal(ids.cpu(), actual[PROMPT_IDS].cpu()):
        return False
    return list(sampled.get(PROMPTS, [])) == list(actual[PROMPTS])


def _to_device(value: Any, device: torch.device) -> Any:
    """Move a received value to ``device``; CPU tensors are copied out of the shared memory they arrived in."""
    return apply_to_collection(value, Tensor, lambda t: t.clone() if device.type == "cpu" else t.to(device))
