"""GPU: through the captured verify graph with the default pipeline (P16 included), a verify step + commit
leaves the KDA state P5's fused decode kernel writes when it decodes the accepted tokens, bit for bit.

What "the same" means: P5 decodes each layer from that layer's inputs (x_q, x_k, x_v after the input
GEMM, f, the beta logits); a verify step computes those inputs with other GEMM shapes ([B*n, D] rows
instead of [B, D]) and other attention kernels upstream, so a whole model's speculative and
non-speculative states cannot be compared bit for bit. The claim checked here is the one ReplaySSM makes:
given the inputs each KDA layer received in the verify graph (recorded while it runs), verify + fold
commits exactly what P5 commits decoding those inputs one token at a time. Without P16 the window holds
torch's conv/exp/sigmoid and this fails by ulps (the pass is what makes it hold).

`verify_vs_p5` also runs on CPU under TRITON_INTERPRET=1 (P5 interpreted, the op's CPU reference), where
it can only agree to rounding: tests/passes/kernels/interpret_kda_verify_inputs.py's neighbour check.
"""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


def verify_vs_p5(name: str, dtype, dev: str = "cuda", batch: int = 3, length: int = 4, accept=(4, 1, 3),
                 p16: bool = True):
    """(pools after verify graph + commit, pools after P5 decoding the accepted tokens, P16's match count).
    p16=False: the default pipeline without P16 (the control: the window then holds torch's arithmetic)."""
    from k3compile.capture import capture_step
    from k3compile.model_def.batch import ForwardBatch, step_args
    from k3compile.model_def.cache import CacheTensors
    from k3compile.model_def.draft_window import DraftWindow, DraftWindowSpec
    from k3compile.model_def.loader import load_model
    from k3compile.model_def.ops.kda_launch import DEFAULT_LAYOUT, v_split_for
    from k3compile.passes.kernels.kda_decode import fused_kda_decode_triton
    from k3compile.passes.kernels.kda_verify_inputs import kda_verify_inputs  # noqa: F401
    from k3compile.passes import p16_kda_verify_inputs as p16_pass
    from k3compile.passes.manager import PassManager
    from k3compile.passes.pipeline import PipelineConfig
    from k3compile.runtime.spec.fold_kernel import commit

    conv_op = torch.ops.k3.short_conv_verify.default
    model = load_model(name, dtype=dtype, device=dev)
    gm = capture_step(model, "verify")
    pipeline = PipelineConfig.default()
    pipeline.config("p16_kda_verify_inputs").enabled = p16
    report = PassManager(pipeline).run(gm, None).to_dict()
    matches = next((r["matches"] for r in report["passes"] if r["name"] == "p16_kda_verify_inputs"), 0)
    spec = model.cache_spec()
    gen = torch.Generator().manual_seed(0)
    slots = [5, 1, 3][:batch]
    cache = CacheTensors.allocate(spec, 8, 16, 4, device=dev)
    for t in (cache.ssm, cache.conv, cache.kv):
        t.copy_((torch.randn(t.shape, generator=gen) * 0.3).to(t.dtype))
    p5 = CacheTensors.allocate(spec, 8, 16, 4, device=dev)
    for a, b in ((p5.ssm, cache.ssm), (p5.conv, cache.conv), (p5.kv, cache.kv)):
        a.copy_(b)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).tolist()
    vb = ForwardBatch.build("verify", ids, [6, 3, 9][:batch], [[1, 2, 3], [4, 5], [6, 7, 8, 9]][:batch], slots, 4,
                            device=dev, logits="all")
    window = DraftWindow.allocate(DraftWindowSpec(spec, length), batch, device=dev)

    # each KDA layer's inputs as the graph computes them, found by P16's own matcher (it erases nothing, so the
    # chains are there with or without the pass): x_k, x_v, w_k, w_v, f, dt_bias, A_log, b, ..., lower_bound
    kda_verify = torch.ops.k3.kda_verify.default
    layers = {}
    for kda in [n for n in gm.graph.nodes if n.target == kda_verify]:
        args = list(p16_pass._match(kda))
        q_conv = kda.args[0].args[0]  # view(short_conv_verify(x_q, w_q, ...)) -> the q stream's conv
        assert q_conv.target == conv_op and q_conv.args[4] == 0
        layers[kda.args[6]] = args[:8] + list(q_conv.args[:2]) + [args[15]]
    wanted = {a for args in layers.values() for a in args if isinstance(a, torch.fx.Node)}
    seen = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in wanted:
                seen[n] = out.clone()
            return out

    with torch.no_grad():
        Record(gm).run(*step_args(vb, cache), *window.tensors())
    assert torch.equal(cache.ssm, p5.ssm) and torch.equal(cache.conv, p5.conv), "the verify step wrote the state"
    commit(cache, window, slots, list(accept), use_kernel=True, decode_batch=batch)

    h, kd = spec.kda_heads, spec.kda_head_k
    st = torch.tensor(slots, device=dev)
    for t in range(length):  # P5 decodes the accepted tokens, each step the requests that got that far
        rows = [i for i in range(batch) if accept[i] > t]
        pick = lambda x: x.unflatten(0, (batch, length))[rows, t].contiguous()  # noqa: E731
        for layer in sorted(layers):
            got = [seen[a] if isinstance(a, torch.fx.Node) else a for a in layers[layer]]
            x_k, x_v, w_k, w_v, f, dt, a_log, b, x_q, w_q, lower_bound = got
            if dt is None:  # f holds f + dt_bias (P11's addmm)
                dt = torch.zeros(f.shape[-1], dtype=torch.float32, device=dev)
            gate = torch.zeros(len(rows), h, kd, dtype=x_v.dtype, device=dev)  # feeds the output only
            fused_kda_decode_triton(pick(x_q), pick(x_k), pick(x_v), w_q, w_k, w_v, pick(f), dt, a_log, pick(b), gate,
                                    torch.ones(kd, device=dev), p5.conv, p5.ssm, layer, st[rows], lower_bound, 1e-5,
                                    v_split=v_split_for(DEFAULT_LAYOUT, batch, h, kd))  # the op's decode_batch
    return cache, p5, matches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,dtype", [("k3-tiny", torch.bfloat16), ("kimi-linear-tiny", torch.bfloat16),
                                        ("k3-tiny", torch.float32)])
def test_verify_graph_and_fold_commit_what_p5_decodes(name, dtype):
    from k3compile.model_def.loader import load_model
    p16 = os.environ.get("K3_P16_OFF") != "1"  # tools/gpu_p16.sh's control run sets it: then this should fail
    got, want, matches = verify_vs_p5(name, dtype, p16=p16)
    torch.cuda.synchronize()
    assert matches == (len(load_model(name).config.kda_layers) if p16 else 0)
    diff = (got.ssm - want.ssm).abs().max().item()
    assert torch.equal(got.ssm, want.ssm), f"states differ (max abs diff {diff:.3e})"
    assert torch.equal(got.conv, want.conv)
