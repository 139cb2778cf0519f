import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_engine_fp32():
    from engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def hf_default_model():
    import torch
    from transformers import AutoModelForCausalLM
    from tests.helpers import default_model_folder
    return AutoModelForCausalLM.from_pretrained(default_model_folder(), dtype=torch.float32).eval()
