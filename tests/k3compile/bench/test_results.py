"""bench/results.py: reports are read back whether committed plain or gzipped."""
import gzip
import json

import pytest

from k3compile.bench.results import read_json, report_exists, write_json


def test_read_json_plain_and_gzipped(tmp_path):
    doc = {"rows": [{"a": 1.5}], "args": {"traces": "agent"}}
    path = tmp_path / "cache_pressure.json"
    assert not report_exists(str(path))
    write_json(str(path), doc)
    assert report_exists(str(path)) and read_json(str(path)) == doc
    with gzip.open(str(path) + ".gz", "wt") as f:
        json.dump({"rows": []}, f)
    assert read_json(str(path)) == doc  # the plain file wins when both exist
    path.unlink()
    assert report_exists(str(path)) and read_json(str(path)) == {"rows": []}
    with pytest.raises(FileNotFoundError):
        read_json(str(tmp_path / "missing.json"))
