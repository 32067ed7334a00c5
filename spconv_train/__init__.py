"""spconv-train: train segmentation networks on width-sharded images (spatial parallelism)."""

__version__ = "0.1.0"
