"""Draws docs/architecture.svg, the picture of how weights travel (README, "How it works").

python docs/architecture.py            # rewrites docs/architecture.svg
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

TRAINER, BUCKET, REPLICA = "#dbe7f7", "#fdf0d5", "#dcefdc"


def box(ax, x, y, w, h, color, title, lines):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=color, ec="#444"))
    ax.text(x + w / 2, y + h - 0.28, title, ha="center", va="top", fontsize=12, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + 0.18, y + h - 0.8 - 0.36 * i, line, ha="left", va="top", fontsize=9, family="monospace")


def arrow(ax, start, end, label, *, color="#333", style="-|>", dashed=False, label_dy=0.16):
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=14, lw=1.6, color=color, linestyle="--" if dashed else "-"
        )
    )
    ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + label_dy, label, ha="center", fontsize=8.5, color=color)


def draw(path: Path) -> None:
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, and greppable
    fig, ax = plt.subplots(figsize=(12, 4.6))
    ax.set_xlim(0, 15)
    ax.set_ylim(-0.4, 5.8)
    ax.axis("off")
    box(
        ax,
        0.2,
        1.0,
        4.1,
        4.2,
        TRAINER,
        "trainer (TRL, any Trainer)",
        [
            "optimizer.step()",
            "BF16ChangeDetector",
            "  exact bf16 changes since",
            "  the last published version",
            "Publisher",
            "  v1: anchor; then a delta",
            "  every version, an anchor",
            "  every N; upload in the",
            "  background",
        ],
    )
    box(
        ax,
        5.6,
        1.6,
        3.8,
        3.0,
        BUCKET,
        "bucket",
        [
            "local dir, hf://buckets/...",
            "or s3://...",
            "anchors/step_*.safetensors",
            "deltas/step_*.safetensors",
            "latest.json (written last)",
        ],
    )
    box(
        ax,
        10.7,
        1.0,
        4.1,
        4.2,
        REPLICA,
        "vLLM replica(s)",
        [
            "vllm_ext engine 'delta'",
            "prepare (while generating):",
            "  download, verify checksums",
            "  and signature, apply to",
            "  the node's bf16 snapshot",
            "commit (the short pause):",
            "  load_weights(changed",
            "  tensors only)",
        ],
    )
    arrow(ax, (4.3, 3.7), (5.6, 3.7), "upload")
    arrow(ax, (9.4, 3.7), (10.7, 3.7), "download")
    ax.plot([2.25, 2.25], [1.0, 0.55], color="#333", lw=1.6, linestyle="--")
    ax.plot([2.25, 12.75], [0.55, 0.55], color="#333", lw=1.6, linestyle="--")
    arrow(ax, (12.75, 0.55), (12.75, 1.0), "", dashed=True)
    ax.text(7.5, 0.17, "POST /update_weights {bucket, filename}: a name, never weight bytes", ha="center", fontsize=8.5)
    ax.text(
        7.5,
        -0.3,
        "or the replica follows latest.json by itself (delta-sync follow)",
        ha="center",
        fontsize=8.5,
        style="italic",
    )
    ax.text(
        7.5,
        5.55,
        "every replica ends bit-identical to the trainer's bf16 weights at each version",
        ha="center",
        fontsize=10.5,
    )
    fig.savefig(path, format=path.suffix.lstrip("."), bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("architecture.svg")
    draw(target)
    print(f"wrote {target}")
