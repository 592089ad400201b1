"""Errors that are the user's input, not our bug: the CLI prints them as one line."""
from __future__ import annotations

from k3compile.model_def.checkpoint_errors import CheckpointError
from k3compile.model_def.config import ConfigError
from k3compile.report.trace import TraceError

UserError = (ConfigError, CheckpointError, FileNotFoundError, TraceError)
