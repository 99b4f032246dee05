"""Checkpoints, format-neutral: a folder committed atomically with a manifest of sizes and sha256
(each computed by the process that wrote the file, while writing it), each file verified by the
process that reads it, as it reads it; listing and rotating numbered folders; sharded state through
``torch.distributed.checkpoint`` (its metadata read without running code); the one mapping of
write failures to ``OSError``; the run lock."""

from mixprec.checkpoint.folder import (
    CheckpointError,
    CheckpointNotFoundError,
    is_complete_checkpoint,
    load_tensor_file,
    verify_checkpoint,
    write_checkpoint,
)
from mixprec.checkpoint.lock import RunLock

__all__ = ["CheckpointError", "CheckpointNotFoundError", "RunLock", "is_complete_checkpoint", "load_tensor_file",
           "verify_checkpoint", "write_checkpoint"]
