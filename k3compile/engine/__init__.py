"""Engines: built step graphs + weights on disk (format.py), loaded with `Engine.load(DIR)`."""
from .engine import Engine  # noqa: F401
from .format import FORMAT_VERSION, EngineError  # noqa: F401
from .opened import OpenedEngine, is_engine_dir, open_engine  # noqa: F401
