"""Errors after which an engine cannot go on (as opposed to a request that fails alone).

A rank of a parallel engine that died or hung leaves the others unable to run any step: no
request is to blame, none can continue. The engine raises a FatalEngineError out of `step()`;
the server fails every request it holds with it and shuts down.
"""
from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine is lost: fail everything, stop serving."""
