import pytest
import torch

from k3compile.engine.build import BuildOptions, build_engine
from k3compile.passes.pipeline import PipelineConfig

_BUILT = {}


@pytest.fixture(scope="session")
def built_engine(tmp_path_factory):
    """build(name) -> (in-memory engine, engine directory): k3-tiny / kimi-linear-tiny, fp32, CPU, the
    default pipeline (P1-P5); built once per session."""
    def build(name: str):
        if name not in _BUILT:
            out = tmp_path_factory.mktemp("engines") / name
            engine = build_engine(BuildOptions(name, dtype=torch.float32, pipeline=PipelineConfig.default()), str(out),
                                  log=lambda msg: None)
            _BUILT[name] = (engine, str(out))
        return _BUILT[name]
    return build
