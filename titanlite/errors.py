"""Errors that reach the user as one line: raised by config, models, data, checkpoint and training
code alike, so none of them imports another for it."""


class ConfigError(ValueError):
    """A bad config value or input file; the message is one line naming the key or file, the value
    and the fix (exit 2)."""


class TrainingDiverged(RuntimeError):
    """Training cannot go on (a non-finite step, too many skipped steps or rollbacks): one line, exit 1."""
