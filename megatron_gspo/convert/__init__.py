"""Hugging Face <-> Megatron-Core conversion. Pure torch: never imports Megatron.

Modules:

* :mod:`~megatron_gspo.convert.mapping`: names and tensors of one FULL parameter, both ways, per
  architecture (Qwen3-MoE, Mixtral, Qwen2-MoE, dense Qwen3); local and TE Megatron spellings.
* :mod:`~megatron_gspo.convert.hf_config`: ``config.json`` <-> :class:`~megatron_gspo.config.
  ModelConfig` (transformers 4 and 5 spellings).
* :mod:`~megatron_gspo.convert.safetensors_io`: lazy HF reader, streaming sharded writer, atomic
  output directories.
* :mod:`~megatron_gspo.convert.torch_dist`: reading a Megatron ``torch_dist`` checkpoint tensor by
  tensor without Megatron.
* :mod:`~megatron_gspo.convert.export`: the offline ``megatron-to-hf`` conversion.

The sharded side (loading HF weights into a parallel model, streaming it back) lives in
:mod:`megatron_gspo.engine.hf_import_export`, the only place that touches Megatron objects.
"""

from megatron_gspo.convert.hf_config import (
    hf_config_dict,
    model_config_from_hf,
    read_hf_config,
    resolve_model_config,
)
from megatron_gspo.convert.mapping import (
    ConversionError,
    hf_names_for,
    hf_parameter_shapes,
    megatron_from_hf,
    megatron_parameter_shapes,
    megatron_to_hf,
    parse_megatron_name,
)

__all__ = [
    "ConversionError",
    "hf_config_dict",
    "hf_names_for",
    "hf_parameter_shapes",
    "megatron_from_hf",
    "megatron_parameter_shapes",
    "megatron_to_hf",
    "model_config_from_hf",
    "parse_megatron_name",
    "read_hf_config",
    "resolve_model_config",
]
