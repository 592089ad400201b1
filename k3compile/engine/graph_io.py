"""Step graphs as JSON, without pickle: what an engine directory stores for each captured step.

A graph file lists the nodes in order. Each node has a name, an op kind and a target:

* `placeholder`: a step input (target = the input's name, one of STEP_INPUTS, in order);
* `get_attr`: a weight (target = its name in the engine's weights file);
* `call_function`: a qualified op name: `aten.mm.default`, `k3.kda_decode.default`,
  `prims.convert_element_type.default`, or `operator.getitem` / `operator.mul` ... for tuple
  outputs and SymInt arithmetic;
* `output`.

Arguments are JSON values. Plain ints, floats, bools, None, strings and lists stand for themselves;
everything else is a one-key object: {"node": name}, {"tuple": [...]}, {"dtype": "bfloat16"},
{"device": "cuda:0"}, {"layout": "strided"}, {"memory_format": "contiguous_format"},
{"float": "inf"} (non-finite floats, which JSON cannot spell).

Loading rebuilds the torch.fx graph from a whitelist: ops of the aten, k3 and prims namespaces and
a fixed set of `operator` functions. Anything else (another namespace, an arbitrary Python callable,
call_module / call_method nodes) is refused with an error naming the node, so a graph file can
never make the loader call code it did not choose.
"""
from __future__ import annotations

import keyword
import math
import operator

import torch
import torch.fx

from k3compile.capture import PASS_META  # node.meta key: the pass that created a node

GRAPH_FORMAT = "k3compile.fx-graph/1"
OP_NAMESPACES = ("aten", "k3", "prims")
# SymInt arithmetic and tuple indexing: the only Python callables a make_fx graph holds
OPERATORS = {name: getattr(operator, name) for name in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow",
    "eq", "ne", "lt", "le", "gt", "ge")}
_OPERATOR_NAMES = {fn: name for name, fn in OPERATORS.items()}

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2)}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
                   "channels_last": torch.channels_last}


class GraphFormatError(ValueError):
    """A graph that cannot be written or read (names the node and the problem)."""


# ----------------------------------------------------------------------------------------- write

def op_name(target) -> str:
    """The qualified name stored for a call_function target."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.mm.default"
    if target in _OPERATOR_NAMES:
        return f"operator.{_OPERATOR_NAMES[target]}"
    raise GraphFormatError(f"call target {target!r} cannot be stored: only torch op overloads of "
                           f"{OP_NAMESPACES} and operator.{{{', '.join(OPERATORS)}}} are allowed")


def _encode(v, where: str):
    if isinstance(v, torch.fx.Node):
        return {"node": v.name}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x, where) for x in v]}
    if isinstance(v, list):  # includes fx's immutable_list
        return [_encode(x, where) for x in v]
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise GraphFormatError(f"{where}: a symbolic value ({v}) appears as a constant instead of a node")
    raise GraphFormatError(f"{where}: argument of type {type(v).__name__} ({v!r}) cannot be stored")


def graph_to_dict(gm: torch.fx.GraphModule, mode: str, weight_keys: dict[str, str]) -> dict:
    """The JSON-ready description of `gm`; `weight_keys` maps each get_attr target to its weights-file key."""
    nodes = []
    for n in gm.graph.nodes:
        where = f"{mode} graph, node {n.name}"
        entry = {"name": n.name, "op": n.op}
        if n.op == "placeholder":
            entry["target"] = n.target
        elif n.op == "get_attr":
            entry["target"] = weight_keys[n.target]
        elif n.op == "call_function":
            entry["target"] = op_name(n.target)
        elif n.op != "output":
            raise GraphFormatError(f"{where}: {n.op} nodes cannot be stored (flatten the graph first)")
        if n.op in ("call_function", "output"):
            entry["args"] = _encode(tuple(n.args), where)["tuple"]
            entry["kwargs"] = {k: _encode(v, where) for k, v in n.kwargs.items()}
        if isinstance(n.meta.get(PASS_META), str):  # provenance for trace attribution (engine/attribution.py)
            entry["pass"] = n.meta[PASS_META]
        nodes.append(entry)
    return {"format": GRAPH_FORMAT, "mode": mode, "nodes": nodes}


# ------------------------------------------------------------------------------------------ read

def resolve_op(name: str, where: str):
    """`aten.mm.default` -> torch.ops.aten.mm.default, from the whitelist only."""
    if not isinstance(name, str):
        raise GraphFormatError(f"{where}: call target must be a string, got {name!r}")
    parts = name.split(".")
    if parts[0] == "operator":
        if len(parts) != 2 or parts[1] not in OPERATORS:
            raise GraphFormatError(f"{where}: '{name}' is not an allowed operator function "
                                   f"(allowed: {', '.join(OPERATORS)})")
        return OPERATORS[parts[1]]
    if parts[0] not in OP_NAMESPACES:
        raise GraphFormatError(f"{where}: op '{name}' is outside the allowed namespaces {OP_NAMESPACES}")
    if len(parts) != 3 or not all(p.isidentifier() for p in parts):
        raise GraphFormatError(f"{where}: op name '{name}' is not of the form namespace.op.overload")
    ns, op, overload = parts
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        hint = " (is the kernel plugin that defines it imported?)" if ns == "k3" else ""
        raise GraphFormatError(f"{where}: unknown op '{name}'{hint}") from None


def _is_identifier(s) -> bool:
    return isinstance(s, str) and s.isidentifier() and not keyword.iskeyword(s)


def _decode(v, env: dict, where: str, device: torch.device | None):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode(x, env, where, device) for x in v]
    if not (isinstance(v, dict) and len(v) == 1):
        raise GraphFormatError(f"{where}: malformed argument {v!r}")
    (tag, x), = v.items()
    try:
        if tag == "node":
            if x not in env:
                raise GraphFormatError(f"{where}: refers to node '{x}' before it is defined")
            return env[x]
        if tag == "tuple":
            return tuple(_decode(e, env, where, device) for e in x)
        if tag == "float":
            if x not in ("inf", "-inf", "nan"):
                raise KeyError(x)
            return float(x)
        if tag == "dtype":
            return _DTYPES[x]
        if tag == "device":
            # engines are built on one device and may run on another: device constants follow the load device
            return device if device is not None else torch.device(x)
        if tag == "layout":
            return _LAYOUTS[x]
        if tag == "memory_format":
            return _MEMORY_FORMATS[x]
    except (KeyError, TypeError, RuntimeError):
        raise GraphFormatError(f"{where}: bad {tag} value {x!r}") from None
    raise GraphFormatError(f"{where}: unknown argument tag '{tag}'")


def graph_from_dict(d: dict, weights: dict[str, torch.Tensor], inputs: tuple[str, ...],
                    device: torch.device | None = None, source: str = "graph") -> torch.fx.GraphModule:
    """Rebuild the GraphModule; `weights` maps weights-file keys to tensors."""
    if not isinstance(d, dict) or d.get("format") != GRAPH_FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise GraphFormatError(f"{source}: graph format {got!r} is not {GRAPH_FORMAT!r}")
    if not isinstance(d.get("nodes"), list):
        raise GraphFormatError(f"{source}: 'nodes' must be a list")
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    attrs: dict[str, torch.Tensor] = {}
    attr_of: dict[str, str] = {}  # weights-file key -> attribute name on the module
    placeholders, has_output = [], False
    for i, e in enumerate(d["nodes"]):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("op"), str):
            raise GraphFormatError(f"{source}: node #{i} needs a string 'name' and 'op'")
        name, kind = e["name"], e["op"]
        where = f"{source}, node {name}"
        if name in env:
            raise GraphFormatError(f"{where}: duplicate node name")
        if has_output:
            raise GraphFormatError(f"{where}: node after the output node")
        # fx sanitizes and de-duplicates `name`, so a stored name never reaches generated code verbatim
        if kind == "placeholder":
            target = e.get("target")
            if len(placeholders) >= len(inputs) or target != inputs[len(placeholders)]:
                raise GraphFormatError(f"{where}: input {target!r} is not step input #{len(placeholders)} "
                                       f"of {list(inputs)}")
            node = graph.create_node("placeholder", target, name=name)
            placeholders.append(target)
        elif kind == "get_attr":
            key = e.get("target")
            if not isinstance(key, str) or key not in weights:
                raise GraphFormatError(f"{where}: weight {key!r} is not in the weights file")
            attr = attr_of.get(key)
            if attr is None:
                attr = attr_of[key] = key if _is_identifier(key) else f"weight_{len(attr_of)}"
                attrs[attr] = weights[key]
            node = graph.create_node("get_attr", attr, name=name)
        elif kind == "call_function":
            fn = resolve_op(e.get("target"), where)
            args = _decode({"tuple": e.get("args", [])}, env, where, device)
            kwargs = e.get("kwargs", {})
            if not isinstance(kwargs, dict):
                raise GraphFormatError(f"{where}: kwargs must be an object")
            bad = [k for k in kwargs if not _is_identifier(k)]
            if bad:
                raise GraphFormatError(f"{where}: keyword argument names {bad} are not identifiers")
            kwargs = {k: _decode(v, env, where, device) for k, v in kwargs.items()}
            node = graph.create_node("call_function", fn, args, kwargs, name=name)
        elif kind == "output":
            args = _decode({"tuple": e.get("args", [])}, env, where, device)
            if len(args) != 1:
                raise GraphFormatError(f"{where}: the output node takes one argument")
            node = graph.output(args[0])
            has_output = True
        else:
            raise GraphFormatError(f"{where}: node kind '{kind}' is not allowed "
                                   f"(placeholder, get_attr, call_function, output)")
        if isinstance(e.get("pass"), str):
            node.meta[PASS_META] = e["pass"]
        env[name] = node
    if not has_output:
        raise GraphFormatError(f"{source}: no output node")
    if len(placeholders) != len(inputs):
        raise GraphFormatError(f"{source}: {len(placeholders)} inputs, the step takes {len(inputs)} ({list(inputs)})")
    try:
        graph.lint()
    except Exception as ex:  # fx raises RuntimeError / AssertionError on a malformed graph
        raise GraphFormatError(f"{source}: the rebuilt graph is malformed: {ex}") from None
    return torch.fx.GraphModule(attrs, graph)
