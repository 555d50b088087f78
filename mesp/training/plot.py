"""loss.png: the training loss per step and the validation loss, from the score before
training (step 0, the run's baseline) on."""

from __future__ import annotations

from pathlib import Path

Series = tuple[list[int], list[float]]


def loss_series(
    losses: list[float], valid: list[dict[str, float]], baseline: dict[str, float] | None = None
) -> dict[str, Series]:
    """What loss.png draws: "train" (one point per trained step) and "valid" (the baseline at
    step 0, then every validation). Without the step-0 point the curve starts after the first
    eval interval and hides most of what training gained."""
    out: dict[str, Series] = {"train": (list(range(1, len(losses) + 1)), list(losses))}
    points = [(int(v["step"]), float(v["loss"])) for v in valid]
    if baseline and not (points and points[0][0] == 0):
        points.insert(0, (0, float(baseline["loss"])))
    if points:
        out["valid"] = ([s for s, _ in points], [x for _, x in points])
    return out


def plot_losses(
    path: Path,
    losses: list[float],
    valid: list[dict[str, float]],
    baseline: dict[str, float] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = loss_series(losses, valid, baseline)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*series["train"], label="train", lw=1)
    if "valid" in series:
        ax.plot(*series["valid"], "o-", label="valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
