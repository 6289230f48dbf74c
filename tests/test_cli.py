"""The command line, run in-process."""

import json

import pytest

from airquant.cli import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("shard", "info", "plan", "generate"):
        assert cmd in out


def test_shard_info_generate(tmp_path, tiny_llama, capsys):
    store = tmp_path / "s"
    assert main(["shard", str(tiny_llama), "--store", str(store), "--dtype", "float32", "--quiet"]) == 0
    assert main(["info", "--store", str(store), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "layers     : 3" in out and "every sha256 matches" in out
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n" + json.dumps("The sky is") + "\n")
    args = ["generate", str(store), "--prompts-file", str(prompts), "--max-new-tokens", "5", "--device", "cpu"]
    assert main(args) == 0
    streamed = capsys.readouterr().out
    assert main(args + ["--resident"]) == 0
    assert capsys.readouterr().out == streamed
    assert "### Hello" in streamed


def test_info_takes_the_store_positionally_like_every_command(tiny_store, capsys):
    assert main(["info", str(tiny_store)]) == 0
    positional = capsys.readouterr().out
    assert main(["info", "--store", str(tiny_store)]) == 0
    assert capsys.readouterr().out == positional and "layers     :" in positional
    assert main(["info"]) == 2
    assert "airquant info STORE" in capsys.readouterr().err


def test_a_folder_of_stores_names_its_stores(tiny_store, tmp_path, capsys):
    import shutil

    folder = tmp_path / "store"
    shutil.copytree(tiny_store, folder / "default-bf16")
    (folder / "notes").mkdir()
    for argv in (["generate", str(folder), "--prompt", "x"], ["info", str(folder)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is a folder of stores" in err and str(folder / "default-bf16") in err and "shard" not in err


def test_gpu_only_flags_without_a_gpu_are_named_once(tiny_store, capsys):
    """--max-vram on a CPU run was ignored without a word."""
    base = ["generate", str(tiny_store), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2"]
    assert main(base + ["--max-vram", "4"]) == 0
    err = capsys.readouterr().err
    assert err.count("--max-vram has no effect here (--device cpu)") == 1
    assert main(base) == 0
    assert "no effect" not in capsys.readouterr().err
    assert main(["plan", str(tiny_store), "--device", "cpu", "--max-vram", "4"]) == 0
    assert "--max-vram plans for such a card" in capsys.readouterr().err


def test_plan_says_how_generate_runs_beside_a_resident_choice(tiny_store, capsys):
    """plan (and doctor) said "resident" on a CPU while generate streamed by default."""
    assert main(["plan", str(tiny_store), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "resident" in out.split("choice    :")[1].splitlines()[0]
    assert "generate, batch and eval stream the layers" in out and "unless given --resident" in out
    assert main(["plan", str(tiny_store), "--device", "cpu", "--resident"]) == 0
    assert "runs      :" not in capsys.readouterr().out


def test_plan_prints_tiers(tiny_store, capsys):
    assert main(["plan", str(tiny_store), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "layers pinned in RAM" in out and "why:" in out
    assert main(["plan", str(tiny_store), "--device", "cpu", "--max-vram", "4"]) == 0
    assert "layers resident in VRAM : 0-2" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["info", "--store", "/nonexistent/store"], "does not exist"),
    (["generate", "/nonexistent/store", "--prompt", "x"], "does not exist"),
    (["shard", "/nonexistent/model", "--store", "/tmp/never"], "not a folder"),
])
def test_errors_are_one_line_without_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("airquant: error:") and message in err and "Traceback" not in err


def test_generate_without_prompt(tiny_store, capsys):
    assert main(["generate", str(tiny_store)]) == 2
    assert "no prompt given" in capsys.readouterr().err


def test_generate_takes_the_kv_cache_flags(tiny_store, capsys):
    base = ["generate", str(tiny_store), "--prompt", "the quick brown fox jumps over the lazy dog", "--device", "cpu",
            "--max-new-tokens", "5", "--ignore-eos"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--kv", "tq", "--kv-window", "4", "--kv-block", "2", "--kv-bits-v", "4"]) == 0
    assert capsys.readouterr().out.strip()  # generated through the compressed cache
    assert main(base + ["--kv", "tq", "--kv-window", "1000"]) == 0  # nothing leaves the window: plain results
    assert capsys.readouterr().out == plain
    assert main(base + ["--kv", "tq", "--kv-bits-k", "9"]) == 2
    assert "bits" in capsys.readouterr().err


def test_batch_offers_the_loops_caches_and_generate_the_turboquant_package_too(capsys):
    """A batch job runs the decode loop (plain or tq cache): ``--kv turboquant`` is refused there with the choices,
    and stays offered to generate, which runs the package's cache through transformers' generate."""
    from airquant.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["batch", "store", "--input", "a.jsonl", "--output", "b.jsonl", "--kv", "turboquant"])
    assert "invalid choice: 'turboquant'" in capsys.readouterr().err
    assert parser.parse_args(["generate", "store", "--prompt", "hi", "--kv", "turboquant"]).kv == "turboquant"
