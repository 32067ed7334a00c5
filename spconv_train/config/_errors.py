"""The one exception type of the config package."""

from __future__ import annotations


class ConfigError(Exception):
    """A configuration problem, reported before torch or any process group is touched.

    ``key`` is the dotted path of the offending setting (``"optimizer.lr"``), or the
    config file's path for file-level problems, or ``"--set"`` for a malformed override.
    ``str(err)`` always starts with the key: ``"optimizer.lr: expected a positive number,
    got -1"``.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Default pickling would call __init__ with the formatted message only
        # (errors cross process boundaries in DataLoader workers and spawn).
        return (type(self), (self.key, self.reason))
