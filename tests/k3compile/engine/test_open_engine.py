"""open_engine: one place reads an engine directory (engine, tokenizer, dtype, page size, decode
buckets), and LLMEngine runs with the settings `build` wrote, not its own defaults."""
import json
import shutil

import pytest

from k3compile.engine import open_engine
from k3compile.runtime.engine import EngineArgs, LLMEngine


@pytest.fixture(scope="module")
def engine_dir(built_engine, tmp_path_factory):
    """A copy of the k3-tiny engine whose engine.json says page size 8 and decode buckets 1, 2, 3."""
    _, path = built_engine("k3-tiny")
    copy = tmp_path_factory.mktemp("open") / "tiny"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    manifest.update(page_size=8, decode_buckets=[1, 2, 3])
    (copy / "engine.json").write_text(json.dumps(manifest))
    return str(copy)


def test_open_engine_reads_everything(engine_dir):
    opened = open_engine(engine_dir)
    assert (opened.dtype, opened.page_size, opened.decode_buckets) == ("fp32", 8, (1, 2, 3))
    assert opened.tokenizer is not None and opened.tokenizer.decode(opened.tokenizer.encode("hi", add_bos=False)) == "hi"
    assert opened.engine.config.name == "k3-tiny"


def test_llm_engine_runs_with_the_engines_settings(engine_dir):
    engine = LLMEngine(EngineArgs(model=None, engine_dir=engine_dir, memory_bytes=8 << 20, pad_decode_batches=True))
    assert engine.args.page_size == 8 and engine.scheduler.cfg.page_size == 8
    assert engine.memory.tensors.page_size == 8
    assert engine.runner.executor.buckets == (1, 2, 3)
    assert engine.args.dtype == "fp32" and engine.tokenizer is not None
    out = engine.generate([[1, 2, 3], [4, 5]], engine_args_params())
    assert [len(o) for o in out] == [3, 3]
    engine.close()
    # given explicitly, the flags win; a different dtype is refused
    engine = LLMEngine(EngineArgs(model=None, engine_dir=engine_dir, memory_bytes=8 << 20, page_size=16))
    assert engine.args.page_size == 16
    engine.close()
    with pytest.raises(ValueError, match="built for fp32, not dtype bf16"):
        LLMEngine(EngineArgs(model=None, engine_dir=engine_dir, dtype="bf16", memory_bytes=8 << 20))


def engine_args_params():
    from k3compile.runtime.sampling import SamplingParams
    return SamplingParams(max_new_tokens=3, ignore_eos=True)
