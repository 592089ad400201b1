"""Import layering, as DESIGN.md's "Who may import whom" draws it, checked on every module's AST
(imports inside functions included):

    model_def   nothing of the project
    capture     model_def
    shared      the engine format (k3compile/engine: engine, format, graph_io, plugins, opened, and the
                engine-step profiling the server's profiler uses: profiling, provenance) and the
                tokenizer: model_def, capture's graph conventions, each other
    passes      model_def, capture
    runtime     model_def, the shared engine format and tokenizer
    k3compile/  (the rest: CLI, build, bench, report) anything

Also: importing a leaf of model_def loads only what it needs, not the whole package tree.
"""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"model_def": "k3compile.model_def", "passes": "k3compile.passes", "runtime": "k3compile.runtime",
           "k3compile": "k3compile"}
SHARED = ("k3compile.engine", "k3compile.engine.engine", "k3compile.engine.format", "k3compile.engine.graph_io",
          "k3compile.engine.plugins", "k3compile.engine.opened", "k3compile.engine.profiling",
          "k3compile.engine.provenance", "k3compile.tokenizer")
CAPTURE = ("k3compile.capture",)


def _within(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def layer(module: str) -> str:
    if _within(module, ("k3compile.model_def",)):
        return "model_def"
    if _within(module, ("k3compile.passes",)):
        return "passes"
    if _within(module, ("k3compile.runtime",)):
        return "runtime"
    if module in SHARED:
        return "shared"
    if module in CAPTURE:
        return "capture"
    return "driver"


ALLOWED = {
    "model_def": {"model_def"},
    "capture": {"model_def", "capture"},
    "shared": {"model_def", "capture", "shared"},
    "passes": {"model_def", "capture", "passes"},
    "runtime": {"model_def", "shared", "runtime"},
    "driver": {"model_def", "capture", "shared", "passes", "runtime", "driver"},
}


def modules():
    for folder, package in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    is_pkg = rel.endswith("__init__")
                    rel = rel.removesuffix("__init__").rstrip(".")
                    yield os.path.join(dirpath, f), package + ("." + rel if rel else ""), is_pkg


def imports(path: str, module: str, is_pkg: bool):
    tree = ast.parse(open(path).read(), path)
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:   # `from k3compile.engine import opened` may name a submodule
                yield node.lineno, target if node.module else f"{target}.{a.name}"


def test_no_import_crosses_the_layers():
    bad = []
    for path, module, is_pkg in modules():
        src = layer(module)
        for line, target in imports(path, module, is_pkg):
            if not _within(target, ("k3compile",)) or target == "k3compile":
                continue
            if layer(target) not in ALLOWED[src]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} ({src}) imports {target} ({layer(target)})")
    assert not bad, "imports that cross DESIGN.md's layering:\n" + "\n".join(bad)


def test_the_checker_sees_a_crossing(tmp_path):
    """The checker itself: an import from runtime into the CLI's commands is reported."""
    f = tmp_path / "bad.py"
    f.write_text("def f():\n    from k3compile.commands import serve\nfrom ..info import DTYPES\n")
    found = sorted((t, layer(t)) for _, t in imports(str(f), "k3compile.runtime.bad", False))
    assert found == [("k3compile.commands", "driver"), ("k3compile.info", "driver")]
    assert all(lay not in ALLOWED["runtime"] for _, lay in found)


def test_importing_the_batch_module_alone_loads_little():
    code = ("import sys; import k3compile.model_def.batch; "
            "print(len([m for m in sys.modules if m.startswith('k3compile')]))")
    n = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    assert n <= 4, n   # k3compile, k3compile.model_def, k3compile.model_def.batch
