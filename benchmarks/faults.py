"""Fault injection: kill, fill, damage and flood AirQuant, and count what survives.

Each part injects one kind of fault a number of times and checks the promise that goes with it:

- ``shard_kill``: ``kill -9`` of ``airquant shard`` at random moments → the re-run completes, ``info --verify``
  passes, no temp files are left, every shard equals a clean split's;
- ``disk_full``: the disk fills during a split (a small tmpfs; needs root and ``mount``) → a DiskSpaceError with
  the numbers, the shards already written untouched, a re-run completes once space is freed;
- ``damaged``: truncated, one-bit-corrupted, missing and extra shard files, hand-edited manifests → a named error
  (exit 2, the file named), never an answer computed from damaged weights;
- ``batch_kill``: ``kill -9`` of ``airquant batch`` at random moments → after a re-run every id is in the output
  exactly once, and no record finished before the kill is lost or changed;
- ``oom``: an out-of-memory error injected mid-batch → the batch halves, every prompt is answered once;
- ``server_load``: many concurrent clients on loopback → every request answered (200) or refused (429), the
  server alive, its memory flat once warm; ``server_fuzz``: malformed requests from ``hypothesis`` → all 4xx,
  /health answers;
- ``server_attacks``: a lying Content-Length with a chunked body, bodies never sent or never finished, foreign Host
  headers, stop-string/prompt/token floods, a seed over 2^64, a lone surrogate, a 1e-300 temperature beside other
  requests, a client that hangs up (``fault_attacks``) → the refusal each one owes, nothing crosses its scope;
- ``ui_attacks``: server paths as the batch tab's input, a job's files through Gradio, CORS under /ui → refused;
- ``batch_sampling``: ``airquant batch`` with records that cannot be sampled → the job completes, each id once.

Attacks on the store (issue 35): each plants one crafted store or model folder and runs the command a user
would; the promise is a refusal naming the file (exit 2, no traceback) with nothing outside its scope
touched (``crossed_scope``: a file beside the store rewritten, code shipped in a store run, a weight file
outside the model folder read):

- ``store_links``: links in a store (at the temp names a writer would use, as a shard, as the tokenizer
  folder) under ``info --verify``, ``info --upgrade``, ``generate`` and a resumed ``shard``;
- ``store_code``: ``auto_map`` in a store's or a model folder's ``config.json`` / ``tokenizer_config.json``;
- ``weight_map_escape``: a model folder whose index or link names a weight file outside it;
- ``malformed_header``: a shard header of length 2^62 or past the file, an unknown dtype, offsets past the
  data, ``num_layers`` above the shards.

``python -m benchmarks.faults`` prints a table and writes ``results/reliability.json`` (cases tried, survived,
records lost, scope crossed). ``--quick`` uses the tiny counts of the tests; ``--part`` runs one part.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import fault_tools as ft

log = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent.parent / "results" / "reliability.json"
PARTS = ("shard_kill", "disk_full", "damaged", "batch_kill", "oom", "server_load", "server_fuzz")
STORE_ATTACKS = ("store_links", "store_code", "weight_map_escape", "malformed_header")
ATTACK_PARTS = ("server_attacks", "ui_attacks", "batch_sampling")  # issue #35: the server, the UI, sampling


@dataclass
class CaseResult:
    case: str
    tried: int
    survived: int
    records_lost: int = 0
    skipped: str = ""  # why the part did not run (e.g. mount not permitted)
    detail: str = ""
    crossed_scope: int = 0  # cases that reached past their own scope (a file outside a store written or read)

    @property
    def ok(self) -> bool:
        return self.survived == self.tried and self.records_lost == 0 and self.crossed_scope == 0


# -- the store ---------------------------------------------------------------------------------
def shard_kill(model: str, work: Path, moments: int, seed: int = 0) -> CaseResult:
    """kill -9 a split at ``moments`` random times inside a clean split's duration; re-run; compare."""
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    clean = work / "clean"
    took, first = ft.timed_run(ft.cli("shard", model, "--store", clean, "--quiet"), watch=clean / "manifest.json")
    want = ft.checksums(clean)
    survived, notes = 0, []
    for k in range(moments):
        store = work / f"kill{k}"
        at = rng.uniform(first, took)  # between the first shard written and the end
        killed = ft.run_and_kill(ft.cli("shard", model, "--store", store, "--quiet"), at)
        ft.run_ok(ft.cli("shard", model, "--store", store, "--quiet"))
        ft.run_ok(ft.cli("info", "--store", store, "--verify"))
        temps = ft.temp_files(store)
        same = ft.checksums(store) == want
        survived += not temps and same
        if temps or not same:
            notes.append(f"kill at {at:.2f}s: temps {temps[:3]}, same shards {same}")
        shutil.rmtree(store)
        log.info("shard kill %d at %.2fs (killed: %s)", k, at, killed)
    return CaseResult("kill -9 airquant shard", moments, survived, detail="; ".join(notes) or
                      f"kills in {first:.1f}-{took:.1f}s of a {took:.1f}s split")


def disk_full(model: str, work: Path, fill_after: str = "layer.1") -> CaseResult:
    """Fill a small tmpfs after ``fill_after`` is written: DiskSpaceError with numbers, written shards intact."""
    work.mkdir(parents=True, exist_ok=True)
    from airquant.errors import DiskSpaceError
    from airquant.models import resolve
    from airquant.store.manifest import load_manifest, open_store, shard_ok
    from airquant.store.split import estimate_bytes, split

    source = resolve(model)
    need = estimate_bytes(source, "float32")
    mnt = work / "tmpfs"
    why = ft.mount_tmpfs(mnt, ft.split_room(need))
    if why:
        return CaseResult("disk full during a split", 0, 0, skipped=why)
    try:
        store, filler = mnt / "store", mnt / "filler"

        def fill(group, tensors):  # another writer takes every free byte once fill_after is stored
            if group != fill_after and (store / "manifest.json").is_file() and not filler.exists():
                if fill_after in load_manifest(store).shards:
                    ft.fill_disk(filler)
            return tensors, {}

        checks = []
        try:
            split(source, store, dtype="float32", transform=fill, progress=False)
            checks.append(False)  # the split should not have fitted
        except DiskSpaceError as exc:
            msg = str(exc)
            checks.append("MB are free" in msg and "needs" in msg)
        m = load_manifest(store)
        checks.append(bool(m.shards) and all(shard_ok(store, e) for e in m.shards.values()))
        checks.append(not ft.temp_files(store))
        filler.unlink()
        split(source, store, dtype="float32", progress=False)
        open_store(store, verify=True)
        checks.append(True)
    finally:
        ft.unmount(mnt)
    return CaseResult("disk full during a split", 1, int(all(checks)),
                      detail=f"tmpfs of {ft.split_room(need) / 1e6:.0f} MB filled after {fill_after}; checks {checks}")


def damaged(store: Path, work: Path, flips: int, seed: int = 0) -> CaseResult:
    """Every kind of damage, run through `airquant generate`: exit 2 and the damaged file named."""
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cases = ft.damage_cases(store, rng, flips)
    survived, notes = 0, []
    for name, damage, names in cases:
        target = work / "damaged"
        shutil.copytree(store, target)
        damage(target)
        rc, out, err = ft.in_process("generate", target, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2")
        good = rc == 2 and names in err and "Traceback" not in err and "###" not in out
        survived += good
        if not good:
            notes.append(f"{name}: rc {rc}, {err.strip()[-160:]!r}")
        shutil.rmtree(target)
    return CaseResult("damaged store files", len(cases), survived, detail="; ".join(notes))


# -- batch jobs --------------------------------------------------------------------------------
def batch_kill(store: Path, work: Path, moments: int, prompts: int = 24, seed: int = 0) -> CaseResult:
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    inp = work / "prompts.jsonl"
    ft.write_prompts(inp, prompts)
    args = ("--device", "cpu", "--batch-size", "2", "--max-new-tokens", "8", "--quiet")
    clean_out = work / "clean.jsonl"
    took, first = ft.timed_run(ft.cli("batch", store, "--input", inp, "--output", clean_out, *args),
                               watch=clean_out)
    survived, lost, notes = 0, 0, []
    for k in range(moments):
        out = work / f"out{k}.jsonl"
        at = rng.uniform(first, took)
        ft.run_and_kill(ft.cli("batch", store, "--input", inp, "--output", out, *args), at)
        before = ft.complete_records(out)
        ft.run_ok(ft.cli("batch", store, "--input", inp, "--output", out, *args))
        after = ft.complete_records(out)
        ids = [r["id"] for r in after]
        missing = [r for r in before if r not in after]
        lost += len(missing)
        good = sorted(ids) == list(range(prompts)) and not missing
        survived += good
        if not good:
            notes.append(f"kill at {at:.2f}s: {len(ids)} records for {prompts} ids, {len(missing)} lost")
    return CaseResult("kill -9 airquant batch", moments, survived, records_lost=lost,
                      detail="; ".join(notes) or f"kills in {first:.1f}-{took:.1f}s of a {took:.1f}s job")


def oom(store: Path, work: Path, prompts: int = 12, fits: int = 2) -> CaseResult:
    # run_batch with an open engine is the job's public API; the wrapper only adds the failure.
    work.mkdir(parents=True, exist_ok=True)
    """An OutOfMemoryError for any batch above ``fits`` prompts: the job halves until it fits."""
    from airquant.engine.runner import Engine
    from airquant.jobs.batch import BatchJob, run_batch

    inp, out = work / "oom_in.jsonl", work / "oom_out.jsonl"
    ft.write_prompts(inp, prompts)
    engine = Engine.open(store, device="cpu")
    flaky = ft.OOMAbove(engine, fits)
    try:
        report = run_batch(store, BatchJob(input=inp, output=out, batch_size=8, gen=ft.short_gen()),
                           engine=flaky, progress=False)
    finally:
        engine.close()
    ids = [r["id"] for r in ft.complete_records(out)]
    good = (sorted(ids) == list(range(prompts)) and report.oom_halvings >= 1 and flaky.injected >= 1
            and max(report.batch_sizes, default=0) <= fits)
    return CaseResult("OOM injected mid-batch", 1, int(good), records_lost=prompts - len(set(ids)),
                      detail=f"{flaky.injected} OOMs injected, {report.oom_halvings} halvings, batches "
                             f"{sorted(set(report.batch_sizes), reverse=True)}")


# -- the server --------------------------------------------------------------------------------
def server_load(store: Path, clients: int, seconds: float, max_queue: int = 16, warmup: float = 2.0) -> CaseResult:
    """``clients`` flooding the server for ``warmup`` then ``seconds`` seconds; its RSS is checked over the second
    part only. The first requests grow it once (an idle server of the tiny store: 530 MB, 608 MB a second into the
    flood, then 608-609 MB over the next 15 s on this machine): what the check looks for is growth with the number
    of requests, not that one-time step."""
    with ft.ServerProcess(store, "--max-queue", str(max_queue), "--max-batch", "8") as server:
        warm = ft.flood(server, clients, warmup)
        stats = ft.flood(server, clients, seconds)
        alive = server.alive() and ft.health(server.url) == 200
    rss = stats["rss_mb"]  # from the end of the warm-up, once a second
    # Flat: the last quarter of the run holds no more than the first quarter plus a little (allocator noise).
    flat = max(rss[-max(1, len(rss) // 4):]) <= 1.02 * max(rss[: max(1, len(rss) // 4)]) + 16
    sent, ok, rejected = (stats[k] + warm[k] for k in ("requests", "ok", "rejected"))
    bad = sent - ok - rejected
    good = bad == 0 and alive and flat
    kept = sent - bad if good else sent - max(bad, 1)
    return CaseResult(f"{clients} clients for {warmup + seconds:.0f}s", sent, kept,
                      detail=f"{ok} answered, {rejected} refused (429), {bad} other, alive {alive}, RSS "
                             f"{warm['rss_mb'][0]:.0f} MB idle, {rss[0]:.0f}->{rss[-1]:.0f} MB after {warmup:.0f} s "
                             f"(peak {max(rss):.0f}), flat {flat}")


def server_fuzz(store: Path, examples: int, seed: int = 0) -> CaseResult:
    with ft.ServerProcess(store) as server:
        statuses = ft.fuzz(server.url, examples, seed)
        alive = server.alive() and ft.health(server.url) == 200
    bad = [s for s in statuses if not 400 <= s < 500]
    kinds = sorted(set(statuses))
    return CaseResult("malformed requests (hypothesis)", len(statuses), len(statuses) - len(bad) if alive else 0,
                      detail=f"statuses {kinds}, /health after: {'200' if alive else 'DOWN'}")


# -- attacks on the store (issue 35) -----------------------------------------------------------------
def _refused(rc: int, err: str, names: str) -> bool:
    """The promise of every attack: exit 2, the file at fault named, no traceback."""
    return rc == 2 and names in err and "Traceback" not in err


def _attack_cases(cases, run: Path) -> tuple[int, int, list[str]]:
    """``cases``: (name, plant(dir) -> (argv, text the error names, crossed(rc) -> bool)); each in a fresh folder."""
    survived, crossed, notes = 0, 0, []
    for k, (name, plant) in enumerate(cases):
        argv, names, crossed_fn = plant(run / f"case{k}")
        rc, _, err = ft.in_process(*argv)
        went_past = crossed_fn(rc)
        good = _refused(rc, err, names) and not went_past
        survived += good
        crossed += went_past
        if not good:
            notes.append(f"{name}: rc {rc}, crossed {went_past}, {err.strip()[-160:]!r}")
    return survived, crossed, notes


def store_links(store: Path, model: str, work: Path) -> CaseResult:
    """Links inside a store, at the temp names of a write and in place of its files: refused, nothing written."""
    work.mkdir(parents=True, exist_ok=True)

    def victim(d: Path):
        """A file beside the store, and crossed(rc): whether it was rewritten."""
        path = d / "victim.txt"
        path.write_text("outside the store\n")
        return path, lambda rc: path.read_text() != "outside the store\n"

    def planted_temps(cmd: tuple):
        def plant(d: Path):
            target = ft.copy_store(store, d / "store", old_format=True)
            path, rewritten = victim(d)
            ft.plant_temp_links(target, path)  # for this process: the commands run in it
            return (*cmd[:1], "--store", target, *cmd[1:]), ".manifest.json.tmp-", rewritten
        return plant

    def linked(name: str, cmd: str):
        def plant(d: Path):
            target = ft.copy_store(store, d / "store")
            ft.link_out(target / name, d / "elsewhere")
            argv = ("info", "--store", target, "--verify") if cmd == "info" else \
                ("generate", target, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2")
            return argv, name, lambda rc: rc == 0  # crossed: it read through the link and answered
        return plant

    def resumed_shard(d: Path):
        target = ft.copy_store(store, d / "store")
        path, rewritten = victim(d)
        (target / "config.json").unlink()
        (target / "config.json").symlink_to(path)
        return ("shard", model, "--store", target, "--dtype", "float32", "--quiet"), "config.json", rewritten

    cases = [("temp-name links, info --verify", planted_temps(("info", "--verify"))),
             ("temp-name links, info --upgrade", planted_temps(("info", "--upgrade"))),
             ("linked shard, info --verify", linked("layer_0001.safetensors", "info")),
             ("linked shard, generate", linked("layer_0001.safetensors", "generate")),
             ("linked tokenizer folder, generate", linked("tokenizer", "generate")),
             ("linked config.json, resumed shard", resumed_shard)]
    survived, crossed, notes = _attack_cases(cases, work)
    return CaseResult("links inside a store", len(cases), survived, crossed_scope=crossed, detail="; ".join(notes))


def store_code(store: Path, model: str, work: Path) -> CaseResult:
    """``auto_map`` in a store or a model folder: refused at open and at shard; the shipped code never runs."""
    work.mkdir(parents=True, exist_ok=True)
    generate = ("--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2")

    def in_store(rel: str, cmd: str):
        def plant(d: Path):
            target = ft.copy_store(store, d / "store")
            marker = ft.declare_code(target / rel, d / "ran")
            argv = ("generate", target, *generate) if cmd == "generate" else \
                ("batch", target, "--input", ft.one_prompt(d / "in.jsonl"), "--output", d / "out.jsonl", "--device",
                 "cpu", "--max-new-tokens", "2", "--quiet")
            return argv, rel, lambda rc: marker.exists()
        return plant

    def in_model(rel: str):
        def plant(d: Path):
            folder = ft.copy_model(model, d / "model")
            marker = ft.declare_code(folder / rel, d / "ran")
            return ("shard", folder, "--store", d / "store", "--quiet"), rel, lambda rc: marker.exists()
        return plant

    cases = [("store config.json, generate", in_store("config.json", "generate")),
             ("store tokenizer_config.json, generate", in_store("tokenizer/tokenizer_config.json", "generate")),
             ("store tokenizer_config.json, batch", in_store("tokenizer/tokenizer_config.json", "batch"))]
    if Path(model).is_dir():  # a model folder to copy (not `default` or a .gguf file)
        cases += [("model config.json, shard", in_model("config.json")),
                  ("model tokenizer_config.json, shard", in_model("tokenizer_config.json"))]
    survived, crossed, notes = _attack_cases(cases, work)
    return CaseResult("code shipped in a store (auto_map)", len(cases), survived, crossed_scope=crossed,
                      detail="; ".join(notes))


def weight_map_escape(model: str, work: Path) -> CaseResult:
    """A model folder naming weights outside itself (index entry or link): ``shard`` refuses, writes no shard."""
    work.mkdir(parents=True, exist_ok=True)
    if not (Path(model) / "model.safetensors").is_file():
        return CaseResult("weight files outside the model", 0, 0,
                          skipped="needs a model folder of one safetensors file")

    def escape(how: str):
        def plant(d: Path):
            folder = ft.copy_model(model, d / "model")
            entry = ft.weights_outside(folder, d / "outside", how)
            target = d / "store"
            return ("shard", folder, "--store", target, "--quiet"), entry, lambda rc: any(target.glob("*.safetensors"))
        return plant

    cases = [(f"weights {how}", escape(how)) for how in ("relative", "absolute", "link")]
    survived, crossed, notes = _attack_cases(cases, work)
    return CaseResult("weight files outside the model", len(cases), survived, crossed_scope=crossed,
                      detail="; ".join(notes))


def malformed_header(store: Path, work: Path) -> CaseResult:
    """Crafted shard headers and manifests (sizes and checksums recorded to match): a named error."""
    work.mkdir(parents=True, exist_ok=True)

    def crafted(how: str):
        def plant(d: Path):
            target = ft.copy_store(store, d / "store")
            names = ft.craft(target, how)
            return ("generate", target, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", "2"), names, \
                lambda rc: False
        return plant

    cases = [(how, crafted(how)) for how in ft.CRAFTED]
    survived, crossed, notes = _attack_cases(cases, work)
    return CaseResult("malformed store headers", len(cases), survived, crossed_scope=crossed, detail="; ".join(notes))


def run_store_attack(part: str, model: str, store: Path, work: Path) -> CaseResult:
    if part == "store_links":
        return store_links(store, model, work)
    if part == "store_code":
        return store_code(store, model, work)
    if part == "weight_map_escape":
        return weight_map_escape(model, work)
    return malformed_header(store, work)


# -- attacks on the server, the UI and sampling (issue #35) ---------------------------------------
def _attack_result(case: str, outcomes: list, alive: bool | None = None) -> CaseResult:
    """``alive``: whether the attacked server answered /health afterwards (None: no server of its own)."""
    failed = [f"{o.name}: {o.note}" for o in outcomes if not o.held or o.crossed]
    server = "" if alive is None else f", server alive {alive}"
    return CaseResult(case, len(outcomes), sum(o.held and not o.crossed for o in outcomes) if alive is not False
                      else 0, crossed_scope=sum(o.crossed for o in outcomes),
                      detail="; ".join(failed) + server if failed else f"{len(outcomes)} attacks held{server}")


def server_attacks(store: Path) -> CaseResult:
    """Every server attack of ``fault_attacks`` against one keyed server; it must answer /health after."""
    from benchmarks import fault_attacks as fa

    with ft.ServerProcess(store, *fa.SERVER_FLAGS, "--max-batch", "4", "--batch-window-ms", "100") as server:
        outcomes = (fa.body_attacks(server.url) + fa.host_attacks(server.url) + fa.request_attacks(server.url, store)
                    + fa.pass_mate_attacks(server.url) + fa.hang_up_attack(server.url))
        alive = server.alive() and ft.health(server.url) == 200
    return _attack_result("attacks on the server", outcomes, alive)


def ui_attacks(store: Path, work: Path) -> CaseResult:
    """The UI mounted in-process over a provider (needs gradio)."""
    from benchmarks import fault_attacks as fa

    try:
        import gradio  # noqa: F401
    except ImportError:
        return CaseResult("attacks on the UI", 0, 0, skipped="gradio is not installed (requirements-ui.txt)")
    from airquant.jobs.provider import Provider

    work.mkdir(parents=True, exist_ok=True)
    with Provider(store, device="cpu", max_batch=2, batch_window_ms=0) as provider:
        return _attack_result("attacks on the UI", fa.ui_attacks(provider, work))


def batch_sampling(store: Path, work: Path) -> CaseResult:
    """`airquant batch` over records that failed the job on every rerun: it completes, each id once, and a
    rerun has nothing to add."""
    from benchmarks import fault_attacks as fa

    work.mkdir(parents=True, exist_ok=True)
    inp, out = work / "sampling.jsonl", work / "sampling_out.jsonl"
    ids = fa.sampling_records(inp)
    args = ("--device", "cpu", "--batch-size", "4", "--max-new-tokens", "4", "--quiet")
    outcomes = []
    for run in ("first run", "rerun"):
        rc, _, err = ft.in_process("batch", store, "--input", inp, "--output", out, *args)
        got = [r["id"] for r in ft.complete_records(out)]
        outcomes.append(fa.Outcome(f"batch {run}", rc == 0 and sorted(map(str, got)) == sorted(map(str, ids)),
                                   rc != 0, f"rc {rc}, {len(got)} records for {len(ids)} ids {err.strip()[-120:]!r}"))
    got = ft.complete_records(out)
    lost = len(set(map(str, ids)) - {str(r["id"]) for r in got})
    row = _attack_result("records that cannot be sampled", outcomes)
    row.records_lost = lost
    return row


# -- the run -----------------------------------------------------------------------------------
COUNTS = {"full": {"moments": 20, "flips": 20, "clients": 200, "seconds": 60.0, "fuzz": 1000},
          "quick": {"moments": 2, "flips": 3, "clients": 16, "seconds": 4.0, "fuzz": 40}}


def run_part(part: str, model: str, store: Path, work: Path, n: dict) -> CaseResult:
    work.mkdir(parents=True, exist_ok=True)
    if part in STORE_ATTACKS:
        return run_store_attack(part, model, store, work)
    if part == "shard_kill":
        return shard_kill(model, work, n["moments"])
    if part == "disk_full":
        return disk_full(model, work)
    if part == "damaged":
        return damaged(store, work, n["flips"])
    if part == "batch_kill":
        return batch_kill(store, work, n["moments"])
    if part == "oom":
        return oom(store, work)
    if part == "server_load":
        return server_load(store, n["clients"], n["seconds"])
    if part in ATTACK_PARTS:
        return run_attack_part(part, store, work)
    return server_fuzz(store, n["fuzz"])


def run_attack_part(part: str, store: Path, work: Path) -> CaseResult:
    if part == "server_attacks":
        return server_attacks(store)
    if part == "ui_attacks":
        return ui_attacks(store, work)
    return batch_sampling(store, work)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("all",) + PARTS + STORE_ATTACKS + ATTACK_PARTS, default="all")
    p.add_argument("--model", default=None, help="model to split (default: a tiny random Llama, written here)")
    p.add_argument("--quick", action="store_true", help="the tests' tiny counts")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    n = COUNTS["quick" if args.quick else "full"]
    parts = PARTS + STORE_ATTACKS + ATTACK_PARTS if args.part == "all" else (args.part,)
    with tempfile.TemporaryDirectory(prefix="airquant-faults-") as tmp:
        work = Path(tmp)
        model = args.model or str(ft.tiny_model(work / "model"))
        store = work / "store"
        ft.run_ok(ft.cli("shard", model, "--store", store, "--dtype", "float32", "--quiet"))
        rows = []
        for part in parts:
            start = time.perf_counter()
            row = run_part(part, model, store, work / part, n)
            rows.append({"part": part, **asdict(row), "ok": row.ok, "seconds": round(time.perf_counter() - start, 1)})
            print(ft.table_line(rows[-1]), flush=True)
    ft.write_results(args.out, rows, quick=args.quick, model=args.model or "tiny random llama (3 layers)")
    failed = [r["part"] for r in rows if not r["ok"] and not r["skipped"]]
    print(f"{sum(r['tried'] for r in rows)} cases tried, {sum(r['survived'] for r in rows)} survived, "
          f"{sum(r['records_lost'] for r in rows)} records lost, {sum(r['crossed_scope'] for r in rows)} crossed "
          "scope" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
