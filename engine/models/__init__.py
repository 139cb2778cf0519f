from engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "SUPPORTED_ARCHITECTURES"]
