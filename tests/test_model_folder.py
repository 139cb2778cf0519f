"""The prepared model folder is a standard Hugging Face folder: the tied embedding under its Hub name
(model.embed_tokens.weight), a generation config; transformers loads it with nothing missing and gives
the engine's logits. A folder prepared by older code (the tied matrix only as lm_head.weight) still
loads, and the cache is brought to the standard layout without preparing again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.weights import loader
from tests.helpers import save_tiny_model

EMBED = "model.embed_tokens.weight"


def keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def make_old_layout(folder: Path):
    """What the old prepare() wrote: the tied matrix only under lm_head.weight (safetensors' save_model)."""
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = state.pop(EMBED)
    save_file(state, str(folder / "model.safetensors"), metadata={EMBED: "lm_head.weight", "format": "pt"})


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


def engine_logprobs(folder: Path, ids: list[int], n: int = 6) -> list[tuple[int, float]]:
    """Greedy tokens of the engine and each one's logprob (from its raw logits)."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_gb=0.02, cpu_threads=1))
    rid = engine.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
    while not engine.get_request(rid).is_finished:
        engine.step()
    seq = engine.get_request(rid)
    return [(t, lp) for t, (lp, _) in zip(seq.output_token_ids, seq.logprobs)]


def check_same_logits(folder: Path, ids: list[int]):
    """transformers' log-softmax along the engine's greedy reply equals the engine's logprobs."""
    got = engine_logprobs(folder, ids)
    full = ids + [t for t, _ in got]
    reference = torch.log_softmax(hf_logits(folder, full)[len(ids) - 1:-1], dim=-1)
    for i, (token, lp) in enumerate(got):
        assert int(reference[i].argmax()) == token
        assert reference[i, token].item() == pytest.approx(lp, abs=2e-3)


def test_an_old_tied_folder_is_standardised_and_both_layouts_load(tmp_path):
    folder = save_tiny_model("llama-tied-scaled", tmp_path / "tied")
    ids = [1, 422, 2706, 314, 4113, 30]
    before = engine_logprobs(folder, ids)
    make_old_layout(folder)
    assert EMBED not in keys(folder) and "lm_head.weight" in keys(folder)
    assert engine_logprobs(folder, ids) == before               # the engine still loads the old layout
    assert loader.standardise(folder) is True
    assert EMBED in keys(folder) and "lm_head.weight" not in keys(folder)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] is not None
    assert loader.standardise(folder) is False                  # nothing left to do
    assert engine_logprobs(folder, ids) == before
    check_same_logits(folder, ids)


def test_the_default_cache_in_the_old_layout_is_standardised_not_prepared_again(tmp_path, monkeypatch):
    target = tmp_path / loader.DEFAULT_MODEL_NAME
    save_tiny_model("llama-tied-scaled", target)
    make_old_layout(target)
    monkeypatch.setenv("BATCHSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "prepare", lambda target: pytest.fail("prepared again"))
    assert loader.prepare_default_model() == target
    assert EMBED in keys(target)


@pytest.mark.model
def test_the_prepared_default_folder_loads_in_transformers_with_the_engines_logits():
    folder = loader.prepare_default_model()
    assert EMBED in keys(folder) and "lm_head.weight" not in keys(folder)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).exists(), name
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    check_same_logits(folder, tok(text)["input_ids"])


def test_a_folders_tokenizer_is_loaded_once_per_process_until_its_files_change(tmp_path):
    """Every engine of a process shares its folder's tokenizer (engine/weights/loader.py tokenizer); a file of
    the folder written again loads it again, so a folder replaced in place is never read from an old copy."""
    folder = save_tiny_model("llama", tmp_path / "m")
    first = loader.tokenizer(folder)
    assert loader.tokenizer(folder) is first
    from transformers import AutoTokenizer
    assert first("Hello there")["input_ids"] == AutoTokenizer.from_pretrained(folder)("Hello there")["input_ids"]
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    again = loader.tokenizer(folder)
    assert again is not first and loader.tokenizer(folder) is again
