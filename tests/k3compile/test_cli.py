"""The CLI as a user meets it: defaults in --help, one clear line for bad flags, `serve --model`,
bench results in a fresh folder, `bench memory` writing results as they come."""
import json
import os

import pytest
import torch

from k3compile.cli import build_parser, main


def _parsers(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_flag_with_a_default_shows_it_in_help():
    missing = []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.default is None or action.default is False \
                    or action.help == "==SUPPRESS==" or action.option_strings == ["-h"] or "--help" in action.option_strings:
                continue
            start = text.index("\n  " + action.option_strings[0])   # its entry in the options list
            end = text.find("\n  -", start + 1)
            if "default" not in text[start:end if end > 0 else None]:
                missing.append((" ".join(path), action.option_strings[-1]))
    assert not missing, missing


def test_generate_max_new_tokens_0_is_one_line(capsys):
    assert main(["generate", "--model", "k3-tiny", "--prompt", "x", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-new-tokens must be >= 1" in err and "Traceback" not in err


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
@pytest.mark.parametrize("command", [["generate", "--model", "k3-tiny", "--prompt", "x"], ["serve", "k3-tiny"],
                                     ["build", "--model", "k3-tiny", "-o", "unused"]])
def test_cuda_on_a_cpu_only_torch_is_one_line(capsys, command):
    assert main([*command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "built without CUDA" in err


def test_serve_takes_the_model_positionally_or_as_a_flag():
    from k3compile.commands import serve
    from k3compile.model_def.config import ConfigError

    p = build_parser()
    assert serve.engine_args(p.parse_args(["serve", "--model", "k3-tiny"])).model == "k3-tiny"
    assert serve.engine_args(p.parse_args(["serve", "k3-tiny"])).model == "k3-tiny"
    with pytest.raises(ConfigError, match="once"):
        serve.engine_args(p.parse_args(["serve", "k3-tiny", "--model", "k3-tiny"]))
    with pytest.raises(ConfigError, match="which model"):
        serve.engine_args(p.parse_args(["serve"]))
    a = p.parse_args(["serve", "k3-tiny", "--gpu-memory-utilization", "0.5"])
    assert serve.engine_args(a).mem_fraction_static == 0.5


@pytest.mark.parametrize("bench", ["cache", "memory"])
def test_bench_results_default_to_a_fresh_folder(tmp_path, monkeypatch, capsys, bench):
    from k3compile.bench.results import fresh_out_dir

    monkeypatch.chdir(tmp_path)
    assert build_parser().parse_args(["bench", bench]).out is None
    first, second = fresh_out_dir(bench, None), fresh_out_dir(bench, None)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert first.startswith(os.path.join("bench_out", bench + "-")) and not os.path.exists("traces")
    assert f"results go to {first}/" in capsys.readouterr().out


def test_bench_memory_writes_each_workload_as_it_finishes(tmp_path, monkeypatch):
    import k3compile.bench.memory as memory

    monkeypatch.setattr(memory, "workloads", lambda seed, scale: {"first": [], "second": []})
    calls = []

    def compare(model, jobs, budget, page_size, sweep, reserve_ratio=None, on_run=None):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt   # the user stops a long run during the second workload
        return {"unified": {}, "default_split": {}, "splits": {}, "best_split": {}}
    monkeypatch.setattr(memory, "compare", compare)
    monkeypatch.setattr(memory, "render", lambda doc: "table\n")
    assert main(["bench", "memory", "--skip-allocator", "--out", str(tmp_path)]) == 130
    doc = json.loads((tmp_path / "memory_k3-tiny.json").read_text())
    assert list(doc["engine"]) == ["first"]


def test_no_bench_cites_a_file_the_project_lacks():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert os.path.isfile(os.path.join(root, "docs", "BENCHMARKS.md"))
    for dirpath, _, files in os.walk(os.path.join(root, "k3compile")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name)).read()
                for i in range(len(text)):
                    i = text.find("BENCHMARKS.md", i)
                    if i < 0:
                        break
                    assert text[max(0, i - 5):i] == "docs/", (name, text[max(0, i - 40):i + 20])
                    i += 1
