"""Exceptions that name the problem and the fix.

Every error AirQuant raises on bad input derives from ``AirQuantError`` so the CLI can print
its message (which already says what to do) without a stack trace.
"""


class AirQuantError(Exception):
    """Base class: the message names the file or value at fault and the fix."""


class ModelNotFoundError(AirQuantError):
    """A model spec does not resolve to a local file, folder or reachable hub repo."""


class UnsupportedModelError(AirQuantError):
    """The architecture or checkpoint layout is not one AirQuant can split and run."""


class StoreError(AirQuantError):
    """A shard store is missing, incomplete, or belongs to another model."""


class ChecksumError(StoreError):
    """A shard's bytes do not match the sha256 recorded in the manifest."""


class DiskSpaceError(AirQuantError):
    """The target disk has less free space than the split needs."""


class PromptTooLongError(AirQuantError):
    """Prompt plus requested new tokens exceed the model's context window."""


class DependencyError(AirQuantError, ImportError):
    """An optional package is needed; the message gives the pip command."""


class EvalConfigError(AirQuantError, ValueError):
    """A metric setting is out of range for this model (window, stride, context, ...)."""


class EvalDataError(AirQuantError):
    """An evaluation data set cannot be found or read; the message names the file and the fix."""


class ResultsFileError(AirQuantError):
    """A results JSON file is unreadable or not a row this version of AirQuant understands."""


class EnvironmentSetupError(AirQuantError):
    """A stage environment (requirements file, virtual environment, Jupyter kernel) cannot be used or built."""


class PipelineError(AirQuantError):
    """A notebook of the pipeline failed; the message names the notebook, the cell and what was kept."""
