"""SplitFed's typed errors: one root, specific subclasses, messages that say what to do next."""

from __future__ import annotations


class SplitFedError(Exception):
    """Root of every error splitfed raises on purpose."""


class ConfigError(SplitFedError, ValueError):
    """A configuration value is missing or out of range; the message names the key."""


class UnsupportedModelError(SplitFedError, TypeError):
    """The model's architecture has no splitter; the message lists the supported ones."""


class SplitError(SplitFedError, ValueError):
    """The cut points do not fit the model (out of range or in the wrong order)."""


class CodecError(SplitFedError, ValueError):
    """A tensor on the wire is malformed: unknown dtype, bad shape, wrong byte count, too large."""


class TensorValueError(CodecError):
    """A tensor holds NaN or Inf, is empty, or has the wrong shape or dtype for its role."""


class ActivationNotFoundError(SplitFedError, KeyError):
    """A Backward names an activation the server does not hold (unknown, expired or evicted)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ActivationStateError(SplitFedError):
    """An activation exists but cannot be used this way (already used, evaluation-only, in flight)."""


class DuplicateActivationError(SplitFedError):
    """A Forward reuses an activation id that belongs to a different request."""


class PermissionDeniedError(SplitFedError):
    """A client touched an activation or session that belongs to another client."""


class RegionNotFoundError(SplitFedError, KeyError):
    """A tensor names a shared-memory region the server does not hold (closed, or never opened)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SharedMemoryUnavailableError(SplitFedError):
    """Shared memory cannot carry tensors here (the server offers none, or it is not on this host)."""


class AuthError(SplitFedError):
    """A token is missing, malformed, expired, replayed or signed with another key."""


class ResourceExhaustedError(SplitFedError):
    """A server limit (message size, saved-forward budget, sessions, cache memory) was hit."""


class SessionNotFoundError(SplitFedError, KeyError):
    """An inference session is unknown, expired or was evicted; open a new one."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TrunkStepError(SplitFedError):
    """The trunk failed while computing a backward or taking an optimizer step (a server fault, e.g. out of
    memory); none of the step's gradients was applied."""


class TrunkBusyError(SplitFedError):
    """The trunk cannot take the request now (out of device memory, shutting down); retrying later can succeed."""


class GradientRejectedError(SplitFedError):
    """A gradient failed the guard (NaN/Inf or a norm above the configured limit)."""


class ChannelError(SplitFedError):
    """The split channel failed after retries; ``code`` is the gRPC status name."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class BulkLinkError(SplitFedError):
    """A bulk link (:mod:`splitfed.channel.transports.bulk.links`) broke, or its peer broke its protocol: the link is closed, and
    the call that used it can be retried over gRPC alone."""


class BulkUnavailableError(SplitFedError):
    """The trunk server offers no bulk links (it serves TLS, or was not started with ``bulk_connections``)."""


class ModelLoadError(SplitFedError):
    """A model or checkpoint could not be found or read; the message says where it looked."""


class PrivacyBudgetError(SplitFedError):
    """Training would spend more privacy than the configured target epsilon allows."""


class MissingExtraError(SplitFedError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the pip install."""


class RoundFailedError(SplitFedError):
    """Too few clients completed a round; the message quotes the first client's error."""


class CheckpointError(SplitFedError):
    """No usable checkpoint where one is needed (resume), or one could not be written."""


class CheckpointMismatchError(SplitFedError):
    """``resume = true`` found a checkpoint that another run made (another app, model, cuts, strategy or
    settings); the message names what differs."""


class ClientFailedError(SplitFedError):
    """A client's round failed; the message is the original error's type and text."""


class ModelExistsError(SplitFedError):
    """A load names a model the server already holds; unload or reload it instead."""


class ModelNotHeldError(SplitFedError, KeyError):
    """A call names a model the server does not hold; the message lists the ones it holds."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ModelBusyError(SplitFedError):
    """A model is loading or being unloaded and cannot take this call now; retry when its state settles."""
