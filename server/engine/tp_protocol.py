"""Messages between the tensor-parallel driver (rank 0, in the engine core) and its
workers, encoded as msgpack by msgspec.

Down (one socket per worker): a `StepMsg` per step, carrying the step's host facts
and the layout of the staging buffer whose device copy the broadcast that follows
delivers; `Query` and `Shutdown`. Up (one socket for all): `WorkerEvent`s (ready,
errors with their kind, query answers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec

from pagefleet.server.config import EngineConfig
from pagefleet.server.engine.runner import PromptLogprobRows, StagedStep

# StagedStep's plain fields travel as a list; its prompt-logprob rows (which hold the
# requests, rank 0's business) as their staging handles and sizes only.
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StagedStep)
                     if f.name != "prompt_logprobs")


class StepMsg(msgspec.Struct, tag="step", array_like=True):
    step: list                                     # StagedStep's fields, in _STEP_FIELDS order
    spans: list[tuple[str, int, tuple[int, ...]]]   # staging layout (handles index it)
    used: int                                      # i64 elements the broadcast carries
    tail: int = -1                                 # handle of the copied sampled tokens
    n_last: int = 0                                # how many of them (0: none)
    prompt_logprobs: tuple[int, int, int, int] | None = None   # rows, targets, count, top

    @classmethod
    def of(cls, step: StagedStep, spans, used: int, tail: int, n_last: int) -> "StepMsg":
        pl = step.prompt_logprobs
        return cls([getattr(step, f) for f in _STEP_FIELDS], spans, used, tail, n_last,
                   (pl.rows_h, pl.targets_h, pl.count, pl.top) if pl is not None else None)

    def staged_step(self) -> StagedStep:
        """The step as the worker executes it: the same handles; prompt logprobs are
        computed (their logits gathered to rank 0) but kept by rank 0 alone."""
        pl = self.prompt_logprobs
        return StagedStep(**dict(zip(_STEP_FIELDS, self.step)), prompt_logprobs=(
            PromptLogprobRows(*pl, segments=[]) if pl is not None else None))


class Query(msgspec.Struct, tag="query", array_like=True):
    name: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToWorker = StepMsg | Query | Shutdown


class WorkerEvent(msgspec.Struct, array_like=True):
    rank: int
    kind: str            # "ready", "report", or an error: "config", "oom", "startup", "fatal"
    message: str = ""
    info: dict = {}


@dataclass
class WorkerSpec:
    """What a worker process needs to start (pickled to its stdin)."""

    rank: int
    world_size: int
    store_port: int
    step_addr: str
    event_addr: str
    config: EngineConfig
    model_dir: str
    max_model_len: int
    env: dict = field(default_factory=dict)
