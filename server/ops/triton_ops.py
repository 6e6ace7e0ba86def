"""`TritonOps`: the model's op bundle with every op a Triton kernel (CUDA path).

Import needs triton; the runner picks this class on CUDA when triton imports.
"""

from __future__ import annotations

from pagefleet.server.models.decoder import Ops
from pagefleet.server.ops import (triton_activation, triton_attention, triton_layernorm,
                                  triton_logits, triton_quant, triton_rotary)


class TritonOps(Ops):
    graph_safe = True   # no op reads a device value back on the host: CUDA-graph capturable

    store_kvcache = staticmethod(triton_attention.store_kvcache)
    prefill_attention = staticmethod(triton_attention.paged_prefill_attention)
    decode_attention = staticmethod(triton_attention.paged_decode_attention)
    rms_norm = staticmethod(triton_layernorm.rms_norm)
    fused_add_rms_norm = staticmethod(triton_layernorm.fused_add_rms_norm)
    rotary_embedding = staticmethod(triton_rotary.rotary_embedding)
    rotary_and_store = staticmethod(triton_rotary.rotary_and_store)
    rotary_and_store_deferred = staticmethod(triton_rotary.rotary_and_store_deferred)
    silu_and_mul = staticmethod(triton_activation.silu_and_mul)
    w4a16_linear = staticmethod(triton_quant.w4a16_linear)
    w4a16_silu_linear = staticmethod(triton_quant.w4a16_silu_linear)
    fp8_linear = staticmethod(triton_quant.fp8_linear)
    fp8_silu_linear = staticmethod(triton_quant.fp8_silu_linear)
    logits = staticmethod(triton_logits.logits)
