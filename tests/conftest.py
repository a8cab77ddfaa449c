import os
import random

import numpy as np
import pytest
import torch

from rig_decode.models.embedded import is_pulled, model_dir

from .helpers import tiny_model, tiny_tokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's matmuls gain nothing from a second thread and, on a busy machine, wait for
    it; modules that run many tiny-model decodes use this with `pytestmark`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tok_special():
    return tiny_tokenizer(special_markers=True)


@pytest.fixture(scope="session")
def model(tok):
    return tiny_model(len(tok))


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of the embedded default; skipped when it has not been pulled."""
    if not is_pulled(DEFAULT_MODEL):
        if os.environ.get("RIG_REQUIRE_REAL_MODEL") == "1":
            pytest.fail("RIG_REQUIRE_REAL_MODEL=1 but the embedded default model is not pulled")
        pytest.skip("embedded default model not pulled (run scripts/setup.sh)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = model_dir(DEFAULT_MODEL)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
