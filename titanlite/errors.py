"""Errors that reach the user as one line (exit code 2): raised by config, models, data and
checkpoint code alike, so none of them imports another for it."""


class ConfigError(ValueError):
    """A bad config value or input file; the message is one line naming the key or file, the value
    and the fix."""
