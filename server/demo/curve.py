"""Draw the demo model's loss curve from its training log as a small SVG (no plotting
library needed): `python -m pagefleet.server.demo.curve LOG.json OUT.svg`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

W, H, PAD = 640, 320, 48


def _smooth(values: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def svg(log: dict) -> str:
    train = log["train"]
    steps = [t["step"] for t in train]
    loss = _smooth([t["loss"] for t in train])
    ev = [(e["step"], e["loss"]) for e in log["eval"]]
    top = math.ceil(max(loss + [v for _, v in ev]))
    last = steps[-1]

    def xy(step: float, value: float) -> str:
        x = PAD + (W - 2 * PAD) * step / last
        y = H - PAD - (H - 2 * PAD) * value / top
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>']
    for v in range(0, top + 1):
        y = xy(0, v).split(",")[1]
        parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        parts.append(f'<text x="{PAD - 8}" y="{y}" text-anchor="end" dy="4">{v}</text>')
    for s in range(0, last + 1, max(1, last // 6 // 50 * 50 or 50)):
        x = xy(s, 0).split(",")[0]
        parts.append(f'<text x="{x}" y="{H - PAD + 16}" text-anchor="middle">{s}</text>')
    parts.append('<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="'
                 + " ".join(xy(s, v) for s, v in zip(steps, loss)) + '"/>')
    parts.append('<polyline fill="none" stroke="#d62728" stroke-width="2" points="'
                 + " ".join(xy(s, v) for s, v in ev) + '"/>')
    parts += [f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">training step</text>',
              f'<text x="{PAD}" y="20">cross-entropy of the assistant tokens (nats)</text>',
              f'<text x="{W - PAD}" y="20" text-anchor="end" fill="#1f77b4">train (mean of 10 steps)</text>',
              f'<text x="{W - PAD}" y="36" text-anchor="end" fill="#d62728">held-out dialogues</text>',
              "</svg>"]
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    log = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(svg(log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
