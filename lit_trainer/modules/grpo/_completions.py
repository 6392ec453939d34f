"""Former home of the rollout engines and sampling helpers, now :mod:`lit_trainer.generation.engines` (kept so that
imports of this module keep working)."""

from lit_trainer.generation.engines import (  # noqa: F401
    Completions,
    ContinuousBatchingEngine,
    GenerateEngine,
    RolloutEngine,
    StopWhen,
    completion_metrics,
    cut_after_eos,
    decode_completions,
    eos_token_ids,
    generate_completions,
    generate_completions_continuous,
    make_engine,
    rollout_seed,
    sampling_config,
    seeded_rng,
)
