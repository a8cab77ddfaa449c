"""``rig`` prints its own messages and the answer, and no third-party start-up noise."""

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from rig_decode.models.embedded import DEFAULT_MODEL, is_pulled
from rig_decode.models.quiet import DROPPED_LOG_MESSAGES, quiet_peft

NOISE = re.compile(r"warn|failed to load", re.IGNORECASE)


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # warnings shown as a user sees them
    # offline, whatever other tests left in os.environ: no hub traffic from a test, and the path with the
    # most third-party notices (bitsandbytes' kernel lookup logs one more offline)
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.real_model
def test_rig_ask_prints_the_answer_and_no_third_party_noise():
    if not is_pulled(DEFAULT_MODEL):
        if os.environ.get("RIG_REQUIRE_REAL_MODEL") == "1":
            pytest.fail("RIG_REQUIRE_REAL_MODEL=1 but the embedded default model is not pulled")
        pytest.skip("embedded default model not pulled (run scripts/setup.sh)")
    # one hop at most: the retrieval path runs, and the answer comes within a few tokens
    out = _run("-m", "rig_decode.cli", "ask", "What is the capital of France?", "--max-iterations", "1",
               "--max-tokens", "32")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert not [line for line in lines if NOISE.search(line)], out.stderr
    assert all(line.startswith("[rig]") for line in lines), out.stderr
    assert any(line.startswith("[rig] loaded") for line in lines), out.stderr
    answer = out.stdout.splitlines()
    assert answer and answer[0].strip(), out.stdout
    assert "hops," in out.stdout and "tokens generated" in out.stdout


def test_rig_index_build_prints_no_third_party_noise(tmp_path):
    """The embedding model alone (no decoder loaded): sentence-transformers imports peft, and so
    bitsandbytes, on its own."""
    (tmp_path / "kb").mkdir()
    (tmp_path / "kb" / "alpha.md").write_text("# Alpha\nAlpha is a test document.\n")
    out = _run("-m", "rig_decode.cli", "index", "build", "--input", str(tmp_path / "kb"), "--out", str(tmp_path / "index"))
    assert out.returncode == 0, out.stderr
    assert '"documents": 1' in out.stdout
    assert not [line for line in out.stderr.splitlines() if NOISE.search(line)], out.stderr


def test_starting_rig_does_not_import_bitsandbytes():
    """bitsandbytes is imported for `quantization: nf4` only (or by peft, for an adapter)."""
    code = ("import sys; import rig_decode.cli, rig_decode.session, rig_decode.models.loader, rig_decode.train.lora; "
            "assert 'bitsandbytes' not in sys.modules and 'peft' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('bitsandbytes', 'peft')))")
    out = _run("-c", code, timeout=120)
    assert out.returncode == 0, out.stderr


def test_quiet_peft_drops_exactly_its_messages(caplog):
    (bnb_name, bnb_notice), (kernels_name, kernels_notice) = DROPPED_LOG_MESSAGES.items()
    bnb, kernels = logging.getLogger(bnb_name), logging.getLogger(kernels_name)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_peft():
            bnb.warning(f"{bnb_notice}: %s. Please make sure ...", "no hub")
            bnb.warning("another bitsandbytes warning")
            kernels.warning(f"{kernels_notice} because Hugging Face Hub is in offline mode.")
            kernels.warning("Skipping publisher trust check for 'someone/else' because Hugging Face Hub is offline.")
            warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                                   FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
            warnings.warn_explicit("`something_else` is deprecated", FutureWarning, "modeling_utils.py", 2,
                                   module="transformers.modeling_utils")
            warnings.warn_explicit("`is_gradient_checkpointing` is deprecated", FutureWarning, "x.py", 3,
                                   module="somebody.else")
        bnb.warning(f"{bnb_notice}: outside the block")
    assert [r.getMessage() for r in caplog.records] == [
        "another bitsandbytes warning",
        "Skipping publisher trust check for 'someone/else' because Hugging Face Hub is offline.",
        f"{bnb_notice}: outside the block",
    ]
    assert sorted(str(w.message) for w in seen) == ["`is_gradient_checkpointing` is deprecated",
                                                    "`something_else` is deprecated"]
