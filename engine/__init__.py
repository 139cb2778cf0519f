"""batchscope's inference engine: pure Python + torch, no web code.

Read it along a request's path: sequence -> scheduler / block_manager ->
model_runner (attention, models/llama) -> sampler / detokenizer -> llm_engine.
"""
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, Status

__all__ = ["EngineConfig", "LLMEngine", "SamplingParams", "Sequence", "Status"]
