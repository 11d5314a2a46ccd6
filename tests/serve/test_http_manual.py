"""The manual's curl examples, run as written against a server (issue 38 row 11): the tensor
route by curl needs no ``curl -g`` and no layout or preprocess id for a task with one choice."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
MARK = "<!-- tensor-curl-example:"


def _example(page: str, mark: str) -> str:
    """The ``sh`` block right after ``mark`` in ``docs/<page>``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    m = re.search(re.escape(mark) + r".*?-->\s*```sh\n(.*?)```", text, re.S)
    assert m, f"no sh block after {mark!r} in docs/{page}"
    return m.group(1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_the_tensor_curl_example_works_as_written(embed_server, tmp_path):
    script = _example("http.md", MARK)
    assert "-g" not in script.split() and "[" not in script.split("curl", 1)[1]
    assert "lumen.tensor.layout" not in script and "lumen.preprocess.id" not in script
    url = embed_server.url  # http://127.0.0.1:PORT
    script = script.replace("localhost:8000", url.removeprefix("http://"))
    script = re.sub(r"^python3 ", f"'{sys.executable}' ", script, flags=re.M)
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)


    got = json.loads(p.stdout)["outputs"]["embedding"]
    assert got["shape"] == [384]
    # the same vector as the text route's: the ids are "hello world"'s
    r = httpx.post(f"{url}/v1/infer/text_embed", content=b"hello world",
                   headers={"Content-Type": "text/plain"}, timeout=30)
    want = r.json()["outputs"]["embedding"]["data"]
    np.testing.assert_allclose(got["data"], want, atol=1e-5)
