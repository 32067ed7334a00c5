"""Checkpoints: saving, resuming and exporting a run's state.

- ``manager``: ``CheckpointManager`` (step folders, keep-last-k, latest / best links,
  fall-back to the last good step).
- ``files``: atomic writes, digests and the ``CheckpointError`` type.
- ``manifest``: ``meta.json`` (format version, file digests, its own digest) and the JSON
  state beside the DCP shards.
- ``sync``: the agreement between ranks (one decision, every rank follows).
- ``export``: a single-file ``model.pt`` / ``model.weights`` from a sharded checkpoint.
- ``safe_load``: reading what others wrote without unpickling code (restricted unpickler
  for DCP metadata, weights-only values).
"""

from spconv_train.checkpoint.export import export_checkpoint
from spconv_train.checkpoint.files import CheckpointError, rng_state, set_rng_state
from spconv_train.checkpoint.manager import FORMAT_VERSION, CheckpointManager, read_meta

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointManager",
    "export_checkpoint",
    "read_meta",
    "rng_state",
    "set_rng_state",
]
