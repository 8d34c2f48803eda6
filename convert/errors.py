"""The one error type of the converter: a checkpoint we cannot read, naming the file and the tensor."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the config. `str(e)` is one line:
    `<file>: <tensor>: <what is wrong>` (the tensor part only where one tensor is at fault)."""

    def __init__(self, file: str | os.PathLike | None, what: str, tensor: str | None = None):
        self.file = None if file is None else os.fspath(file)
        self.tensor = tensor
        self.what = what
        parts = [p for p in (self.file, f"tensor {tensor}" if tensor else None, what) if p]
        super().__init__(": ".join(parts))
