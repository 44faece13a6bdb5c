"""Errors a user can act on. Their message is one line that names the problem; the CLI prints
it without a traceback and exits non-zero."""


class KvslimError(Exception):
    """Base class for every error caused by user input (files, flags, request parameters)."""


class ConfigError(KvslimError):
    """A model directory, config.json or checkpoint that kvslim cannot use."""


class WeightsError(ConfigError):
    """Weights missing, unexpected, or of the wrong shape."""


class InvalidRequestError(KvslimError, ValueError):
    """A request or sampling parameter that is out of range. `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineFailedError(RuntimeError):
    """The model step for a whole batch failed: the KV cache and the scheduler's state can no
    longer be trusted, so no request can be served until the engine is rebuilt. Not a
    `KvslimError`: no input of the user caused it."""
