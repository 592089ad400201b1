class CheckpointError(ValueError):
    """A checkpoint directory or weight file that cannot be used as-is (names the file / tensor)."""
