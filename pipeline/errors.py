"""The one exception type a user sees.

Anything raised as a `PipelineError` is a problem with input the user controls (params, data,
environment). The CLI prints its message and exits non-zero, without a traceback; anything else is
a bug and keeps its traceback.
"""


class PipelineError(Exception):
    """An error the user can act on: the message says what, where, and what to do."""


class ConfigError(PipelineError):
    """A bad value in params.yaml."""


class DataError(PipelineError):
    """Missing, corrupt or inconsistent input data."""
