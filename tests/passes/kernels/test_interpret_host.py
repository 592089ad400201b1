"""interpreted.InterpretHost: the one process that runs the interpreter scripts reports each script as `python
script` would (exit status, output, tracebacks), keeps its answers apart from output written below Python, and
is replaced after a script that hangs or kills it."""
import pytest

from .interpreted import InterpretHost


@pytest.fixture
def host():
    h = InterpretHost()
    yield h
    h.close()


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_exit_status_output_and_script_context(host, tmp_path):
    (tmp_path / "sibling.py").write_text("VALUE = 41\n")
    ok = script(tmp_path, "ok.py", "import os, sys\nfrom sibling import VALUE\n"
                "assert os.environ['TRITON_INTERPRET'] == '1' and sys.argv == [__file__] and __name__ == '__main__'\n"
                "os.write(1, b'below python\\n')\nprint(VALUE + 1, 'cases match')\n"
                "print('to stderr', file=sys.stderr)\n")
    assert host.run(ok, 60) == {"rc": 0, "stdout": "42 cases match\n", "stderr": "to stderr\n"}
    failing = script(tmp_path, "failing.py", "import sys\nprint('FAIL one')\nsys.exit(1)\n")
    assert host.run(failing, 60) == {"rc": 1, "stdout": "FAIL one\n", "stderr": ""}
    message = script(tmp_path, "message.py", "import sys\nsys.exit('a message')\n")
    assert host.run(message, 60) == {"rc": 1, "stdout": "", "stderr": "a message\n"}
    raising = script(tmp_path, "raising.py", "raise ValueError('boom')\n")
    done = host.run(raising, 60)
    assert done["rc"] == 1 and "ValueError: boom" in done["stderr"] and "Traceback" in done["stderr"]
    pid = host.proc.pid
    assert host.run(ok, 60)["rc"] == 0 and host.proc.pid == pid  # the same process ran all five


def test_a_hanging_or_dying_script_fails_and_the_next_gets_a_new_host(host, tmp_path):
    ok = script(tmp_path, "ok.py", "print('1/1 cases match')\n")
    host.run(ok, 60)
    first = host.proc.pid
    with pytest.raises(AssertionError, match="hang.py: not done in 1 s"):
        host.run(script(tmp_path, "hang.py", "import time\ntime.sleep(120)\n"), 1)
    assert host.proc is None
    assert host.run(ok, 60)["rc"] == 0 and host.proc.pid != first
    second = host.proc.pid
    with pytest.raises(AssertionError, match="dies.py: host died; the host's stderr:\ngone"):
        host.run(script(tmp_path, "dies.py", "import os\nos.write(2, b'gone\\n')\nos._exit(3)\n"), 60)
    assert host.run(ok, 60)["rc"] == 0 and host.proc.pid not in (first, second)
