"""The bottom layer: infrastructure shared by callbacks, modules, data, loggers and the CLI.

Nothing here imports another ``lit_trainer`` package, so every layer above may import it (``tests/test_layering.py``
checks the rule; ``docs/design.md#layers`` draws the layers). Each module holds one concern:

* :mod:`~lit_trainer.core.atomic`: atomic writes (partial name, then rename) and the out-of-space error;
* :mod:`~lit_trainer.core.awaitables`: awaiting the user's coroutines from synchronous training code;
* :mod:`~lit_trainer.core.dist`: small collectives for per-rank state;
* :mod:`~lit_trainer.core.import_path`: objects named by import path in a config;
* :mod:`~lit_trainer.core.lightning_namespace`: one implementation per callback or logger for both Lightning
  package names (``lightning.pytorch``, ``pytorch_lightning``);
* :mod:`~lit_trainer.core.seeding`: derived seeds (SplitMix64);
* :mod:`~lit_trainer.core.sharding`: FSDP2 sharding helpers (DTensor shards, full state dicts, strategy checks);
* :mod:`~lit_trainer.core.stop_request`: the duck-typed contract between a stopping callback and a long step;
* :mod:`~lit_trainer.core.version_folders`: the names of Lightning's logger version folders (``version_<n>``).

Importing this package imports none of them.
"""
