"""Host time a replayed decode step's layer calls cost outside their graphs: the whole pass replayed as one graph
(``layer_graphs.PASS_GRAPHS``, the default), each layer replaying its own graph with the attention captured in it
(static passes, ``engine/decode/slots.py``), and the attention as an eager island between two graphs
(``STATIC_PASSES`` off, the path before), same store, same run.

Why: the Qwen3-30B-A3B batch-1 step was host-bound on the H200 (GPU busy 21.8 of 62 ms traced, wave3_moe12); a
layer's host time is what a step cannot hide. This measures that host time on any machine, with no GPU: the
layer graphs are emulated (``layer_graphs.EmulatedBackend``) and their replay does nothing, so what is left is
the runner (keys, static twins), the streamer and, on the island path, the eager cache write and attention
with its second graph launch. A tiny Qwen3 (16 layers, fp32) decodes at batch 1; each variant runs ``--rounds``
times alternately, ``--steps`` steps each, the median kept.

Prints the figures and their differences per layer, and writes ``results/graph_host_bench.json`` (``--results``).
On the GPU the same differences are what ``moe_bench``'s ``*_island`` and ``*_nopass`` cases show in a step."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airquant.config import GenerateConfig  # noqa: E402
from airquant.engine import layer_graphs, skeleton  # noqa: E402
from airquant.engine.decode import slots  # noqa: E402
from airquant.engine.moe.compute import FUSED_TOKENS  # noqa: E402
from airquant.engine.runner import Engine  # noqa: E402
from airquant.kv.config import KVConfig  # noqa: E402

TOKENIZER_DIR = REPO / "tests" / "data" / "smollm2_tokenizer"


def make_store(folder: Path, layers: int) -> Path:
    from transformers import AutoTokenizer

    from airquant.models import resolve
    from airquant.store.split import split
    from tests.zoo import make_model

    src = resolve(str(make_model(folder / "model", AutoTokenizer.from_pretrained(TOKENIZER_DIR), "qwen3",
                                 num_hidden_layers=layers)))
    split(src, folder / "store", dtype="float32", progress=False)
    return folder / "store"


def step_seconds(store: Path, static: bool, steps: int, carry: bool = True,
                 passes: bool = True, kv=None) -> tuple[float, int, set, dict, float, int]:
    """Seconds a decode step takes with every layer replayed (a no-op replay), the layers, the islands an entry
    holds, the graphs' stats, the seconds a step spends inside its decoder layers' calls (``steps`` more steps,
    each layer call timed: the part of the step the layers' host path costs), and how many of the ``2 * steps``
    steps were left out because a layer warmed up or was captured in them (a TurboQuant cache's keys change as its
    history grows); medians of the steps whose layer calls all replayed. ``carry``: ``layer_graphs.CARRY`` (a
    layer's graph leaves its output in the next one's input); ``passes``: ``layer_graphs.PASS_GRAPHS`` (a pass
    replayed as one graph); ``kv``: the cache's ``KVConfig`` (None: plain)."""
    replay = layer_graphs.EmulatedBackend.__dict__["replay"]  # the staticmethod itself, put back after
    slots.STATIC_PASSES = static
    layer_graphs.CARRY = carry
    layer_graphs.PASS_GRAPHS = passes
    engine = Engine.open(store, device="cpu", dtype="float32", resident_layers=0)
    graphs = layer_graphs.LayerGraphs(layer_graphs.EmulatedBackend(), FUSED_TOKENS)
    skeleton.attach_graphs(engine.model, graphs)
    layers = len(skeleton.decoder_layers(engine.model))
    forward = skeleton.StreamedLayer.forward
    inside = [0.0]

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    def replayed() -> int:
        g = graphs.stats
        return g["replays"] + g["pass_calls"]

    try:
        loop = engine.decode_loop(1, context=64 + 2 * steps + 8, kv=kv)
        loop.submit(engine.request(list(range(5, 25)), GenerateConfig(max_new_tokens=2 * steps + 8, ignore_eos=True)))
        for _ in range(6):  # prefill, warm-up, capture, a replay, the pass graph's capture, its first replay
            loop.step()
        layer_graphs.EmulatedBackend.replay = staticmethod(lambda graph: None)
        took, within, skipped = [], [], 0
        for n in range(2 * steps):  # the steps first, then the layer calls timed
            if n == steps:
                skeleton.StreamedLayer.forward = timed
            before, inside[0] = replayed(), 0.0
            start = time.perf_counter()
            loop.step()
            seconds = time.perf_counter() - start
            if replayed() - before != layers:
                skipped += 1
            elif n < steps:
                took.append(seconds)
            else:
                within.append(inside[0])
        islands = {len(e.islands) for e in graphs._entries.values()}
        return (statistics.median(took), layers, islands, dict(graphs.stats), statistics.median(within),
                skipped)
    finally:
        skeleton.StreamedLayer.forward = forward
        layer_graphs.EmulatedBackend.replay = replay
        slots.STATIC_PASSES = True
        layer_graphs.CARRY = True
        layer_graphs.PASS_GRAPHS = True
        engine.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--results", default=None, help="folder of the results file (default: results/)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp), args.layers)
        # pass: the pass graph; static: each layer's own graph (pass graphs off), the attention in it; island:
        # the attention between two graphs; static_no_carry: as static, the hidden states copied by the host;
        # tq_*: the same three with the TurboQuant cache (K4/V2, a 16-token window: histories quantized and
        # flushed while measured)
        runs: dict[str, list[float]] = {name: [] for name in ("pass", "static", "island", "static_no_carry",
                                                              "tq_pass", "tq_static", "tq_island")}
        calls: dict[str, list[float]] = {name: [] for name in runs}
        skipped: dict[str, int] = {name: 0 for name in runs}
        tq = KVConfig(backend="tq", bits_k=4, bits_v=2, window=16, block=8)
        for _ in range(args.rounds):
            for name in runs:
                plain = name.removeprefix("tq_")
                took, layers, islands, stats, inside, left = step_seconds(
                    store, plain != "island", args.steps, plain != "static_no_carry", plain == "pass",
                    tq if name.startswith("tq_") else None)
                skipped[name] += left
                assert islands == ({1} if plain == "island" else {0}), (name, islands)
                assert (stats["pass_replays"] >= args.steps) == (plain == "pass"), (name, stats)
                runs[name].append(took)
                calls[name].append(inside)
    med = {name: statistics.median(v) for name, v in runs.items()}
    inside = {name: statistics.median(v) for name, v in calls.items()}
    out = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "layers": layers,
           "steps": args.steps, "rounds": args.rounds, "threads": 1,
           "step_ms": {k: v * 1e3 for k, v in med.items()}, "runs_ms": {k: [x * 1e3 for x in v] for k, v in runs.items()},
           "layer_us": {k: v / layers * 1e6 for k, v in med.items()},
           "layer_call_us": {k: v / layers * 1e6 for k, v in inside.items()},
           "steps_left_out": skipped,
           "island_extra_us_per_layer": (med["island"] - med["static"]) / layers * 1e6,
           "carry_saves_us_per_layer": (med["static_no_carry"] - med["static"]) / layers * 1e6,
           "pass_saves_us_per_layer": (med["static"] - med["pass"]) / layers * 1e6,
           "pass_saves_us_per_layer_call": (inside["static"] - inside["pass"]) / layers * 1e6,
           "tq_island_extra_us_per_layer_call": (inside["tq_island"] - inside["tq_static"]) / layers * 1e6,
           "tq_pass_saves_us_per_layer_call": (inside["tq_static"] - inside["tq_pass"]) / layers * 1e6,
           "method": "tiny Qwen3 fp32 at batch 1 on the CPU, layer graphs emulated with a no-op replay: a step's "
                     "host time (runner, streamer, and on the island path the eager cache write and attention "
                     "and the second graph launch; pass: the whole pass replayed as one graph from the first "
                     "layer's call, layer_graphs.PASS_GRAPHS, the other variants with it off; static_no_carry: "
                     "layer_graphs.CARRY off, the hidden states copied into each layer's twin by the host); the "
                     "step includes what is not a layer's (embedding, head, sampling, the loop); layer_call_us: the "
                     "time inside the decoder layers' calls a step (timed in as many further steps), a layer; "
                     "each the median of the steps whose layer calls all replayed (steps_left_out: those in which "
                     "a layer warmed up or was captured, over all rounds); variants alternate, median of the "
                     "rounds"}
    for name in runs:
        print(f"{name:>15}: {out['step_ms'][name]:.3f} ms a step, {out['layer_us'][name]:.1f} us a layer; "
              f"{out['layer_call_us'][name]:.1f} us inside a layer's call")
    print(f"the island costs {out['island_extra_us_per_layer']:.1f} us more a layer on this host")
    print(f"the carried input saves {out['carry_saves_us_per_layer']:.1f} us a layer on this host")
    print(f"the pass graph saves {out['pass_saves_us_per_layer']:.1f} us a layer on this host "
          f"({out['pass_saves_us_per_layer_call']:.1f} us of a layer's call)")
    print(f"TurboQuant: the island costs {out['tq_island_extra_us_per_layer_call']:.1f} us more of a layer's call "
          f"than the static pass, the pass graph saves {out['tq_pass_saves_us_per_layer_call']:.1f} us more")
    path = Path(args.results or (REPO / "results")) / "graph_host_bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
