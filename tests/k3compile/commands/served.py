"""A `k3compile serve` process of a parallel engine or model for the tests: started, probed, stopped; its
rank processes found through /proc (the command starts them as its own children)."""
import os
import signal
import subprocess
import sys

import pytest

from .test_serve import DRIVER, free_port, wait_healthy

PROMPT = [5, 17, 99, 3, 250, 7, 8, 41, 9, 300, 11, 12, 13, 77, 2, 19, 400, 6, 6, 1]  # 3 chunks of 8
AGAIN = PROMPT[:16] + [55, 56, 57]
FLAGS = ["--page-size", "4", "--chunk-size", "8", "--memory-bytes", str(8 << 20), "--log-level", "warning",
         "--no-warmup"]


def reference(prompts, n):
    from k3compile.runtime.engine import EngineArgs, LLMEngine
    from k3compile.runtime.sampling import SamplingParams
    engine = LLMEngine(EngineArgs(model="k3-tiny", page_size=4, chunk_size=8, memory_bytes=8 << 20))
    return [engine.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0] for p in prompts]


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except OSError:
                pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Served:
    def __init__(self, source, *extra, name="tp2"):
        import openai
        self.name = name
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, "serve", source, "--served-model-name", name,
                                      "--port", str(self.port),
                                      *FLAGS, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_healthy(self.proc, self.port, 120)
        self.ranks = children(self.proc.pid)  # the rank processes serve started (rank 1 of tp2)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0)

    def complete(self, prompt, n, **kw):
        return self.client.completions.create(model=self.name, prompt=prompt, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)

    def exit(self, timeout):
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            pytest.fail(f"serve did not shut down within {timeout}s:\n{out}")
        return self.proc.returncode, out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            return self.exit(60)
        return self.proc.returncode, ""

    def check_greedy(self, want):
        """PROMPT, then AGAIN (a prefix-cache hit), give the reference's greedy tokens `want`."""
        r = self.complete(PROMPT, len(want[0]))
        assert r.choices[0].model_extra["token_ids"] == want[0]
        r = self.complete(AGAIN, len(want[1]))
        assert r.choices[0].model_extra["token_ids"] == want[1]
        assert r.usage.prompt_tokens_details.cached_tokens == 16  # the first prompt's chunks, cached on every rank
