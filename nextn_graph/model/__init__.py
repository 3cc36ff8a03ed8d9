from .config import ModelConfig, config_from_dict, load_config
from .deepseek_v4 import DeepseekV4ForCausalLM, ForwardOutput
from .nextn import DeepseekV4ForCausalLMNextN

__all__ = ["ModelConfig", "config_from_dict", "load_config", "DeepseekV4ForCausalLM",
           "DeepseekV4ForCausalLMNextN", "ForwardOutput"]
