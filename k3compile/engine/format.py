"""The engine directory on disk.

    DIR/
      engine.json              manifest (below); the only file not covered by a checksum
      weights.safetensors      post-pass weights, one entry per distinct tensor the graphs read
      graphs/decode.json       step graphs (graph_io format)
      graphs/prefill.json
      build_report.md          for humans
      tokenizer/               the checkpoint's tokenizer files, when it had any
      dumps/                   graphs after each pass (--dump-graphs only)

engine.json holds: format_version, model (HF config dict + name + source), dtype, topology,
page_size, decode_buckets, passes (the pass manager's report), kernel_plugins, versions, build
options, and `files`: {relative path: sha256} for every other file in the directory.
"""
from __future__ import annotations

import hashlib
import json
import os

from k3compile.model_def.checkpoint_errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "engine.json"
WEIGHTS = "weights.safetensors"
GRAPHS_DIR = "graphs"
REPORT = "build_report.md"
TOKENIZER_DIR = "tokenizer"
DUMPS_DIR = "dumps"
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineError(CheckpointError):
    """An engine directory that cannot be loaded (or written) as-is: names the file and the problem.
    (A CheckpointError, so the CLI reports it as one line like any bad checkpoint.)"""


def graph_file(mode: str) -> str:
    return f"{GRAPHS_DIR}/{mode}.json"


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checksum_tree(root: str) -> dict[str, str]:
    """sha256 of every file under root except the manifest, keyed by '/'-separated relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel != MANIFEST:
                out[rel] = sha256_file(path)
    return dict(sorted(out.items()))


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")


def read_json(path: str, what: str):
    if not os.path.isfile(path):
        raise EngineError(f"{path}: missing ({what})")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: not valid JSON ({e})") from None


def read_manifest(root: str) -> dict:
    if not os.path.isdir(root):
        raise EngineError(f"{root}: not an engine directory (no such directory)")
    m = read_json(os.path.join(root, MANIFEST), "the engine manifest; was this directory written by k3compile build?")
    if not isinstance(m, dict):
        raise EngineError(f"{root}/{MANIFEST}: must hold a JSON object")
    version = m.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineError(f"{root}: engine format version {version!r}, this k3compile reads version "
                          f"{FORMAT_VERSION}; rebuild the engine with `k3compile build`")
    for key in ("model", "dtype", "page_size", "decode_buckets", "files", "graphs"):
        if key not in m:
            raise EngineError(f"{root}/{MANIFEST}: missing field '{key}'")
    if not isinstance(m["files"], dict):
        raise EngineError(f"{root}/{MANIFEST}: 'files' must map paths to sha256 digests")
    return m


def verify_files(root: str, files: dict[str, str], check_hashes: bool = True) -> None:
    """Every listed file exists (and matches its digest); paths may not leave the directory."""
    real_root = os.path.realpath(root)
    for rel, digest in files.items():
        path = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([real_root, path]) != real_root:
            raise EngineError(f"{root}/{MANIFEST}: file entry '{rel}' points outside the engine directory")
        if not os.path.isfile(path):
            raise EngineError(f"{root}: file '{rel}' listed in {MANIFEST} is missing")
        if check_hashes and sha256_file(path) != digest:
            raise EngineError(f"{root}: file '{rel}' is corrupted (sha256 differs from {MANIFEST}); "
                              f"rebuild the engine")
