"""Capture a model_def step (decode / prefill chunk / verify) as a torch.fx GraphModule.

Why make_fx and not torch.export: the steps mutate the KV / state pools in place through `k3::`
custom ops. torch.export functionalizes those mutations into `auto_functionalized` nodes plus
copy-backs, which every pass would have to see through and which break the "pools are fixed
buffers" contract CUDA graphs need (the pitfalls vLLM's FixFunctionalizationPass exists for).
make_fx without functionalization keeps each stateful op as one in-place node, traces plain
modules to ATen ops (linear -> t + mm), and with symbolic shapes one graph serves every batch
size / token count. Parameters are lifted to get_attr constants named after the parameter.
"""
from __future__ import annotations

import re

import torch
import torch.fx.experimental._config as fx_config
from torch.fx.experimental.proxy_tensor import make_fx

# The step contract (modes, inputs, step_args) lives in model_def; re-exported for the passes and benches.
from k3compile.model_def.batch import MODES, STEP_INPUTS, ForwardBatch, step_args  # noqa: F401
from k3compile.model_def.cache import CacheTensors
from k3compile.model_def.draft_window import VERIFY_MODES, WINDOW_MODES, DraftWindow, DraftWindowSpec, step_input_names

# node.meta key naming the pass that created a node (the pass manager sets it; engines store it so
# reports can attribute kernels); here, below both passes and the engine format, so both can read it
PASS_META = "k3_pass"


def example_batch(mode: str, cache: CacheTensors, device) -> ForwardBatch:
    """A small batch whose sizes are all >= 2 and distinct, so symbolic tracing does not specialize them."""
    n_req, page = 3, cache.page_size
    new = [1, 1, 1] if mode == "decode" else [2, 5, 3]
    if mode in VERIFY_MODES:
        new = [4, 4, 4]  # gamma + 1 = 4 per request, as an executor bucket pads them
    prefix = [3, 0, 6]
    max_pages = 4
    table = [[1 + r * max_pages + j for j in range(max_pages)] for r in range(n_req)]
    return ForwardBatch.build(mode, [[1] * n for n in new], prefix, table, [1, 2, 3], page, device=device,
                              max_pages=max_pages, logits="all" if mode in VERIFY_MODES else "last")


def _param_attr_name(name: str) -> str:
    return "w_" + re.sub(r"[^0-9a-zA-Z_]", "_", name)


@torch.no_grad()
def capture_step(model: torch.nn.Module, mode: str, page_size: int = 4) -> torch.fx.GraphModule:
    """Trace `model.step_tensors(mode, ...)` to an ATen-level GraphModule with symbolic sizes."""
    if mode not in MODES + VERIFY_MODES:
        raise ValueError(f"unknown step mode {mode!r}; expected one of {MODES + VERIFY_MODES}")
    device = model.lm_head.weight.device
    spec = model.cache_spec()
    cache = CacheTensors.allocate(spec, 4, 16, page_size, device)
    args = step_args(example_batch(mode, cache, device), cache)
    if mode in VERIFY_MODES:  # the draft window's rows and positions are symbolic too (5 x 6: distinct sizes)
        args += DraftWindow.allocate(DraftWindowSpec(spec, 6, WINDOW_MODES[mode]), 5, device).tensors()

    def step(*a):
        return model.step_tensors(mode, *a)

    # Parameters are real tensors closed over by the trace: allow them next to the fake inputs.
    # No duck shaping: otherwise sizes that merely happen to be equal in the example (batch size and
    # the number of MLA layers, say) share one symbol, and passes would treat them as the same size.
    with fx_config.patch(use_duck_shape=False):
        gm = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
    _name_inputs(gm, step_input_names(mode))
    _name_params(gm, model)
    gm.meta["k3"] = {"mode": mode, "inputs": list(step_input_names(mode))}
    shard = getattr(model, "shard", None)
    if shard is not None:  # one rank of a parallel engine: the communication passes need to know which
        gm.meta["k3"]["shard"] = {"rank": shard.rank, "world": shard.world, "topology": shard.topology.name}
    gm.recompile()
    return gm


def _name_inputs(gm: torch.fx.GraphModule, names) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node.name = node.target = name


def _name_params(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """make_fx names lifted weights `_param_constantN`; rename them after the parameters they are."""
    by_ptr = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        by_ptr.setdefault((t.data_ptr(), tuple(t.shape), t.dtype), name)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = getattr(gm, node.target)
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key not in by_ptr:
            continue  # a constant made during tracing (not a parameter): keep make_fx's name
        new = _param_attr_name(by_ptr[key])
        if not hasattr(gm, new):
            gm.register_buffer(new, t, persistent=True)
        delattr(gm, node.target)
        node.target = new
        node.name = new
