"""The remote backend against a real llama.cpp ``llama-server`` serving the embedded default model.

``scripts/test.sh`` builds ``llama-server`` (``scripts/build_llama.sh``, cached under build/) and sets
``RIG_LLAMA_SERVER`` to it and ``RIG_LLAMA_CONVERT`` to llama.cpp's ``convert_hf_to_gguf.py``;
without them the module is skipped. The model is converted
to an F32 GGUF from the same safetensors the in-process backend loads, so both compute with the
same weights in float32. The test starts and stops the server itself.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SERVER, CONVERT = os.environ.get("RIG_LLAMA_SERVER"), os.environ.get("RIG_LLAMA_CONVERT")
pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(not (SERVER and CONVERT), reason="set RIG_LLAMA_SERVER and RIG_LLAMA_CONVERT")]

QUESTIONS = ["Who founded the company that makes the Brisa T4?",
             "In which city is the company that makes the Lumora K7 headquartered?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    from rig_decode.models.embedded import is_pulled, model_dir

    if not is_pulled("smollm2-135m-instruct"):
        pytest.skip("embedded default model not pulled")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    gguf = tmp_path_factory.mktemp("gguf") / "smollm2-135m-instruct-f32.gguf"
    subprocess.run([sys.executable, CONVERT, str(model_dir("smollm2-135m-instruct")), "--outtype", "f32",
                    "--outfile", str(gguf)], check=True, capture_output=True)
    port = _free_port()
    log = open(gguf.with_suffix(".log"), "w")
    proc = subprocess.Popen([SERVER, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
                             "-np", "4", "-t", "2", "--no-webui"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama-server did not become healthy in 120 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def test_remote_llamacpp_answers_like_the_in_process_backend(llama_server):
    from rig_decode import RigConfig, RigSession

    cfg = RigConfig.from_dict({"model": {"adapter": None, "max_tokens": 80},
                               "rig": {"retrieve_first": True, "max_query_tokens": 16, "max_iterations": 2,
                                       "evidence_token_budget": 256}})
    local = RigSession(cfg).ask_batch(QUESTIONS)
    remote_cfg = cfg.updated(engine={"backend": "remote", "remote": {"base_url": llama_server, "api": "auto"}})
    session = RigSession(remote_cfg)
    remote = session.ask_batch(QUESTIONS)
    session.close()
    for (a, ta), (b, tb) in zip(local, remote):
        assert b == a, (a, b)
        assert [s.query for s in tb.retrieval_steps] == [s.query for s in ta.retrieval_steps]
        assert tb.num_hops >= 1
        for step in tb.retrieval_steps:  # after each splice the server evaluated only the new tokens
            served = step.info["server"]
            assert served["prompt_n"] <= step.evidence_tokens + 1, served
            assert served["cache_n"] >= step.position - 1, served
