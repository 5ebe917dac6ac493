"""The error every checkpoint reader raises (a leaf, so each reader can import it)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says what and where."""
