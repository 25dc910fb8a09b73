"""The project's user errors: what went wrong, in one line that names the culprit.

Entry points (``pretrain_gpt.py``, ``tools/``) catch :class:`ConfigError` (and so
:class:`CheckpointError`) and print its message without a traceback; anything else is a bug and
keeps its traceback. This module imports nothing of the project, so every layer can raise them.
"""

import sys


class ConfigError(ValueError):
    """A user error in flags or input files; its message is one line naming the culprit."""


def require(condition, message: str) -> None:
    """Raises ConfigError(message) unless ``condition``."""
    if not condition:
        raise ConfigError(message)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


class ClusterLossError(RuntimeError):
    """No outer round could be committed in time between cluster jobs: fewer than
    ``--dilocox-min-clusters`` are live, or the exchange keeps failing."""


class StateDivergedError(RuntimeError):
    """This cluster's global state differs from the other clusters' and no strict majority of
    them holds it: it must not go on (its payloads would be dropped, and it would drop theirs)."""


def missing_dependency(err: ModuleNotFoundError) -> str:
    """The one-line error of a run outside the project's environment."""
    return (f"Python module {err.name!r} is not installed for {sys.executable}: install the pinned "
            "dependencies with `source tools/setup_env.sh` (or: pip install -r requirements-cpu.txt "
            "&& pip install -e .)")
