import os

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
# tiny models: intra-op threads only add OpenMP spin overhead (20x slower when cores are shared)
torch.set_num_threads(1)

# `make test` runs `-n 2 --dist loadfile`: each file is one unit of work for an xdist worker, except that the
# files of a group below share a process-wide expensive object and so go to the same worker as one unit.
SHARED_WORKER = {
    # the k3-tiny fp32 default-pipeline engine of `built_engine` (one build: ~20 CPU s)
    "engine-k3-tiny": ("tests/k3compile/engine/test_engine.py", "tests/k3compile/engine/test_provenance.py",
                       "tests/k3compile/engine/test_generate_engine.py", "tests/k3compile/engine/test_open_engine.py",
                       "tests/runtime/server/test_openai_variants.py"),
    # tp2 rank graphs of tests/passes/parallel_helpers.py (captured once per process: ~15 CPU s per model and mode)
    "tp2-rank-graphs": ("tests/passes/test_p09_all_reduce_norm.py", "tests/passes/test_p12_moe_finalize_all_reduce.py",
                        "tests/passes/test_p13_latent_up_column.py", "tests/passes/test_parallel_pipeline.py"),
}
_GROUP_OF = {path: group for group, paths in SHARED_WORKER.items() for path in paths}


class SharedWorkerGroups:
    """xdist's --dist loadfile with the SHARED_WORKER groups as single units (test ids stay as they are)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class SharedWorkerScheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = super()._split_scope(nodeid)
                return _GROUP_OF.get(path, path)

        return SharedWorkerScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # the hook exists only with xdist (not under -p no:xdist)
        config.pluginmanager.register(SharedWorkerGroups(), "shared-worker-groups")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_BUILT = {}


@pytest.fixture(scope="session")
def built_engine(tmp_path_factory):
    """build(name) -> (in-memory engine, engine directory): k3-tiny / kimi-linear-tiny, fp32, CPU, the
    default pipeline (all registered passes); built once per worker process (see SHARED_WORKER)."""
    from k3compile.engine.build import BuildOptions, build_engine
    from k3compile.passes.pipeline import PipelineConfig

    def build(name: str):
        if name not in _BUILT:
            out = tmp_path_factory.mktemp("engines") / name
            engine = build_engine(BuildOptions(name, dtype=torch.float32, pipeline=PipelineConfig.default()), str(out),
                                  log=lambda msg: None)
            _BUILT[name] = (engine, str(out))
        return _BUILT[name]
    return build
