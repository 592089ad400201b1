"""`k3compile serve`: flags → EngineArgs, and a real server process answering the openai client."""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from k3compile.commands import serve


def parse(*argv):
    p = argparse.ArgumentParser()
    serve.register(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_defaults_bind_loopback_only():
    a = parse("k3-tiny")
    assert (a.host, a.port, a.api_key is None or a.api_key == os.environ.get("K3COMPILE_API_KEY")) == \
        ("127.0.0.1", 30000, True)


def test_flags_map_to_engine_args(tmp_path):
    a = parse("k3-tiny", "--page-size", "4", "--chunk-size", "32", "--max-running", "8", "--dtype", "bf16",
              "--disable-prefix-cache", "--overlap", "--enable-unified-memory", "--memory-bytes", "1000000")
    e = serve.engine_args(a)
    assert (e.model, e.engine_dir, e.page_size, e.chunk_size, e.max_running, e.dtype) == \
        ("k3-tiny", None, 4, 32, 8, "bf16")
    assert (e.enable_prefix_cache, e.overlap, e.enable_unified_memory, e.memory_bytes) == (False, True, True, 1000000)
    assert serve.served_name(a) == "k3-tiny"
    d = serve.engine_args(parse("k3-tiny"))
    assert (d.overlap, d.mixed_batches) == (True, True)   # the served defaults
    a = parse("k3-tiny", "--no-overlap", "--no-mixed-batches", "--max-num-batched-tokens", "512",
              "--chunked-prefill-size", "64", "--no-warmup")
    e = serve.engine_args(a)
    assert (e.overlap, e.mixed_batches, e.max_batch_tokens, e.chunk_size, a.warmup) == (False, False, 512, 64, False)

    engine_dir = tmp_path / "mini"
    engine_dir.mkdir()
    (engine_dir / "engine.json").write_text('{"dtype": "bf16"}')
    e = serve.engine_args(parse(str(engine_dir)))
    assert (e.model, e.engine_dir, e.dtype) == (None, str(engine_dir), None)   # None: open_engine gives the engine's
    assert serve.engine_args(parse(str(engine_dir), "--dtype", "fp32")).dtype == "fp32"   # the engine rejects it
    assert serve.served_name(parse(str(engine_dir) + "/")) == "mini"
    assert serve.served_name(parse(str(engine_dir), "--served-model-name", "m")) == "m"

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert serve.engine_args(parse(str(ckpt))).model == str(ckpt)   # no engine.json: a checkpoint


DRIVER = ("import argparse, sys; from k3compile.commands import serve; p = argparse.ArgumentParser(); "
          "serve.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, port: int, timeout_s: float = 90) -> None:
    """Until the serve process answers /health with 200 (fails if it exits first or takes too long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.2)


def test_serve_process_answers_the_openai_client():
    import openai
    port = free_port()
    env = {**os.environ, "K3COMPILE_API_KEY": "sk-env"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "serve", "k3-tiny", "--port", str(port),
                             "--chunk-size", "64", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-env", max_retries=0)
        r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):   # the key came from $K3COMPILE_API_KEY
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert f"'k3-tiny' on http://127.0.0.1:{port}/v1 (API key required)" in out


def test_unreadable_engine_manifest_is_a_clear_error(tmp_path):
    from k3compile.engine.format import EngineError
    (tmp_path / "engine.json").write_text("{not json")
    from k3compile.runtime.engine import LLMEngine
    with pytest.raises(EngineError, match="engine.json"):   # open_engine reads the manifest
        LLMEngine(serve.engine_args(parse(str(tmp_path))))


def test_bad_flag_value_is_one_clear_error():
    from k3compile.model_def.config import ConfigError
    with pytest.raises(ConfigError, match="--page-size 0"):
        serve.run(parse("k3-tiny", "--page-size", "0"))


def test_sglang_memory_ratio_flag_sets_the_split():
    from k3compile.commands.serve import engine_args
    from k3compile.runtime.memory.pools import DEFAULT_STATE_FRACTION
    e = engine_args(parse("k3-tiny", "--mamba-full-memory-ratio", "3"))
    assert e.state_fraction == 0.75 and not e.enable_unified_memory
    assert engine_args(parse("k3-tiny")).state_fraction is None  # engine default: SGLang's 0.9
    assert abs(DEFAULT_STATE_FRACTION - 0.9 / 1.9) < 1e-12


def test_memory_kind_and_cache_policy_flags():
    """The unified arena unless split pools are asked for (--disable-unified-memory, or SGLang's ratio flag);
    both kinds at once is one clear error; --cache-policy reaches the engine."""
    from k3compile.runtime.engine import LLMEngine

    def kind(*argv):
        engine = LLMEngine(serve.engine_args(parse("k3-tiny", "--memory-bytes", "2000000", *argv)))
        try:
            summary = engine.memory_summary()
            return "unified" if "one unified arena" in summary else "split" if "split pools" in summary else summary, \
                engine.policy.name
        finally:
            engine.close()

    assert kind() == ("unified", "sparse")
    assert kind("--enable-unified-memory", "--cache-policy", "valued") == ("unified", "valued")
    assert kind("--disable-unified-memory") == ("split", "sparse")
    assert kind("--mamba-full-memory-ratio", "0.5") == ("split", "sparse")
    with pytest.raises(ValueError, match="state_fraction sizes split pools"):
        kind("--enable-unified-memory", "--mamba-full-memory-ratio", "0.5")
    with pytest.raises(SystemExit):
        parse("k3-tiny", "--cache-policy", "most")
