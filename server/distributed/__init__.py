"""Tensor parallelism: startup checks, the process group and collectives of one
replica's ranks (gloo on CPU, NCCL on GPU). The engine's executor and workers that use
them live in `server/engine/tp_executor.py` and `tp_worker.py`."""
