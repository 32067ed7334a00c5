"""A run's folder and what it records.

- ``run_logger``: ``RunLogger`` (console lines, ``metrics.jsonl``, TensorBoard scalars and
  image panels) and the panel helpers.
- ``run_folder``: the run directory's files, the job record and the start decision (fresh,
  resume or overwrite).
- ``overwrite``: the all-or-nothing removal behind ``--overwrite``.
"""

from spconv_train.logging.run_logger import RunLogger, auto_contrast, class_colors, overlay_panel

__all__ = ["RunLogger", "auto_contrast", "class_colors", "overlay_panel"]
