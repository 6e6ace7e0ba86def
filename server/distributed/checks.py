"""Startup checks for tensor parallelism: pure decisions on the config, the model's
shape and the visible devices, worded like vLLM's so that users recognise them.

They run before any worker process is started, so a launch line that can never work
fails at once with the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.server.config import ConfigError
from pagefleet.server.models.config import quantization_method


@dataclass(frozen=True)
class TPShape:
    """How one rank's share of the model looks: attention and KV heads per rank, the
    ranks sharing each KV head (replication when there are fewer KV heads than ranks),
    and the vocabulary rows per rank (the last rank's share is padded)."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    kv_replicas: int
    vocab_per_rank: int

    def vocab_range(self, rank: int, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows rank `rank` holds."""
        start = rank * self.vocab_per_rank
        return min(start, vocab_size), min(start + self.vocab_per_rank, vocab_size)


def tp_shape(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
             vocab_size: int) -> TPShape:
    """The per-rank shape, or a ConfigError naming --tensor-parallel-size."""
    if num_heads % tp_size:
        raise ConfigError(
            f"Total number of attention heads ({num_heads}) must be divisible by tensor "
            f"parallel size ({tp_size}). Use a --tensor-parallel-size that divides {num_heads}.")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ConfigError(
            f"Total number of KV heads ({num_kv_heads}) must be divisible by tensor parallel "
            f"size ({tp_size}). Use a --tensor-parallel-size that divides {num_kv_heads}.")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ConfigError(
            f"Tensor parallel size ({tp_size}) must be a multiple of the number of KV heads "
            f"({num_kv_heads}) when it is larger, so that each KV head is replicated on the "
            "same number of ranks.")
    if intermediate_size % tp_size:
        raise ConfigError(
            f"The MLP's intermediate size ({intermediate_size}) must be divisible by tensor "
            f"parallel size ({tp_size}).")
    return TPShape(tp_size, num_heads // tp_size, max(1, num_kv_heads // tp_size),
                   max(1, tp_size // num_kv_heads), -(-vocab_size // tp_size))


def check_devices(tp_size: int, device_type: str, num_gpus: int) -> None:
    """N ranks need N visible GPUs (CPU ranks are processes: any number goes)."""
    if device_type == "cuda" and tp_size > num_gpus:
        raise ConfigError(
            f"World size ({tp_size}) is larger than the number of available GPUs ({num_gpus}) "
            f"in this node. Lower --tensor-parallel-size to at most {max(num_gpus, 1)}, or make "
            "more GPUs visible (CUDA_VISIBLE_DEVICES, the pod's nvidia.com/gpu limit).")


def check_quantization(tp_size: int, quantization_config: dict | None,
                       source: str | None = None, flag: str | None = None) -> None:
    """Quantized checkpoints shard like dense ones, except act-order (GPTQ desc_act,
    compressed-tensors actorder group): a rank's slice of a row-parallel layer mixes
    groups in an order our int4 kernels (one contiguous group after the other) cannot
    follow. `source` (where the config was
    read) and `flag` (--quantization) tell the method of an old AutoGPTQ
    quantize_config.json, which names none."""
    q = quantization_config or {}
    if tp_size > 1 and quantization_method(q, source, flag) == "gptq" and q.get("desc_act"):
        raise ConfigError(
            "GPTQ checkpoints with act-order (desc_act: true) are not supported with "
            f"--tensor-parallel-size {tp_size} yet; use --tensor-parallel-size 1, or a "
            "checkpoint quantized with desc_act false.")
    if tp_size > 1 and quantization_method(q, source, flag) == "compressed-tensors" and any(
            (g.get("weights") or {}).get("actorder") in (True, "group", "dynamic")
            for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)):
        raise ConfigError(
            "compressed-tensors checkpoints with act-order groups (actorder: group, "
            f"weight_g_idx) are not supported with --tensor-parallel-size {tp_size} yet; use "
            "--tensor-parallel-size 1, or a checkpoint quantized with actorder weight or null.")
