"""Every plot kind renders with its text inside the canvas, and a figure holds one device and one setting."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from airquant.eval import plots  # noqa: E402
from airquant.eval.niah import NiahCell, NiahRow  # noqa: E402
from airquant.eval.rows import RunInfo  # noqa: E402

RUN = RunInfo(model="HuggingFaceTB/SmolLM2-135M-Instruct", store_scheme="nf4", kv_scheme="tq-k4v2", dtype="float32",
              device="cpu", device_name="cpu", synthetic=False, streamed=True, hardware={}, versions={},
              timestamp="2026-12-03T10:00:00+00:00")


def niah(contexts: tuple[int, ...]) -> NiahRow:
    cells = tuple(NiahCell(c, d, 0, c - 20, d / 100, "1", "1", 1.0, True) for c in contexts for d in (0.0, 50.0, 100.0))
    return NiahRow(run=RUN, recall=1.0, recall_at_longest=1.0, longest_context=max(contexts), context_lengths=contexts,
                   depths=(0.0, 50.0, 100.0), trials=1, max_new_tokens=16, batch_size=2, chat=True, needle="x",
                   question="x", data_source="x", seconds=1.0, cells=cells)


FIGURES = {
    # The quick profile's heatmap has one context column: its title was cut on both sides.
    "niah-one-context": lambda: plots.niah_figure(niah((512,))),
    "niah-wide": lambda: plots.niah_figure(niah((1024, 2048, 4096, 8192, 16384, 32768))),
    "throughput": lambda: plots.throughput_figure(
        {"BF16 streamed": [(1, 2.5), (4, 8.0)], "NF4 streamed": [(1, 2.5), (4, 8.1)]},
        title="Decode throughput: HuggingFaceTB/SmolLM2-135M-Instruct on CPU", note="prompt 32 tokens, 6 new"),
    "ppl": lambda: plots.ppl_figure(
        [("BF16 streamed", 26.5, None), ("NF4 streamed", 30.1, None), ("NF4 + TQ-KV K4/V2 streamed", 30.9, None)],
        title="WikiText-2 perplexity: HuggingFaceTB/SmolLM2-135M-Instruct on CPU",
        note="1024 tokens, window 512, stride 512"),
}


@pytest.mark.parametrize("kind", FIGURES)
def test_text_fits_inside_the_canvas(kind, tmp_path):
    fig = FIGURES[kind]()
    plots._save(fig, tmp_path / f"{kind}.png")  # draws the figure, as the report does
    tight = fig.get_tightbbox(fig.canvas.get_renderer())  # every artist's extent, in inches
    width, height = fig.get_size_inches()
    slack = 0.02
    assert tight.x0 >= -slack and tight.y0 >= -slack, (kind, tight)
    assert tight.x1 <= width + slack and tight.y1 <= height + slack, (kind, tight, width, height)


def test_log_axes_only_where_they_help():
    close = plots.ppl_figure([("BF16", 26.5, None), ("NF4", 30.1, 24.5)])
    assert close.axes[0].get_yscale() == "linear"
    far = plots.ppl_figure([("BF16", 26.5, None), ("int2", 410.0, None)])
    assert far.axes[0].get_yscale() == "log"
    two = plots.throughput_figure({"a": [(1, 1.0), (4, 2.0)]})
    assert two.axes[0].get_xscale() == "linear" and two.axes[0].get_ylim()[0] == 0
    sweep = plots.throughput_figure({"a": [(1, 1.0), (64, 60.0)]})
    assert sweep.axes[0].get_xscale() == "log"
