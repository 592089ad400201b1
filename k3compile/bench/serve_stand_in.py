"""The real server with a timed stand-in forward: the served path measured on a CPU at device-like step
times (bench/stand_in_step.py says what is replaced and what is not).

    python -m k3compile.bench.serve_stand_in k3-tiny --port 30000 --stand-in-step-ms 2.4 \
        --stand-in-token-ms 0.125 [any `k3compile serve` flag]

is `k3compile serve k3-tiny [flags]` (same flags, same app, AsyncEngine, scheduler, pools, overlap,
sampling) whose model step sleeps `step + token x tokens` ms. `bench serve --stand-in STEP,TOKEN`
starts it in a child process (`start`), so the load generator does not share the server's GIL, and
times the same stand-in's offline engine loop for the ratios.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

from .stand_in_step import TOKEN_KINDS, TimedStandInModel

# the serving settings of the H200 table (tools/gpu_serve14_body.sh), at k3-tiny's size
DEFAULT_SERVER_FLAGS = ("--enable-unified-memory", "--memory-bytes", str(200 << 20))


def add_stand_in_flags(p) -> None:
    p.add_argument("--stand-in-step-ms", type=float, required=True, help="fixed cost of every step (ms)")
    p.add_argument("--stand-in-token-ms", type=float, default=0.0, help="cost per token in the step (ms)")
    p.add_argument("--stand-in-tokens", default="no-text", choices=sorted(TOKEN_KINDS),
                   help="no-text: ids that decode to nothing (a random large-vocabulary model through the "
                   "byte tokenizer); text: one ASCII letter per token")


def stand_in_engine(engine_args, step_ms: float, token_ms: float, tokens: str, preset: str):
    """An LLMEngine over the timed stand-in (top level: it is the engine process's factory)."""
    from k3compile.runtime.engine import LLMEngine

    return LLMEngine(engine_args, model=TimedStandInModel(step_ms, token_ms, tokens, preset=preset))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import functools

    from k3compile.commands import serve as serve_cmd

    parser = argparse.ArgumentParser(prog="python -m k3compile.bench.serve_stand_in")
    p = serve_cmd.register(parser.add_subparsers())
    add_stand_in_flags(p)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    if args.device != "cpu":
        raise SystemExit("the stand-in forward runs on the CPU (--device cpu)")
    factory = functools.partial(stand_in_engine, serve_cmd.engine_args(args), args.stand_in_step_ms,
                                args.stand_in_token_ms, args.stand_in_tokens, serve_cmd.model_source(args))
    return serve_cmd.serve_engine(factory, serve_cmd.served_name(args), args)


class StandInServer:
    """`serve_stand_in` in a child process on a free loopback port; `stop()` ends it."""

    def __init__(self, step_ms: float, token_ms: float, tokens: str, extra: list[str], log_path: str,
                 preset: str = "k3-tiny", timeout: float = 180.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "k3compile.bench.serve_stand_in", preset, "--port", str(self.port),
               "--stand-in-step-ms", str(step_ms), "--stand-in-token-ms", str(token_ms),
               "--stand-in-tokens", tokens, "--log-level", "warning", *DEFAULT_SERVER_FLAGS, *extra]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"the stand-in server exited ({self.proc.returncode}); see {log_path}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stand-in server was not healthy within {timeout:g} s; see {log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


if __name__ == "__main__":
    sys.exit(main())
