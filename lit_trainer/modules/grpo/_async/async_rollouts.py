"""Asynchronous GRPO rollouts: a worker process generates the next rounds while the trainer trains on this one.

With ``GRPOModule(max_staleness=k)`` each rank starts one rollout worker (a process forked from a ``forkserver``,
:func:`worker_context`, with its own copy of the policy, on ``rollout_worker_device``) when fitting starts. Rounds
keep the synchronous module's meaning (round ``q`` samples the prompts the loader gives at its first micro-step, with
the seed of ``(generation_seed, q, rank)``); only the weights that sample it change:

* **Versions.** The weights at the start of round ``r`` are version ``r``. Round ``q`` is sampled by version
  ``max(q - k, first)`` (``first``: the run's first round, kept across resumes), so no round is ever more than ``k``
  rounds stale and the worker waits for the weights it needs: nothing is dropped and the run does not depend on
  timing. ``k = 0`` is the synchronous run, computed in the worker: the same code on the same weights with the same
  seed (bit-exact on CPU). With the default ``steps_per_generation = accumulate_grad_batches`` a round is one
  optimizer step, so ``k`` counts optimizer steps as TRL's ``max_staleness`` counts weight versions.
* **Flow, at the start of round r** (:meth:`AsyncRollouts.rows`): publish the trainable weights as version
  ``r`` (LoRA: the adapters only) into shared memory, send the worker the rounds up to ``r + k`` it does not have yet
  (future prompts are read ahead from the loader, :meth:`~lit_trainer.data.loader.TrainLoader.peek`), then take round
  ``r``'s rows: prompts, completions and the worker's log-probs of them (the behaviour log-probs, computed with the
  trainer's own chunked forward). A round whose prompts are not the batch the loader actually gave (the read-ahead
  guessed wrong) is dropped and generated here, synchronously (``async/resampled_rounds``).
* **Weights** travel through :class:`~lit_trainer.modules.grpo._async._worker.SharedWeights`: ``k + 1`` slots in shared
  CPU memory, version ``v`` in slot ``v % (k + 1)``; a slot is overwritten only when the round that read it is already
  trained, so neither side waits for the other to copy.
* **Scoring** stays in the trainer (reward functions and models, gathered over ranks as in a synchronous round), as
  do the old log-probs, the importance-sampling correction of stale rounds and the sampler check
  (:meth:`AsyncRollouts.off_policy_terms`).
* **Resume.** Rounds in flight are not checkpointed: a resumed run regenerates them from their seeds (the round, the
  rank and ``generation_seed``) and their prompts (the loader's exact resume), with the weights they would have had.
  The checkpoint carries what that needs (:meth:`AsyncRollouts.state_dict`, key ``grpo_async_rollouts``): ``first``,
  and the trainable weights (LoRA: the adapters) of the versions ``v`` with ``N - k <= v < N`` still read by the
  rounds from ``N`` on (``N``: the next round to generate), copied from the shared slots; a resumed fit publishes
  them into its new worker's slots before it sends any round (:meth:`AsyncRollouts.start`), so round ``q`` is again
  sampled by version ``max(q - k, first)`` and the run continues bit for bit (tested at ``k = 1`` and ``2``). The
  checkpoint grows by up to ``k`` copies of the trainable weights. A checkpoint without them (written before, by a
  synchronous run, or with a smaller ``k``) still loads: the first ``k`` rounds after the resume are then sampled
  with the resumed, fresher weights, with a warning.
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
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
from lit_trainer.losses.grpo_masks import SamplingISMode
from lit_trainer.modules.grpo._async._errors import WorkerDied, death_message, failure_message
from lit_trainer.modules.grpo._async._worker import Deferred, RoundRequest, SharedWeights, WorkerSpec, worker_main
from lit_trainer.modules.online_rl._rollout_buffer import SAMPLING_LOGPS
from lit_trainer.modules.online_rl._sampler import SamplerCheck, SamplerCorrection

#: seconds the worker gets to finish its request and exit when fitting ends, before it is terminated
CLOSE_SECONDS = 5.0
#: the checkpoint key of :meth:`AsyncRollouts.state_dict` (the weights versions the rounds in flight need)
STATE_KEY = "grpo_async_rollouts"


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
        self.process = context.Process(
            target=worker_main, args=(self.requests, self.results), daemon=True, name="lit-rollouts"
        )
        self.process.start()
        # The spec (the policy copy) and the weight slots go as the first request, not as the process's arguments:
        # the forkserver passes a new process's file descriptors (one per shared tensor) in one message, capped at
        # 253 by the kernel, so a policy of more than about 250 tensors (SmolLM2-135M has 273) could not start
        # ("too many fds"); a queue hands them over one at a time. The spec unpickles in the worker's error report.
        self.requests.put((Deferred(spec), weights))
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
    """Stops the rollout worker when fitting fails (Lightning calls no module hook on an exception)."""

    def __init__(self, rollouts: AsyncRollouts) -> None:
        self.rollouts = rollouts

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.rollouts.close()


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


@dataclass(frozen=True)
class AsyncOptions:
    """The options asynchronous rollouts read: :class:`~lit_trainer.modules.grpo.GRPOModule`'s hyperparameters of the
    same names (:meth:`from_hparams`)."""

    max_staleness: int | None
    rollout_worker_device: str | None
    rollout_worker_threads: int | None
    rollout_engine: str | None
    rollout_engine_options: dict[str, Any] | None
    rollout_importance_sampling_correction: bool
    rollout_importance_sampling_mode: SamplingISMode
    rollout_importance_sampling_clip_max: float | None
    rollout_importance_sampling_clip_min: float | None
    sampler_check_threshold: float | None
    num_generations: int
    transformers_continuous_batching_config: dict[str, Any] | None

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> AsyncOptions:
        return cls(**{f.name: hparams[f.name] for f in fields(cls)})


class AsyncRollouts:
    """The trainer side of asynchronous rollouts (module docstring), held by
    :class:`~lit_trainer.modules.grpo.GRPOModule` as ``async_rollouts`` (inactive when ``max_staleness`` is None): the
    module's hooks call it, passing the module where the trainer, the round buffer or the module's forward is needed.

    Args:
        options: the asynchronous-rollout options.
    """

    def __init__(self, options: AsyncOptions) -> None:
        self.options = options
        self.worker: RolloutWorker | None = None  # this rank's worker, while fitting
        self._first: int | None = None  # the first round of the run (of this fit, or restored from its checkpoint)
        self._resumed = False  # a checkpoint was loaded (on_load_checkpoint), with this state (None: none in it)
        self._restored: dict[str, Any] | None = None
        self._republished: set[int] = set()  # versions published from the checkpoint (not this fit's weights)
        self.correction = SamplerCorrection.from_hparams(vars(options))
        self.sampler_check = SamplerCheck(options.sampler_check_threshold, "rollout worker")
        self._model_copy: torch.nn.Module | None = None  # taken before FSDP2 shards the policy

    @property
    def enabled(self) -> bool:
        return self.options.max_staleness is not None

    def callbacks(self) -> list[Callback]:
        """What ``configure_callbacks`` adds: the callback that stops the worker when fitting fails."""
        return [_StopWorker(self)] if self.enabled else []

    def check(self, owner: str, rollout_func: Any, quantized: bool) -> None:
        """Refuse what the worker cannot do, with the fix (called at setup)."""
        if not self.enabled:
            return
        why = None
        if rollout_func is not None:
            why = "a rollout_func runs in the training process (it receives the module)"
        elif quantized:
            why = "the policy is quantized and the worker cannot copy it"
        if why:
            raise ValueError(
                f"{owner}(max_staleness={self.options.max_staleness}): {why}. Use max_staleness=None "
                "(synchronous rollouts), or an unquantized policy without rollout_func."
            )

    def copy_before_sharding(self, model: torch.nn.Module, device_mesh: Any) -> None:
        """Before FSDP2 shards the policy (``configure_model``), keep a hook-free CPU copy of it for this rank's worker
        (a sharded model cannot be copied whole); the first published version brings it up to date after a
        checkpoint restore."""
        if self.enabled and device_mesh is not None and not _sharding.is_sharded(model):
            self._model_copy = strip_hooks(copy.deepcopy(model)).to("cpu")

    def start(self, module: Any) -> None:
        """Start this rank's worker with a hook-free CPU copy of ``module``'s policy (called when fitting starts)."""
        if not self.enabled or self.worker is not None:
            return
        device = self.options.rollout_worker_device or str(module.device)
        if device == "cuda" and module.device.type == "cuda":
            device = str(module.device)
        model, self._model_copy = self._model_copy, None
        if model is None:
            model = strip_hooks(copy.deepcopy(module.model)).to("cpu")
        model.requires_grad_(False)
        spec = self.worker_spec(module, model, device)
        trainable = _trainable(module.model)
        weights = SharedWeights({n: p.detach() for n, p in trainable.items()}, slots=self.options.max_staleness + 1)
        # (a DTensor's shape and dtype are the full parameter's)
        self.worker = RolloutWorker(spec, weights)
        self._first, self._republished = None, set()
        resumed, restored, self._resumed, self._restored = self._resumed, self._restored, False, None
        if resumed and self.options.max_staleness:
            self._republish(weights, restored)

    # ------------------------------------------------------------------------------------------------ resume
    def state_dict(self, next_round: int) -> dict[str, Any] | None:
        """What a resumed fit needs to sample the rounds in flight as this one does (module docstring, "Resume"):
        ``first``, ``next_round`` (``N``: the next round to generate, the buffer's ``rounds``, whether or not the
        checkpoint falls inside a round) and ``versions``: ``{v: {name: tensor}}`` for ``max(N - k, first) <= v < N``,
        the trainable weights rounds ``N``, ``N + 1``, ... will still be sampled (and sampler-checked) by, copied out of
        the shared slots (every slot holds full CPU tensors, the same on every rank: under DDP or FSDP2 the dict rank 0
        saves is every rank's). They are past weights, which nothing else in the checkpoint can recreate, and the slots
        already hold them, so no collective and no extra pass is needed; version ``N`` and later are the resumed fit's
        own weights when it reaches them. None while no worker runs (nothing to read them from)."""
        weights = self.worker.weights if self.worker is not None else None
        if not self.enabled or weights is None:
            return None
        k = self.options.max_staleness
        first = next_round if self._first is None else self._first
        needed = range(max(next_round - k, first), next_round)
        missing = [v for v in needed if not weights.holds(v)]
        if missing:  # cannot happen while slots are reused as described; never fail a save for it
            rank_zero_warn(
                f"[lit_trainer] The checkpoint at round {next_round} holds no weights versions: versions {missing} "
                "are not in the shared slots. A resume from it samples its first rounds with fresher weights."
            )
            return None
        versions = {v: {n: t.clone() for n, t in weights.read(v).items()} for v in needed}
        return {"max_staleness": k, "first": first, "next_round": next_round, "versions": versions}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Keep a loaded checkpoint's :meth:`state_dict` (None when it has none) for :meth:`start`; when the worker
        already runs (a strategy that loads the checkpoint after ``on_fit_start``: ``ModelParallelStrategy``), publish
        its versions now, before any round is requested."""
        self._resumed, self._restored = True, state
        if self.worker is not None:
            self._resumed, self._restored = False, None
            if self.options.max_staleness:
                self._republish(self.worker.weights, state)

    def _republish(self, weights: SharedWeights, state: dict[str, Any] | None) -> None:
        """Publish the checkpoint's weights versions into the new worker's slots, and restore ``first``; otherwise
        (they are not all there) warn that the first ``k`` rounds are fresher than in an uninterrupted run."""
        k, why = self.options.max_staleness, None
        if state is None:
            why = "it holds none (written by an older version, a synchronous run, or after fitting ended)"
        else:
            next_round, first, versions = int(state["next_round"]), int(state["first"]), state["versions"]
            needed = range(max(next_round - k, first), next_round)
            missing = [v for v in needed if v not in versions]
            if missing:
                why = f"versions {missing} are not in it (written with max_staleness={state['max_staleness']})"
            elif any(set(versions[v]) != set(weights.names) for v in needed):
                why = "they are of other trainable parameters than this run's"
        if why is not None:
            rank_zero_warn(
                f"[lit_trainer] Resuming max_staleness={k} from a checkpoint without the weights versions that sampled "
                f"the rounds in flight ({why}): the first {k} rounds after the resume are sampled with the resumed, "
                "fresher weights (less stale than in an uninterrupted run)."
            )
            return
        for v in needed:
            weights.publish(v, versions[v])
        self._first, self._republished = first, set(needed)

    def worker_spec(self, module: Any, model: torch.nn.Module, device: str) -> WorkerSpec:
        """What this rank's worker builds its rollout generator from: ``model`` (its copy of the policy), ``module``'s
        sampling options, engine choice, tools, environments and ``behaviour_scorer()``."""
        owner = type(module)
        forward = [n for n in ("completion_logps", "score_tokens") if _overrides(owner, n)]
        if forward and not _overrides(owner, "behaviour_scorer"):
            rank_zero_warn(
                f"[lit_trainer] {owner.__name__} overrides {' and '.join(forward)} but not behaviour_scorer: "
                "the rollout worker scores its rounds with the default forward, and the sampler check will see the "
                "gap. Override behaviour_scorer to return a picklable (model, rows) -> log-probs running your forward."
            )
        return WorkerSpec(
            model=model,
            tokenizer=module.tokenizer,
            options=module.rollouts.options,
            continuous_batching=module.continuous_batching,
            continuous_batching_config=self.options.transformers_continuous_batching_config,
            engine=self.options.rollout_engine,
            engine_options=self.options.rollout_engine_options,
            tools=list(module.tools),
            environments=module.environments,
            scorer=module.behaviour_scorer(),
            group=self.options.num_generations,
            steps_per_generation=module.rollout_geometry.steps_per_generation,
            owner=owner.__name__,
            device=device,
            threads=self.options.rollout_worker_threads or torch.get_num_threads(),
        )

    def close(self) -> None:
        """Stop the worker, if one runs (fitting ended or failed)."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()

    # ------------------------------------------------------------------------------------------------ rounds
    def rows(self, module: Any, batch: dict[str, Any], can_stop: bool, position: tuple[int, int]) -> tuple:
        """Round ``r``'s rows from the worker (module docstring): ``(rows, completions, scoring batch, decoded, tool
        metrics, behaviour log-probs, staleness in rounds)``; a stop request while waiting stops the run here."""
        worker, r, trainer = self.worker, module._buffer.next_round_index, module.trainer
        if self._first is None:
            self._first = r
        if r not in self._republished:  # a republished version is the weights at the start of round r, which these
            # are not when the interrupted round is regenerated (a resume with another world size)
            worker.weights.publish(r, _trainable(module.model))
        if r not in worker.pending and r not in worker.ready:
            worker.submit(self._request(module, r, batch))
        peek = getattr(trainer.train_dataloader, "peek", None)
        length, count = module._buffer.round_length, self.options.max_staleness
        ahead = list(_round_starts(trainer, length, *position, count)) if peek is not None else []
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
            worker.submit(self._request(module, q, future))
        started = time.perf_counter()
        should_stop = stop_check(trainer) if can_stop else None
        try:
            received = worker.receive(r, should_stop)
            if received is None:  # a stop request came while waiting: the run stops here (the round is dropped)
                stop_in_step(trainer)
                received = worker.receive(r)  # the stop was not due on every rank: keep waiting
        except WorkerDied as died:
            if can_stop:  # nothing of this optimizer step is applied: the last finished one is saved, then stop
                stop_for_failure(trainer, str(died))
            raise
        waited = time.perf_counter() - started
        request, result = received
        resampled = not _same_prompts(request.batch, batch)
        device = module.device
        if resampled:  # the read-ahead guessed another batch: generate this round here, on the current weights
            rows, completions, scoring, decoded, tool_metrics = module._generate_rows(batch, can_stop)
            behaviour, staleness = module._engine_logps(rows, completions, decoded), 0  # vLLM's, else none needed
        else:
            rows, completions, scoring, decoded, tool_metrics = (
                _to_device(result[k], device) for k in ("rows", "completions", "batch", "decoded", "tool_metrics")
            )
            scoring = {**batch, **{k: v for k, v in scoring.items() if k in (PROMPTS, PROMPT_IDS)}}
            behaviour = _to_device(result["sampling_logps"], device)
            staleness = r - int(result["version"])
        metrics = {
            "async/staleness": torch.tensor(float(staleness), device=device),
            "async/wait_seconds": torch.tensor(waited, device=device),
            "async/resampled_rounds": torch.tensor(float(resampled), device=device),
        }
        return rows, completions, scoring, decoded, {**tool_metrics, **metrics}, behaviour, staleness

    def _request(self, module: Any, round_index: int, batch: dict[str, Any]) -> RoundRequest:
        seed = rollout.rollout_seed(module._seed, round_index, module.global_rank)
        version = max(round_index - self.options.max_staleness, self._first)
        current = module._buffer.next_round_index
        if version < current and not self.worker.weights.holds(version):
            # only the interrupted round regenerated after a resume with another world size, whose version the
            # checkpoint does not keep: the weights at the start of that round (or the resumed ones)
            version = current
        return RoundRequest(round_index, version, move_data_to_device(batch, "cpu"), seed, module.model.training)

    # ----------------------------------------------------------------------------------- off-policy terms
    def off_policy_terms(
        self, module: Any, rows: dict[str, Tensor], behaviour: Tensor, staleness: int, metrics: dict[str, Tensor]
    ) -> None:
        """Old log-probs, the importance-sampling correction and the sampler check of a worker round (in place).

        * ``old_logps`` (the trainer's log-probs at the start of the round) are stored when the synchronous rule
          needs them (the round spans optimizer steps); otherwise every micro-step of the round runs on the round's
          starting weights, so its own log-probs (detached) are the old ones, as in a synchronous round;
        * the correction (``rollout_importance_sampling_*``, TRL's ``vllm_importance_sampling_*`` computation) applies
          to a stale round, or to every round of an engine whose numerics are not the trainer's: the round keeps the
          behaviour log-probs (``sampling_logps``) and the module's ``compute_loss`` multiplies the policy loss by the
          truncated or masked ratio ``exp(old - behaviour)`` (:meth:`importance_ratio`). Computed there, it needs no
          extra forward pass;
        * the sampler check (:meth:`_sampler_check`).
        """
        options = self.options
        correct = options.rollout_importance_sampling_correction and (staleness > 0 or not module.engine.same_numerics)
        if module._stores_old_logps():
            rows["old_logps"] = module._chunked_logps(module.model, rows)
        if correct:
            rows[SAMPLING_LOGPS] = behaviour
        if options.sampler_check_threshold is not None:
            metrics.update(self._sampler_check(module, rows, behaviour, staleness))

    def importance_ratio(
        self, batch: dict[str, Tensor], logps: Tensor, old: Tensor | None
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """The correction of one buffered micro-batch of a corrected round (None for other rounds) and TRL's
        ``sampling/...`` metrics (:meth:`~lit_trainer.modules.online_rl._sampler.SamplerCorrection.ratio`)."""
        return self.correction.ratio(batch, logps, old)

    def _sampler_check(
        self, module: Any, rows: dict[str, Tensor], behaviour: Tensor, staleness: int
    ) -> dict[str, Tensor]:
        """Compare the worker's log-probs with the trainer's for the weights version that sampled the round, on its
        first ``num_generations`` rows (the worker's first chunk, the same shapes: on the same weights the gap is 0,
        up to float32 rounding): a failed sync shows on any rows, and a few keep the extra forward pass small. For a
        stale round the trainer loads that version's weights for the pass
        (:class:`~lit_trainer.modules.online_rl._sampler.SamplerCheck`)."""
        size = self.options.num_generations
        round_index = module._buffer.next_round_index
        first = {k: v[:size] for k, v in rows.items() if isinstance(v, Tensor) and v.dim() >= 1}
        if staleness == 0:
            mine = module.completion_logps(module.model, first)[0]
        else:
            with self._weights_of(module.model, round_index - staleness):
                mine = module.completion_logps(module.model, first)[0]
        where = f"round {round_index}, weights of round {round_index - staleness}"
        sampler = None if self.worker is not None else type(module.engine).__name__  # a synchronous run's engine
        return self.sampler_check.measure(module, mine, behaviour[:size], first["completion_mask"], where, sampler)

    @contextlib.contextmanager
    def _weights_of(self, model: torch.nn.Module, version: int) -> Iterator[None]:
        """Run the block with the trainable weights of ``version`` (from shared memory), then restore them."""
        params = _trainable(model)
        published = self.worker.weights.read(version)
        saved = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(_sharding.shard_like(published[name], p))
            try:
                yield
            finally:
                for name, p in params.items():
                    p.copy_(saved[name])


def _trainable(model: torch.nn.Module) -> dict[str, Tensor]:
    """The parameters the worker is sent every round (FSDP2 shards stay ``DTensor``: gathered one at a time)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _round_starts(trainer: Any, length: int, epoch: int, batch_idx: int, count: int) -> Iterator[tuple[int, int]]:
    """``(epoch, batch index)`` of the first micro-step of the next ``count`` rounds of ``length`` micro-steps after
    the one at ``(epoch, batch_idx)`` (rounds restart at every epoch), stopping at ``trainer.max_epochs``."""
    per_epoch = int(trainer.num_training_batches)
    max_epochs = trainer.max_epochs
    for _ in range(count):
        batch_idx += length
        if batch_idx >= per_epoch:
            epoch, batch_idx = epoch + 1, 0
            if max_epochs is not None and max_epochs >= 0 and epoch >= max_epochs:
                return
        yield epoch, batch_idx


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
