"""`cdpjax plot`'s figure: no panel's text runs into another's."""
import json

from cdpjax.commands import plot as plot_cmd


def test_curves_panels_do_not_overlap(tmp_path):
    """The top row's x labels and tick labels sit above the bottom row's titles, and no two panels'
    boxes (axes with their labels and titles) intersect, as drawn."""
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "split": split, "loss": 2.0 / s, "accuracy": 1 - 1 / s}
               for s in (1000, 2000, 3000) for split in ("train", "test")]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = plot_cmd.plot_curves([str(run)], str(tmp_path / "curves.png"))
    renderer = fig.canvas.get_renderer()
    top, bottom = fig.axes[:2], fig.axes[2:]
    for upper in top:
        lowest = min(upper.xaxis.label.get_window_extent(renderer).y0,
                     *(t.get_window_extent(renderer).y0 for t in upper.get_xticklabels() if t.get_text()))
        for lower in bottom:
            assert lowest > lower.title.get_window_extent(renderer).y1, (upper.get_ylabel(), lower.get_title())
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b)
