"""Lightning loggers that Lightning itself does not ship.

* :class:`TrackioLogger`: Trackio, Hugging Face's local-first tracker (``pip install "lit_trainer[trackio]"``);
  ``trackio`` is imported only when a run starts.

``lit-trainer fit --report_to trackio,tensorboard`` chooses trackers by name (docs/tracking.md).
"""

from lit_trainer.loggers.trackio import TrackioLogger

__all__ = ["TrackioLogger"]
