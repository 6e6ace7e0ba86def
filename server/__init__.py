"""pagefleet server: paged-attention inference engine behind an OpenAI-compatible API.

`LLM` and `SamplingParams` are imported lazily so that `pagefleet.server.config` (used
by the operator image, which has no torch) stays light.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagefleet.server.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagefleet.server.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from pagefleet.server.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)
