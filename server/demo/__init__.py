"""The built-in demo model: a tiny Qwen3-shaped chat model trained by this project.

`pagefleet serve` with no MODEL serves the checkpoint in `model/` (shipped as package
data, a few MB), so the first request of a new user gets readable English without a
download or a GPU. `corpus.py` generates its synthetic training dialogues,
`tokenizer.py` trains its BPE, `template.py` holds its chat template and `train.py`
trains it; docs/demo.md has the loss curve and sample replies.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "model"


def demo_checkpoint() -> Path:
    """The shipped checkpoint's directory (an HF model directory)."""
    if not (DEMO_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the demo model's checkpoint is missing from {DEMO_DIR}; this install lacks its "
            "package data. Rebuild it with: python -m pagefleet.server.demo.train "
            f"--out {DEMO_DIR}")
    return DEMO_DIR
