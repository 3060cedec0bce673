"""The README's course command, started headless: JupyterLab at the repository's root, opening
on the first lesson, with notebooks/, exercises/ and solutions/ all reachable.

By default the server is this environment's JupyterLab. CI also runs this file with
``FLASHATTN_JUPYTER=.venv/bin/jupyter`` after installing the course command's venv, and then
checks that the learner's environment carries none of the instructor's (nbgrader's) extensions.
"""
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JUPYTER = os.environ.get("FLASHATTN_JUPYTER")


def readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", text, re.S)
    assert block, f"README.md has no {marker} block"
    return block.group(1).strip()


def jupyter_args() -> list:
    """The arguments the course command gives ``jupyter lab``."""
    last = readme_command("course-command").split("&&")[-1].strip()
    words = shlex.split(last)
    assert words[0].endswith("jupyter") and words[1] == "lab", last
    return words[2:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, follow: bool = True):
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    opener = urllib.request.build_opener() if follow else urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(url, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import importlib.util

    if not JUPYTER and importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("JupyterLab is not installed in this environment (the test extra installs it; a GPU "
                    "box's own Python may lack it): the course command cannot be started here")
    port, token = _free_port(), "flashattn-course-test"
    exe = [JUPYTER, "lab"] if JUPYTER else [sys.executable, "-m", "jupyterlab"]
    runtime = tmp_path_factory.mktemp("jupyter-runtime")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime))
    cmd = exe + jupyter_args() + ["--no-browser", f"--port={port}", f"--ServerApp.token={token}",
                                  "--ServerApp.port_retries=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited ({proc.returncode}):\n{proc.stdout.read()}")
            try:
                if _get(f"{base}/api?token={token}")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("jupyter lab did not answer within 60 s")
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_root_lists_the_three_folders(server):
    base, token = server
    status, _, body = _get(f"{base}/api/contents/?token={token}")
    assert status == 200
    folders = {c["name"] for c in json.loads(body)["content"] if c["type"] == "directory"}
    assert {"notebooks", "exercises", "solutions"} <= folders, folders


@pytest.mark.parametrize("path", ["notebooks/01_matrix_gradients.ipynb", "exercises/03_dq_kernel.ipynb",
                                  "solutions/04_dkdv_kernel.ipynb", "notebooks/08_bug_hunt_lab.ipynb"])
def test_a_notebook_in_each_folder_opens(server, path):
    base, token = server
    status, _, body = _get(f"{base}/api/contents/{path}?token={token}")
    assert status == 200, body[:300]
    model = json.loads(body)
    assert model["type"] == "notebook" and model["content"]["cells"]


def test_it_opens_on_the_first_lesson(server):
    base, token = server
    status, headers, _ = _get(f"{base}/?token={token}", follow=False)
    assert status in (301, 302) and "/lab/tree/notebooks/01_matrix_gradients.ipynb" in headers["Location"]
    status, _, page = _get(f"{base}/lab/tree/notebooks/01_matrix_gradients.ipynb?token={token}")
    assert status == 200 and b"JupyterLab" in page


@pytest.mark.skipif(not JUPYTER, reason="checks the learner's venv: CI sets FLASHATTN_JUPYTER after "
                                        "running the README's course command")
def test_the_learners_jupyter_has_no_instructor_tools():
    for what in (["labextension", "list"], ["server", "extension", "list"]):
        out = subprocess.run([JUPYTER, *what], capture_output=True, text=True, cwd=ROOT)
        assert "nbgrader" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr


def test_course_extra_is_free_of_instructor_tools():
    text = (ROOT / "pyproject.toml").read_text()
    extra = lambda name: re.search(rf"^{name} = \[(.*?)\]", text, re.S | re.M).group(1)  # noqa: E731
    assert "nbgrader" not in extra("course") and "nbgrader" in extra("instructor")
