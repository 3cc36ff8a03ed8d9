"""The checkpoint side: everything that reads or makes a model's files.

``loader`` (streamed, sharded loading onto a device), ``weights`` (safetensors files
and their index), ``save`` (writing the released layout; random models), ``presets``
(named model configs and their random init), ``sharding`` (which slice of a tensor a
rank holds), ``tokenizer``, ``corpus`` and ``train`` (the tiny-trained checkpoint).
Below the runtime: nothing here imports the engine, the graphs or the command line.
"""

from .loader import LoadedModel, load_checkpoint, resolve_checkpoint
from .save import random_models, save_checkpoint

__all__ = ["LoadedModel", "load_checkpoint", "random_models", "resolve_checkpoint",
           "save_checkpoint"]
