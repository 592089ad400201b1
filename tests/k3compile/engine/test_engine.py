"""Engine round trip: build (capture + P1-P5) -> save -> load gives the same steps, and loading refuses
damaged directories with an error that names the problem."""
from k3compile.passes.pipeline import PipelineConfig
import json
import os
import shutil

import pytest
import torch

from k3compile.engine import FORMAT_VERSION, Engine, EngineError
from k3compile.engine.format import DECODE_BUCKETS, sha256_file
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.config import ModelConfig, get_preset
from k3compile.model_def.loader import load_model

PAGE = 16  # capture traced with page size 4: the graphs must not depend on it


def run_requests(provider, spec):
    """Two requests: a prefill chunk each, a second chunk for one of them, then three decode steps."""
    cache = CacheTensors.allocate(spec, 4, 12, PAGE)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 7))
    tables, slots = [[1, 2, 3], [4, 5]], [1, 2]
    outs = [provider.step(ForwardBatch.build("prefill", [a[:13], b], [0, 0], tables, slots, PAGE), cache)]
    outs.append(provider.step(ForwardBatch.build("prefill", [a[13:]], [13], [tables[0]], [1], PAGE), cache))
    lens = [21, 7]
    for t in range(3):
        batch = ForwardBatch.build("decode", [[40 + t], [50 + t]], lens, tables, slots, PAGE)
        outs.append(provider.step(batch, cache))
        lens = [n + 1 for n in lens]
    return outs, cache


@pytest.fixture(scope="module")
def tiny(built_engine):
    return built_engine("k3-tiny")


def test_round_trip_same_logits_as_in_memory_graphs_and_eager_model(tiny):
    built, path = tiny
    loaded = Engine.load(path)
    model = load_model("k3-tiny", dtype=torch.float32)  # same preset seed as the build
    spec = model.cache_spec()
    assert loaded.cache_spec() == spec == built.cache_spec()
    got, got_cache = run_requests(loaded, spec)
    mem, mem_cache = run_requests(built, spec)
    ref, ref_cache = run_requests(model, spec)
    for x, y, z in zip(got, mem, ref):
        assert x.dtype == torch.float32 and x.shape == z.shape
        assert torch.equal(x, y)  # same graph, same weights: bit for bit
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-5)  # passes only reassociate fp32 sums
    for name in ("ssm", "conv", "kv"):
        assert torch.equal(getattr(got_cache, name), getattr(mem_cache, name))
        torch.testing.assert_close(getattr(got_cache, name), getattr(ref_cache, name), rtol=1e-5, atol=1e-5)


def test_loaded_weights_sit_in_aligned_storage(tiny):
    """Like the built engine's parameters: the same kernels run on both, on any machine (safetensors'
    8-byte offsets left weights at odd addresses, and oneDNN picked other paths for them)."""
    from k3compile.engine.engine import WEIGHT_ALIGN

    loaded = Engine.load(tiny[1])
    tensors = [t for gm in loaded.graphs.values() for t in gm.buffers()]
    assert tensors and all(t.data_ptr() % WEIGHT_ALIGN == 0 and t.is_contiguous() for t in tensors)


def test_manifest_records_the_build(tiny):
    _, path = tiny
    m = json.load(open(os.path.join(path, "engine.json")))
    assert m["format_version"] == FORMAT_VERSION
    assert ModelConfig.from_hf_dict(m["model"]["hf_config"], name="k3-tiny") == get_preset("k3-tiny")
    assert (m["dtype"], m["topology"], m["decode_buckets"]) == ("fp32", "single", list(DECODE_BUCKETS))
    names = [p["name"] for p in m["passes"]["decode"]["passes"]]
    assert names == PipelineConfig.default().enabled_passes()  # the default pipeline: every registered pass
    assert names[:4] == ["p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing"]
    assert {"p05_fused_kda_decode", "p06_fused_moe_decode", "p07_attn_res_norm", "p15_mla_decode"} <= set(names)
    route = m["passes"]["decode"]["passes"][3]
    assert route["matches"] == 8  # one fused router per MoE layer of k3-tiny
    ops = {p["op"]: p for p in m["kernel_plugins"]}
    assert ops["k3.fused_route.default"]["count"] == {"decode": 8, "prefill": 8}
    assert ops["k3.fused_kda_decode.default"]["count"] == {"decode": 6}  # P5: one per KDA layer
    assert ops["k3.fused_kda_decode.default"]["module"] == "k3compile.passes.kernels.kda_decode"
    assert "k3.kda_decode.default" not in ops and ops["k3.kda_prefill.default"]["count"] == {"prefill": 6}
    assert ops["k3.fused_route.default"]["module"] == "k3compile.passes.kernels.routing"
    files = set(m["files"])
    assert {"weights.safetensors", "graphs/decode.json", "graphs/prefill.json", "build_report.md"} <= files
    for rel, digest in m["files"].items():
        assert sha256_file(os.path.join(path, rel)) == digest
    report = open(os.path.join(path, "build_report.md")).read()
    assert "p04_fused_routing" in report and "k3.fused_route.default" in report
    graph = json.load(open(os.path.join(path, "graphs/decode.json")))
    targets = {n["target"] for n in graph["nodes"] if n["op"] == "call_function"}
    assert "k3.fused_route.default" in targets and "aten.mm.default" in targets


# ---- damaged directories ----

@pytest.fixture
def copy(tiny, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny[1], dst)
    return str(dst)


def _edit_json(path, fn, rehash_in=None):
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)
    if rehash_in is not None:  # keep the manifest's checksum in step, so the graph reader itself is tested
        root, rel = rehash_in
        _edit_json(os.path.join(root, "engine.json"), lambda m: m["files"].__setitem__(rel, sha256_file(path)))


def test_format_version_mismatch(copy):
    _edit_json(os.path.join(copy, "engine.json"), lambda m: m.__setitem__("format_version", FORMAT_VERSION + 1))
    with pytest.raises(EngineError, match=rf"format version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}"):
        Engine.load(copy)


def test_corrupted_weights(copy):
    path = os.path.join(copy, "weights.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(EngineError, match="weights.safetensors' is corrupted"):
        Engine.load(copy)


def test_missing_file_and_bad_manifest(copy):
    os.remove(os.path.join(copy, "graphs", "prefill.json"))
    with pytest.raises(EngineError, match="graphs/prefill.json' listed in engine.json is missing"):
        Engine.load(copy)
    with open(os.path.join(copy, "engine.json"), "a") as f:
        f.write("}")
    with pytest.raises(EngineError, match="not valid JSON"):
        Engine.load(copy)
    shutil.rmtree(copy)
    with pytest.raises(EngineError, match="no such directory"):
        Engine.load(copy)


def test_tampered_graph_fails_its_checksum(copy):
    path = os.path.join(copy, "graphs", "decode.json")
    _edit_json(path, lambda g: g["nodes"].pop(-2))
    with pytest.raises(EngineError, match="graphs/decode.json' is corrupted"):
        Engine.load(copy)


@pytest.mark.parametrize("target, message", [
    ("builtins.eval", "outside the allowed namespaces"),
    ("operator.attrgetter", "not an allowed operator function"),
    ("aten.no_such_op.default", "unknown op 'aten.no_such_op.default'"),
    ("k3.no_such_kernel.default", "unknown op 'k3.no_such_kernel.default'.*kernel plugin"),
])
def test_graph_with_an_op_outside_the_whitelist_is_refused(copy, target, message):
    path = os.path.join(copy, "graphs", "decode.json")

    def swap(g):
        node = next(n for n in g["nodes"] if n["target"] == "aten.mm.default")
        node["target"] = target
    _edit_json(path, swap, rehash_in=(copy, "graphs/decode.json"))
    with pytest.raises(EngineError, match=message):
        Engine.load(copy)


def test_plugin_modules_outside_the_package_are_not_imported(copy):
    _edit_json(os.path.join(copy, "engine.json"),
               lambda m: m["kernel_plugins"].append({"op": "k3.x.default", "module": "os"}))
    with pytest.raises(EngineError, match="outside the k3compile package"):
        Engine.load(copy)


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    from k3compile.engine.build import BuildOptions, build_engine
    from k3compile.model_def.config import ConfigError

    with pytest.raises(ConfigError, match="unknown model 'no-such-model'"):
        build_engine(BuildOptions("no-such-model", dtype=torch.float32), str(tmp_path / "e"), log=lambda m: None)
    assert os.listdir(tmp_path) == []  # neither the engine nor its staging directory
    with pytest.raises(ValueError, match="tp8: 2 KDA heads are not divisible by 8 ranks"):  # k3-tiny has 2 heads
        build_engine(BuildOptions("k3-tiny", topology="tp8"), str(tmp_path / "e"), log=lambda m: None)
    with pytest.raises(ValueError, match="unknown topology 'ring4'"):
        build_engine(BuildOptions("k3-tiny", topology="ring4"), str(tmp_path / "e"), log=lambda m: None)
    assert os.listdir(tmp_path) == []


def test_checkpoint_tokenizer_files_are_copied(tmp_path):
    from k3compile.engine.emit import _copy_tokenizer

    src = tmp_path / "ckpt"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenization_kimi.py", "model.safetensors"):
        (src / name).write_text(name)
    _copy_tokenizer(str(src), str(tmp_path / "tok"))
    assert sorted(os.listdir(tmp_path / "tok")) == ["tokenization_kimi.py", "tokenizer.json", "tokenizer_config.json"]
