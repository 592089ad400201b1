"""Executor: the bucket-padding path (what CUDA graphs replay; on CPU without capture) leaves every real
request's logits and state exactly as an explicitly padded eager batch computes them, and within rounding
of the unpadded batch; stale rows of a bigger earlier batch are reset to padding. The GPU tests replay
real CUDA graphs (model and engine)."""
import pytest
import torch

from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.loader import load_model
from k3compile.runtime.executor import Executor, next_bucket, step_function

PAGE, MAX_CONTEXT = 4, 32
MAX_PAGES = MAX_CONTEXT // PAGE


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", dtype=torch.float32)


def prefilled(model, n_req):
    """Pools with n_req requests (slots 1.., pages 1..) holding different-length prompts."""
    device = next(model.parameters()).device
    cache = CacheTensors.allocate(model.cache_spec(), n_req + 2, n_req * MAX_PAGES + 2, PAGE, device)
    g = torch.Generator().manual_seed(0)
    lens = [3 + 2 * i for i in range(n_req)]
    tables = [list(range(1 + i * MAX_PAGES, 1 + (i + 1) * MAX_PAGES)) for i in range(n_req)]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    model.step(ForwardBatch.build("prefill", prompts, [0] * n_req, tables, list(range(1, n_req + 1)), PAGE,
                                  device=device), cache)
    return cache, lens, tables


def clone(cache):
    return CacheTensors(ssm=cache.ssm.clone(), conv=cache.conv.clone(), kv=cache.kv.clone(), page_size=cache.page_size)


def decode_batch(reqs, lens, tables, tok, device="cpu"):
    """A decode batch over the requests `reqs` (indices), page tables cut to the pages in use."""
    return ForwardBatch.build("decode", [[tok + r] for r in reqs], [lens[r] for r in reqs],
                              [tables[r][: lens[r] // PAGE + 1] for r in reqs], [r + 1 for r in reqs], PAGE,
                              device=device)


def explicitly_padded(batch, bucket):
    """What the executor should run: the batch plus sink requests (token 0, slot 0, page 0, length 1),
    with the page table widened to MAX_PAGES."""
    b, dev = batch.batch_size, batch.input_ids.device
    pad = bucket - b
    table = torch.zeros(bucket, MAX_PAGES, dtype=torch.int32, device=dev)
    table[:b, : batch.page_table.shape[1]] = batch.page_table
    cat = lambda x, v: torch.cat([x, torch.full((pad,), v, dtype=x.dtype, device=dev)])  # noqa: E731
    return (cat(batch.input_ids, 0), torch.arange(bucket + 1, dtype=torch.int32, device=dev), cat(batch.seq_lens, 1),
            table, cat(batch.state_slots, 0), cat(batch.out_cache_loc, 0), torch.arange(bucket, device=dev))


def check_padding(provider, model, tol, exact=True, **executor_kw):
    """Drive `provider` through the executor over shrinking batches; compare with explicit padding
    (exactly, unless the kernels accumulate with atomics) and with unpadded batches (within tol)."""

    def same(a, b):
        if exact:
            assert torch.equal(a, b)
        else:  # bf16 grouped-GEMM experts sum their top-k outputs with atomic adds: order varies run to run
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    n_req = 5
    cache, lens, tables = prefilled(model, n_req)
    dev = cache.kv.device
    ref, unpadded = clone(cache), clone(cache)
    ex = Executor(provider, cache, buckets=(2, 4, 8), max_context=MAX_CONTEXT, **executor_kw)
    plain = Executor(provider, unpadded, cuda_graphs=False)  # no padding: each batch at its own size
    # 5 -> bucket 8, then 3 -> bucket 4 (rows 3..4 of the bigger batch must turn back into padding), then 2
    for step, reqs in enumerate([[0, 1, 2, 3, 4], [0, 2, 4], [1, 3]]):
        batch = decode_batch(reqs, lens, tables, 10 * step, dev)
        bucket = next_bucket(len(reqs), ex.buckets)
        got = ex.run(batch).clone()
        want = provider.step_tensors("decode", *explicitly_padded(batch, bucket), ref.ssm, ref.conv, ref.kv)
        assert got.shape == (len(reqs), model.config.vocab_size)
        same(got, want[:len(reqs)])
        torch.testing.assert_close(got, plain.run(batch), rtol=tol, atol=tol)
        for r in reqs:
            lens[r] += 1
    real_slots, real_pages = slice(1, n_req + 1), slice(1, None)
    same(cache.ssm[real_slots], ref.ssm[real_slots])
    same(cache.conv[real_slots], ref.conv[real_slots])
    same(cache.kv[real_pages], ref.kv[real_pages])
    torch.testing.assert_close(cache.ssm[real_slots], unpadded.ssm[real_slots], rtol=tol, atol=tol)
    torch.testing.assert_close(cache.kv[real_pages].float(), unpadded.kv[real_pages].float(), rtol=tol, atol=tol)
    # the padding only ever touched the sinks: slot 0 / page 0 (slot n_req + 1 and the last page are unused)
    assert torch.equal(cache.ssm[n_req + 1], torch.zeros_like(cache.ssm[0]))
    assert torch.equal(cache.kv[-1], torch.zeros_like(cache.kv[0]))


def test_padded_path_equals_explicit_padding_and_matches_unpadded(model):
    check_padding(model, model, 1e-5, pad_to_buckets=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_explicit_padding(dtype):
    """bf16 on sm90 runs the grouped-GEMM experts: their graph capture must not sync with the host."""
    model = load_model("k3-tiny", dtype=dtype, device="cuda")
    fp32 = dtype == torch.float32
    check_padding(model, model, 1e-5 if fp32 else 2e-2, exact=fp32, cuda_graphs=True)


@pytest.mark.gpu
def test_cuda_graph_replay_of_an_engine(tmp_path):
    from k3compile.engine import Engine
    from k3compile.engine.build import BuildOptions, build_engine
    from k3compile.passes.pipeline import PipelineConfig

    build_engine(BuildOptions("k3-tiny", dtype=torch.bfloat16, device="cuda", pipeline=PipelineConfig.default()),
                 str(tmp_path / "e"), log=lambda m: None)
    engine = Engine.load(str(tmp_path / "e"), device="cuda")
    model = load_model("k3-tiny", dtype=torch.bfloat16, device="cuda")
    check_padding(engine, model, 2e-2, exact=False, cuda_graphs=True)


def test_prefill_and_oversized_batches_run_eagerly(model):
    cache, lens, tables = prefilled(model, 3)
    ref = clone(cache)
    ex = Executor(model, cache, pad_to_buckets=True, buckets=(1, 2), max_context=MAX_CONTEXT)
    batch = decode_batch([0, 1, 2], lens, tables, 7)  # 3 > largest bucket
    assert torch.equal(ex.run(batch), model.step(batch, ref))
    pre = ForwardBatch.build("prefill", [[5, 6]], [lens[0] + 1], [tables[0]], [1], PAGE)
    assert torch.equal(ex.run(pre), model.step(pre, ref))


def test_bad_inputs_are_refused(model):
    cache, lens, tables = prefilled(model, 2)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Executor(model, cache, cuda_graphs=True)
    with pytest.raises(TypeError, match="not a step provider"):
        step_function(object(), "decode")
    ex = Executor(model, cache, pad_to_buckets=True, buckets=(4,), max_context=8)
    long = decode_batch([1], [20, 20], tables, 1)
    with pytest.raises(ValueError, match=r"context \(21 tokens\) exceeds this executor's max_context \(8\)"):
        ex.run(long)
    with pytest.raises(ValueError, match="has no prefill step"):
        Executor({"decode": lambda *a: None}, cache).run(ForwardBatch.build("prefill", [[1]], [0], [[1]], [1], PAGE))
