"""One long-lived TRITON_INTERPRET=1 process that runs the interpreter scripts one after the other.

Started by interpreted.run_interpreted (one per pytest process): each script used to get its own subprocess,
which imported torch, Triton and k3compile again (~4 CPU s of a script's time). Here a script runs as
`python <script>` would run it (runpy as __main__, its folder first on sys.path, argv = [script]), with its
stdout / stderr captured and its exit status taken from SystemExit. The scripts seed their own generators
and set no process-wide state, so running them in one process changes none of their cases.

Protocol: one JSON line per request on stdin ({"script": path}), one JSON line per answer on the channel fd
({"rc", "stdout", "stderr"}); the channel is the original stdout, and fd 1 is pointed at stderr so that
output a script writes below Python (C code, a child) cannot corrupt it. EOF on stdin ends the process.
"""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def run_script(path: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.argv = [path]
    rc = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as done:  # what `python script.py` would exit with
                code = done.code
                rc = code if isinstance(code, int) else (0 if code is None else 1)
                if code is not None and not isinstance(code, int):
                    print(code, file=sys.stderr)
            except BaseException:  # noqa: BLE001  (an uncaught exception: status 1 and its traceback, as python)
                rc = 1
                traceback.print_exc()
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("interpret_host.py: run with TRITON_INTERPRET=1 in the environment")
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    for line in sys.stdin:
        answer = run_script(json.loads(line)["script"])
        channel.write(json.dumps(answer) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
