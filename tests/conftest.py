import os

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
# tiny models: intra-op threads only add OpenMP spin overhead (20x slower when cores are shared)
torch.set_num_threads(1)

# `make test` runs `-n 2 --dist loadfile`: each file is one unit of work for an xdist worker, except that the
# files of a group below share a process-wide expensive object and so go to the same worker as one unit.
SHARED_WORKER = {
    # the k3-tiny fp32 default-pipeline engine of `built_engine` (one build: ~20 CPU s), and the captured steps these
    # files' builds and benches share (SHARED_CAPTURES: k3-tiny's decode step was captured eight times in them)
    "engine-captures": ("tests/k3compile/engine/test_engine.py", "tests/k3compile/engine/test_provenance.py",
                        "tests/k3compile/engine/test_generate_engine.py", "tests/k3compile/engine/test_open_engine.py",
                        "tests/runtime/server/test_openai_variants.py", "tests/k3compile/engine/test_served_graph.py",
                        "tests/k3compile/engine/test_served_verify_graph.py",
                        "tests/k3compile/bench/test_decode_bench.py", "tests/k3compile/bench/test_ladder_bench.py"),
    # the pass tests' captured graphs: tests/passes/helpers.graph (k3-tiny and kimi-linear-tiny; decode, prefill and
    # verify, fp32 and bf16: 14 graphs, 3-13 CPU s each, ~100 CPU s in all) and the tp2 rank graphs of
    # tests/passes/parallel_helpers.py (~15 CPU s per model and mode), each captured once per process
    "pass-graphs": tuple(f"tests/passes/test_{name}.py" for name in (
        "manager", "p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing",
        "p05_fused_kda_decode", "p06_fused_moe_decode", "p07_attn_res_norm", "p07_moe_out_norm", "p07_norm_route",
        "p08_small_m_gemm",
        "p08_small_m_norm_gemv",
        "p08_small_m_route_gemv",
        "p09_all_reduce_norm", "p11_copy_elision", "p12_moe_finalize_all_reduce", "p13_latent_up_column",
        "p15_mla_decode", "p16_kda_verify_inputs", "p17_dense_glu", "p18_short_conv_merge", "parallel_pipeline")) + (
        "tests/k3compile/engine/test_verify_graph.py",),  # k3-tiny's verify graph, as P16's tests
}
_GROUP_OF = {path: group for group, paths in SHARED_WORKER.items() for path in paths}
# files whose tests share captured steps (tests/k3compile/capture_memo.py): one worker process runs them all
SHARED_CAPTURES = SHARED_WORKER["engine-captures"]
_CAPTURE_MEMO = pytest.StashKey()

# Units (files or SHARED_WORKER groups) handed out before all others, longest first: xdist orders units by their
# number of tests, which puts long files of one or two tests (test_serve_parallel_engine: one 43 s test) last, where
# one worker runs them while the other has nothing left. Order from the units' wall time in the last full run
# (session 14, per-test times summed per unit); a unit missing here only goes in xdist's order.
SLOW_FIRST = ("pass-graphs", "engine-captures", "tests/passes/kernels/test_moe_decode.py",
              "tests/runtime/test_engine_cache.py", "tests/k3compile/commands/test_serve_parallel_engine.py",
              "tests/runtime/test_engine_parity.py", "tests/k3compile/engine/test_parallel_build.py",
              "tests/runtime/test_engine_memory.py", "tests/k3compile/commands/test_serve_parallel.py",
              "tests/model_def/parallel/test_tp_dcp.py", "tests/passes/kernels/test_kda_decode.py",
              "tests/runtime/test_overlap_mixed.py", "tests/k3compile/commands/test_serve.py",
              "tests/model_def/parallel/test_dcp_verify.py", "tests/runtime/spec/test_fold_kernel.py",
              "tests/passes/kernels/test_norm_route.py", "tests/runtime/server/test_openai_surface.py",
              "tests/runtime/parallel/test_parallel_engine.py", "tests/runtime/spec/test_spec_sampling.py",
              "tests/k3compile/engine/test_trained_token_agreement.py", "tests/runtime/test_failure_isolation.py",
              "tests/k3compile/bench/test_serve_bench.py", "tests/passes/kernels/test_gemv.py",
              "tests/runtime/cache/test_cache_properties.py", "tests/runtime/test_engine_properties.py",
              "tests/runtime/server/test_schema_fuzz.py", "tests/passes/kernels/test_routing.py",
              "tests/k3compile/bench/test_cache_bench.py")


class SharedWorkerGroups:
    """xdist's --dist loadfile with the SHARED_WORKER groups as single units (test ids stay as they are) and the
    SLOW_FIRST units handed out first."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class SharedWorkerScheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = super()._split_scope(nodeid)
                return _GROUP_OF.get(path, path)

            def _assign_work_unit(self, node) -> None:
                # the next unit a worker gets: the longest SLOW_FIRST unit left, else xdist's next one
                slow = next((unit for unit in SLOW_FIRST if unit in self.workqueue), None)
                if slow is not None:
                    self.workqueue.move_to_end(slow, last=False)
                super()._assign_work_unit(node)

        return SharedWorkerScheduling(config, log)


def pytest_configure(config):
    missing = [path for path in _GROUP_OF if not (config.rootpath / path).is_file()]
    missing += [unit for unit in SLOW_FIRST if unit not in SHARED_WORKER and not (config.rootpath / unit).is_file()]
    if missing:  # a renamed file would silently leave its group (and build its shared object again elsewhere)
        raise pytest.UsageError(f"tests/conftest.py SHARED_WORKER / SLOW_FIRST list files that do not exist: {missing}")
    # a CPU pass test outside the group captures all its graphs again in another process (sessions 12-13: P17 and
    # P18's files, ~30 CPU s)
    pass_tests = {str(path.relative_to(config.rootpath)): path.read_text()
                  for path in sorted((config.rootpath / "tests/passes").glob("test_*.py"))}
    outside = [name for name, text in pass_tests.items() if "helpers import" in text
               and "pytestmark = pytest.mark.gpu" not in text and name not in SHARED_WORKER["pass-graphs"]]
    if outside:
        raise pytest.UsageError("pass tests that capture graphs (tests/passes/helpers.py) belong to "
                                f"tests/conftest.py's 'pass-graphs' group: {outside}")
    from tests.k3compile import capture_memo
    config.stash[_CAPTURE_MEMO] = capture_memo.install()
    if config.pluginmanager.hasplugin("xdist"):  # the hook exists only with xdist (not under -p no:xdist)
        config.pluginmanager.register(SharedWorkerGroups(), "shared-worker-groups")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Captures are shared while a SHARED_CAPTURES file's test runs (its fixtures' set-up and teardown included)."""
    memo = item.config.stash[_CAPTURE_MEMO]
    memo.enabled = item.nodeid.split("::")[0] in SHARED_CAPTURES
    yield
    memo.enabled = False


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
