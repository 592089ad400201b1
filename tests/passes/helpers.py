"""Shared pieces of the pass tests: captured graphs (captured once per session), expected match
counts derived from the model config, and running graphs / the eager model on identical inputs."""
from __future__ import annotations

import collections
import functools
import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile
from k3compile.capture import capture_step, step_args
from k3compile.model_def.batch import ForwardBatch
from k3compile.model_def.cache import CacheTensors
from k3compile.passes.manager import snapshot
from k3compile.passes.registry import get_pass
from k3compile.passes.verify import randomized_inputs, rel_err, run_graph, step_inputs

MODELS = ("k3-tiny", "kimi-linear-tiny")
MODES = ("decode", "prefill")
FP32_TOL, BF16_TOL = 1e-5, 1e-2


@functools.lru_cache(maxsize=None)
def model(name: str, dtype: torch.dtype = torch.float32):
    return k3compile.load_model(name, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _captured(name: str, mode: str, dtype: torch.dtype):
    return capture_step(model(name, dtype), mode)


def graph(name: str, mode: str, dtype: torch.dtype = torch.float32):
    """A private copy of the captured graph (shares weights; passes never write weights in place)."""
    return snapshot(_captured(name, mode, dtype))


@functools.lru_cache(maxsize=None)
def _passed(name: str, mode: str, dtype: torch.dtype, passes: tuple):
    gm = graph(name, mode, dtype)
    for p in passes:
        run_pass(gm, p)
    return gm


def graph_after(name: str, mode: str, dtype: torch.dtype = torch.float32, passes: tuple = ()):
    """A private copy of the captured graph after `passes` at their default options. Each (graph, passes) is run
    once per process: the earlier passes' fake-tensor propagation is most of a pass test's CPU time."""
    return snapshot(_passed(name, mode, dtype, tuple(passes)))


UP_TO_P7 = ("p01_gemm_merge", "p02_noop_views", "p03_casts_copies_dce", "p04_fused_routing", "p05_fused_kda_decode",
            "p06_fused_moe_decode", "p07_attn_res_norm", "p07_norm_route")  # the passes before P8 (defaults)


@functools.lru_cache(maxsize=None)
def _after_p8(name: str, mode: str, choice: str):
    gm = graph_after(name, mode, torch.bfloat16, UP_TO_P7)
    run_pass(gm, "p08_small_m_gemm", choice=choice)
    return gm


def graph_after_p8(name: str, mode: str = "decode", choice: str = "gemv"):
    """A private copy of the bf16 graph after P1-P7 and P8 with `choice` (run once per graph and process): what the
    passes after P8 that fold into k3.gemv nodes match on."""
    return snapshot(_after_p8(name, mode, choice))


def run_pass(gm, name: str, **options) -> int:
    spec = get_pass(name)
    cfg = spec.config_cls(**options)
    matches = spec.run(gm, cfg)
    gm.graph.lint()
    gm.recompile()
    return matches


def op_counts(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def assert_pass_leaves_alone(gm, name: str) -> None:
    """The pass matches nothing in gm and leaves its code as it was."""
    code = gm.code
    assert run_pass(gm, name) == 0 and gm.code == code


def assert_one_graph_node(op, args) -> None:
    """A symbolic trace of op(*args) is one call of op (its outputs read through getitem)."""
    gm = make_fx(lambda *a: op(*a), tracing_mode="symbolic")(*args)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert calls == [op]


# ----------------------------------------------------------------------------- expected counts

def layer_counts(cfg) -> dict:
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers), "moe": moe,
            "dense": cfg.num_hidden_layers - moe, "layers": cfg.num_hidden_layers}


def attn_res_reads_with_weights(cfg) -> int:
    """AttnRes reads that run the softmax (the one over a single source is skipped): 2 per layer
    + the final read, minus layer 0's attention read (the bank is still empty then)."""
    return 0 if cfg.attn_res_block_size is None else 2 * cfg.num_hidden_layers


# ----------------------------------------------------------------------------- running

def inputs_for(name: str, mode: str, dtype=torch.float32, seed: int = 0) -> list:
    """The capture example batch with random tokens and random pool contents."""
    return randomized_inputs(step_inputs(model(name, dtype), mode, seed=seed), seed)


def eager_step(m, mode: str, inputs) -> tuple[list, list]:
    """The eager model's step on a private copy of `inputs`: (outputs, inputs after)."""
    class _Eager(torch.nn.Module):
        def forward(self, *a):
            return m.step_tensors(mode, *a)
    return run_graph(_Eager(), inputs)


def assert_same_step(got, want, tol: float, what: str = "") -> None:
    """got/want: (outputs, inputs after) from run_graph / eager_step."""
    (out_a, in_a), (out_b, in_b) = got, want
    for i, (a, b) in enumerate(list(zip(out_a, out_b)) + list(zip(in_a, in_b))):
        if isinstance(b, torch.Tensor):
            err = rel_err(a, b)
            assert err <= tol, f"{what}: tensor {i} differs: rel err {err:.3g} > {tol:g}"


def assert_as_before_and_close_to_eager(gm, before, name: str, seeds=(0, 1), mode: str = "decode") -> None:
    """A bf16 graph after a fusion pass whose CPU op is the pair it replaced: the graph before the pass bit for bit,
    and the eager model within BF16_TOL, on each seed's inputs."""
    for seed in seeds:
        x = inputs_for(name, mode, torch.bfloat16, seed=seed)
        got = run_graph(gm, x)
        assert_same_step(got, run_graph(before, x), 0.0, "vs the graph before the pass")
        assert_same_step(got, eager_step(model(name, torch.bfloat16), mode, x), BF16_TOL, "vs eager model")


def other_batch(m, mode: str, seed: int = 1) -> list:
    """A batch of another size than the capture example (5 requests), random tokens and pools."""
    page = 4
    cache = CacheTensors.allocate(m.cache_spec(), 8, 40, page)
    gen = torch.Generator().manual_seed(seed)
    new = [1] * 5 if mode == "decode" else [3, 1, 6, 2, 4]
    prefix = [2, 7, 0, 5, 9]
    tokens = [torch.randint(0, m.config.vocab_size, (n,), generator=gen).tolist() for n in new]
    table = [[1 + r * 6 + j for j in range(6)] for r in range(5)]
    batch = ForwardBatch.build(mode, tokens, prefix, table, [3, 1, 4, 7, 2], page)
    return randomized_inputs(list(step_args(batch, cache)), seed)
