"""Extension points of lit_trainer, one file each (``docs/customizing.md``)."""
