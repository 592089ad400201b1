"""Graph surgery helpers shared by the passes.

Contract every pass keeps: each node it creates gets `meta["val"]` (a fake tensor with symbolic
sizes, as make_fx leaves on captured nodes), so later passes can ask shapes, strides and dtypes.
`set_meta_val` computes it by running the node's op on its inputs' fake values.
"""
from __future__ import annotations

import operator
import re

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


# --------------------------------------------------------------------------------- fake metadata

def fake_mode_of(gm: GraphModule):
    """The FakeTensorMode (with its ShapeEnv) the graph was traced under."""
    for n in gm.graph.nodes:  # the first fake value names it (all share one mode)
        mode = getattr(n.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])
    if mode is None:
        raise ValueError("graph has no fake-tensor metadata (meta['val']); capture it with k3compile.capture")
    return mode


def _val(a):
    if isinstance(a, Node):
        if "val" not in a.meta:
            raise ValueError(f"node {a.name} has no meta['val']; the pass that made it must set it")
        return a.meta["val"]
    if isinstance(a, (list, tuple)):
        return type(a)(_val(x) for x in a)
    return a


def set_meta_val(node: Node, fake_mode=None) -> None:
    """Fill `node.meta['val']` by running its op on the fake values of its inputs."""
    if node.op != "call_function":
        raise ValueError(f"set_meta_val handles call_function nodes, got {node.op} {node.name}")
    args, kwargs = _val(node.args), {k: _val(v) for k, v in node.kwargs.items()}
    if node.target is operator.getitem:
        node.meta["val"] = args[0][args[1]]
        return
    mode = fake_mode or fake_mode_of(node.graph.owning_module)
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _same_meta(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return same_layout(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (not isinstance(a, torch.Tensor))


def replace_uses(old: Node, new: Node, fake_mode=None) -> None:
    """`old.replace_all_uses_with(new)`, then recompute meta['val'] downstream wherever the new
    input's layout (e.g. strides of a column block) makes a user's result differ from before.
    Propagation stops at users whose result is unchanged (most ops return fresh contiguous tensors)."""
    users = list(old.users)
    old.replace_all_uses_with(new)
    a, b = old.meta.get("val"), new.meta.get("val")
    if a is not None and b is not None and _same_meta(a, b):
        return
    refresh_meta(users, fake_mode)


def refresh_meta(nodes, fake_mode=None) -> None:
    """Recompute meta['val'] of `nodes` and, transitively, of users whose value changes."""
    nodes = [n for n in nodes if n.op == "call_function"]
    if not nodes:
        return
    graph = nodes[0].graph
    mode = fake_mode or fake_mode_of(graph.owning_module)
    order = None
    todo = {n: None for n in nodes}
    while todo:
        if len(todo) > 1:  # topological: inputs are refreshed before their users
            order = order or {n: i for i, n in enumerate(graph.nodes)}
            node = min(todo, key=order.__getitem__)
        else:
            node = next(iter(todo))
        del todo[node]
        old = node.meta.get("val")
        set_meta_val(node, mode)
        if old is None or not _same_meta(old, node.meta["val"]):
            todo.update({u: None for u in node.users if u.op == "call_function"})


def val_of(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def known_equal(a, b) -> bool:
    """True only when sizes a and b (ints or SymInts) are provably equal; unknown counts as False."""
    return statically_known_true(a == b)


def same_sizes(a, b) -> bool:
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same sizes, strides and storage offset, provably (symbolic sizes compared, never guessed)."""
    return (a.dtype == b.dtype and same_sizes(a.shape, b.shape) and same_sizes(a.stride(), b.stride())
            and known_equal(a.storage_offset(), b.storage_offset()))


def is_contiguous(t: torch.Tensor) -> bool:
    """Provably row-major contiguous (dims of size 1 may have any stride)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not (known_equal(size, 1) or known_equal(stride, expected)):
            return False
        expected = expected * size
    return True


# --------------------------------------------------------------------------------- constants

def attr_tensor(gm: GraphModule, node: Node) -> torch.Tensor:
    """The tensor a get_attr node reads."""
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


def _safe_name(hint: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", hint)


def add_constant(gm: GraphModule, name_hint: str, tensor: torch.Tensor, before: Node, fake_mode=None) -> Node:
    """Register `tensor` as a buffer named after `name_hint` (made unique) and read it before `before`."""
    name, i = _safe_name(name_hint), 1
    while hasattr(gm, name):
        i += 1
        name = f"{_safe_name(name_hint)}_{i}"
    gm.register_buffer(name, tensor, persistent=True)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta["val"] = (fake_mode or fake_mode_of(gm)).from_tensor(tensor, static_shapes=True)
    return node


def drop_unused_constants(gm: GraphModule, names=None) -> list[str]:
    """Delete top-level tensor attributes (buffers, parameters, constants) no get_attr node reads.
    `names` limits the candidates (a pass removes only what it made dead)."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    tensors = {k for k, v in vars(gm).items() if isinstance(v, torch.Tensor)}
    tensors |= set(gm._buffers) | set(gm._parameters)
    dropped = []
    for name in sorted(tensors if names is None else set(names) & tensors):
        if name not in used:
            delattr(gm, name)
            dropped.append(name)
    return dropped


# --------------------------------------------------------------------------------- purity and DCE

_PURE_PY_MODULES = ("_operator", "operator", "math")


def is_impure(node: Node) -> bool:
    """A node DCE must keep even without users: graph inputs/outputs, anything that writes memory
    (k3 pool ops, in-place aten ops: any schema with a mutable argument or a trailing `_` name),
    random ops, and any callable we do not know to be pure."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    if node.op != "call_function":
        return True  # call_module / call_method: unknown effects
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        if t._schema.is_mutable or t._schema.name.split("::")[-1].endswith("_"):
            return True
        return node.is_impure()  # random / effectful ops, per torch's own table
    if isinstance(t, torch._ops.HigherOrderOperator):
        return True
    if getattr(t, "__module__", None) in _PURE_PY_MODULES or t in (torch.sym_float, torch.sym_int, torch.sym_max,
                                                                   torch.sym_min, torch.sym_not):
        return False
    return True


def eliminate_dead_code(gm: GraphModule) -> dict[str, int]:
    """Remove nodes whose results are unused and that have no side effects.
    Returns how many were removed per node kind ({"call_function": n, "get_attr": m})."""
    removed = {"call_function": 0, "get_attr": 0}
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and not is_impure(node):
            removed[node.op] = removed.get(node.op, 0) + 1
            gm.graph.erase_node(node)
    return removed


def erase_if_dead(gm: GraphModule, nodes) -> int:
    """Erase those of `nodes` that are unused and pure, repeating as erasing frees their inputs."""
    pending, removed, changed = list(dict.fromkeys(nodes)), 0, True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users and not is_impure(node):
                gm.graph.erase_node(node)
                pending.remove(node)
                removed, changed = removed + 1, True
    return removed


def erase_subgraph(gm: GraphModule, nodes) -> None:
    """Erase a matched pattern whose outputs were already rewired (in-place ops inside it included).
    Raises if a node still has a user outside the set: that would be a pass bug."""
    nodes = set(nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        outside = [u.name for u in node.users if u not in nodes]
        if outside:
            raise RuntimeError(f"cannot erase {node.name}: still used by {outside}")
        gm.graph.erase_node(node)


def getitem_outputs(node: Node) -> dict:
    """index -> the getitem node reading that output (each output read at most once, by a getitem);
    {} when any user is something else or reads an output twice."""
    out = {}
    for u in node.users:
        if u.target is not operator.getitem or u.args[1] in out:
            return {}
        out[u.args[1]] = u
    return out


def args_with_defaults(node: Node) -> tuple:
    """A call node's positional args with the trailing ones it leaves out spelled as its op schema's defaults
    (a node made before an op grew an argument keeps the shorter form)."""
    schema = node.target._schema.arguments
    return tuple(node.args) + tuple(a.default_value for a in schema[len(node.args):])


def is_call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def view_root(node: Node) -> Node:
    """Follow view ops (outputs that alias their first input) back to the tensor that owns the memory."""
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
           and node.args and isinstance(node.args[0], Node)):
        node = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node):
        src = node.args[0]
        if src.op == "call_function" and isinstance(src.target, torch._ops.OpOverload) and src.target.is_view:
            return view_root(src)
    return node


def mutated_roots(gm: GraphModule) -> set[Node]:
    """Nodes whose memory some op writes in place (through any chain of views)."""
    roots = set()
    for node in gm.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
            continue
        for i, arg in enumerate(t._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            val = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in (val if isinstance(val, (list, tuple)) else [val]):
                if isinstance(v, Node):
                    roots.add(view_root(v))
    return roots
