"""P3 casts, copies and dead code.

In order:
1. Casts of constants (`_to_copy(get_attr W, dtype=d)`, e.g. fp32 norm weights, the fp32 router
   weight and KDA gate parameters of a bf16 model) are done now: W.to(d) becomes a new buffer
   `<W>_<dtype>` and the per-step cast kernel disappears. Exactly the cast the step would do.
2. Redundant casts of activations:
   - a cast to the dtype the tensor already has;
   - a round trip up and back down (`bf16 -> fp32 -> bf16`): exact, so it is the input itself;
   - a chain whose first step is exact widening (`bf16 -> fp32 -> fp64` = `bf16 -> fp64`).
   A round trip down then up (`fp32 -> bf16 -> fp32`) rounds, so it stays.
3. Copies that change nothing: `clone` / same-dtype `_to_copy` whose result has its input's
   layout. Replacing a copy by its input makes the two names alias, so this (and the casts above)
   is done only when no op in the graph writes the input's memory or the copy's memory in place,
   and never when the copy of a graph input is a graph output.
4. Dead-code elimination that keeps every node with side effects (graph_utils.is_impure: the
   `k3::` pool writers, in-place ATen ops, random ops, unknown callables), then drops constants
   nothing reads.

Matches = constants folded + casts removed or shortened + copies removed + dead compute nodes
removed (get_attr nodes made dead are not counted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (add_constant, attr_tensor, drop_unused_constants, eliminate_dead_code, fake_mode_of,
                          is_call, mutated_roots, replace_uses, same_layout, set_meta_val, val_of, view_root)
from .registry import PassConfig, register_pass

aten = torch.ops.aten

# dtype -> the dtypes that represent every one of its values exactly
_EXACT_WIDENING = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass
class CastsCopiesDceConfig(PassConfig):
    fold_constant_casts: bool = True  # cast weights at build time instead of every step
    remove_casts: bool = True
    remove_copies: bool = True
    dce: bool = True


def _plain_cast_dtype(node: Node, src_val: torch.Tensor):
    """The target dtype of `_to_copy(x, dtype=d)` when it changes nothing but the dtype, else None."""
    if not (node.op == "call_function" and node.target == aten._to_copy.default and len(node.args) == 1):
        return None
    kw = dict(node.kwargs)
    dtype = kw.pop("dtype", None)
    if kw.pop("memory_format", None) not in (None, torch.preserve_format):
        return None
    if kw.pop("layout", None) not in (None, torch.strided) or kw.pop("pin_memory", None):
        return None
    kw.pop("non_blocking", None)
    device = kw.pop("device", None)
    if kw or (device is not None and src_val is not None and torch.device(device) != src_val.device):
        return None
    return dtype if dtype is not None else (src_val.dtype if src_val is not None else None)


class _Rewriter:
    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.mutated = mutated_roots(gm)
        self.output = next(n for n in gm.graph.nodes if n.op == "output")

    def can_alias(self, node: Node, src: Node) -> bool:
        """May `node` (a copy of `src`) be replaced by `src` itself?"""
        if node in self.mutated or view_root(src) in self.mutated:
            return False
        if self.output in node.users and view_root(src).op == "placeholder":
            return False  # the caller would get its own input back instead of a new tensor
        out, inp = val_of(node), val_of(src)
        return out is not None and inp is not None and same_layout(out, inp)

    def replace(self, node: Node, src: Node) -> None:
        node.replace_all_uses_with(src)
        self.gm.graph.erase_node(node)


def _calls_on_a_node(gm: GraphModule, target) -> list[Node]:
    """Calls of `target` whose first argument is a graph node (a snapshot: callers edit the graph)."""
    return [n for n in gm.graph.nodes if is_call(n, target) and n.args and isinstance(n.args[0], Node)]


def _fold_constant_casts(gm: GraphModule) -> int:
    folded, made = 0, {}
    fake_mode, written = None, mutated_roots(gm)
    for node in _calls_on_a_node(gm, aten._to_copy.default):
        if node.args[0].op != "get_attr":
            continue
        if node.args[0] in written:
            continue  # a buffer the step updates in place is not a constant
        w_node = node.args[0]
        w = attr_tensor(gm, w_node)
        dtype = _plain_cast_dtype(node, w)
        if dtype is None or not isinstance(w, torch.Tensor):
            continue
        key = (w_node.target, dtype)
        if key not in made:
            fake_mode = fake_mode or fake_mode_of(gm)
            made[key] = add_constant(gm, f"{w_node.target}_{_DTYPE_NAMES.get(dtype, str(dtype))}",
                                     w.detach().to(dtype), before=node, fake_mode=fake_mode)
        replace_uses(node, made[key], fake_mode)
        gm.graph.erase_node(node)
        folded += 1
    return folded


def _remove_casts(gm: GraphModule, rw: _Rewriter) -> int:
    removed = 0
    for node in _calls_on_a_node(gm, aten._to_copy.default):
        src = node.args[0]
        src_val = val_of(src)
        dtype = _plain_cast_dtype(node, src_val)
        if dtype is None or src_val is None:
            continue
        if dtype == src_val.dtype:  # cast to the same dtype: a copy
            if rw.can_alias(node, src):
                rw.replace(node, src)
                removed += 1
            continue
        origin = src.args[0] if is_call(src, aten._to_copy.default) and isinstance(src.args[0], Node) else None
        if origin is None or val_of(origin) is None:
            continue
        if _plain_cast_dtype(src, val_of(origin)) not in _EXACT_WIDENING.get(val_of(origin).dtype, ()):
            continue  # the first step rounds: the chain is not redundant
        if view_root(origin) in rw.mutated:
            continue  # origin may change between the two casts: the first one is a snapshot
        if dtype == val_of(origin).dtype:  # up and back down: exactly the original values
            if rw.can_alias(node, origin):
                rw.replace(node, origin)
                removed += 1
            continue
        old_val = node.meta["val"]
        node.args = (origin,)  # exact widening then a cast: cast the original directly
        set_meta_val(node)
        if same_layout(node.meta["val"], old_val):
            removed += 1
        else:
            node.args, node.meta["val"] = (src,), old_val
    return removed


def _remove_copies(gm: GraphModule, rw: _Rewriter) -> int:
    removed = 0
    for node in _calls_on_a_node(gm, aten.clone.default):
        if node.kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
            continue
        if rw.can_alias(node, node.args[0]):
            rw.replace(node, node.args[0])
            removed += 1
    return removed


@register_pass("p03_casts_copies_dce", CastsCopiesDceConfig)
def casts_copies_dce(gm: GraphModule, config: CastsCopiesDceConfig) -> int:
    """Fold constant casts, drop redundant casts and copies, then dead-code elimination."""
    matches = 0
    if config.fold_constant_casts:
        matches += _fold_constant_casts(gm)
    if config.remove_casts or config.remove_copies:
        rw = _Rewriter(gm)
        if config.remove_casts:
            matches += _remove_casts(gm, rw)
        if config.remove_copies:
            matches += _remove_copies(gm, rw)
    if config.dce:
        matches += eliminate_dead_code(gm)["call_function"]
    drop_unused_constants(gm)
    return matches
