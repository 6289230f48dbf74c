"""Safe loading: no pickle on the load path, remote code only when the user asks for it."""

import ast
import json
import shutil
from pathlib import Path

import pytest

import airquant
from airquant.cli import build_parser
from airquant.engine.runner import Engine
from airquant.errors import StoreError, UnsupportedModelError
from airquant.models import resolve
from airquant.store.manifest import open_store

PACKAGE = Path(airquant.__file__).parent
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "shelve", "marshal", "cloudpickle"}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def unsafe_loads(source: str, where: str) -> list[str]:
    """Every pickle import, pickle-backed load or constant trust_remote_code=True in ``source``."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"{where}:{node.lineno} from {node.module} import ...")
    for call, name in _calls(tree):
        kw = {k.arg: k.value for k in call.keywords}
        if name.endswith("torch.load") or (name == "load" and "map_location" in kw):
            weights_only = kw.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{where}:{call.lineno} {name}(...) without weights_only=True")
        if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant) and not kw["allow_pickle"].value):
            found.append(f"{where}:{call.lineno} {name}(allow_pickle=...)")
        trust = kw.get("trust_remote_code")
        if isinstance(trust, ast.Constant) and trust.value is True:
            found.append(f"{where}:{call.lineno} {name}(trust_remote_code=True)")
        if isinstance(call.func, ast.Name) and call.func.id in ("eval", "exec"):
            found.append(f"{where}:{call.lineno} {call.func.id}(...)")
    return found


def test_the_grep_finds_unsafe_loads():
    bad = ("import pickle\nx = torch.load(f)\ny = torch.load(f, weights_only=False)\n"
           "AutoConfig.from_pretrained(p, trust_remote_code=True)\nnp.load(f, allow_pickle=True)\n")
    assert len(unsafe_loads(bad, "bad.py")) == 5
    assert unsafe_loads("torch.load(f, map_location='cpu', weights_only=True)\n", "ok.py") == []


def test_package_has_no_unsafe_loads():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += unsafe_loads(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == []


@pytest.fixture
def remote_code_model(tmp_path, tiny_llama):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    return folder


def test_remote_code_is_refused_without_the_flag(remote_code_model):
    with pytest.raises(UnsupportedModelError, match="--trust-remote-code"):
        resolve(str(remote_code_model))


def test_shard_has_the_trust_flag_off_by_default():
    parser = build_parser()
    assert parser.parse_args(["shard", "m", "--store", "s"]).trust_remote_code is False
    assert parser.parse_args(["shard", "m", "--store", "s", "--trust-remote-code"]).trust_remote_code is True


def test_store_shards_are_safetensors_only(tiny_store):
    """What the engine loads: safetensors shards and JSON, nothing pickled."""
    suffixes = {p.suffix for p in tiny_store.rglob("*") if p.is_file()}
    assert suffixes <= {".safetensors", ".json", ".jinja", ".txt", ".model", ""}, suffixes


# -- a store or model folder that declares code of its own (auto_map) -----------------------------
def _builds(name: str) -> bool:
    """``X.from_pretrained`` (configs, tokenizers, models) and transformers' ``AutoModel*.from_config``."""
    return name.endswith(".from_pretrained") or (name.endswith(".from_config") and name.startswith("Auto"))


def builds_without_trust(source: str, where: str) -> list[str]:
    """Every config, tokenizer or model build in ``source`` that leaves ``trust_remote_code`` unset (transformers
    then asks [y/N] on a terminal, or fails with a traceback, when a file declares auto_map)."""
    return [f"{where}:{call.lineno} {name}(...)" for call, name in _calls(ast.parse(source))
            if _builds(name) and "trust_remote_code" not in {k.arg for k in call.keywords}]


def test_every_build_passes_trust_remote_code():
    assert builds_without_trust("AutoTokenizer.from_pretrained(p)\nAutoConfig.from_pretrained(p, "
                                "trust_remote_code=False)\n", "x.py") == ["x.py:1 AutoTokenizer.from_pretrained(...)"]
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += builds_without_trust(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == []


EVIL_MODULE = "import pathlib\npathlib.Path({marker!r}).write_text('remote code ran')\n"


def _declare_code(folder: Path, config_name: str, marker: Path) -> Path:
    """``auto_map`` in ``folder/config_name``, pointing at a module that leaves ``marker`` when imported."""
    path = folder / config_name
    body = json.loads(path.read_text())
    body["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilTokenizer", None],
                        "AutoModelForCausalLM": "evil.EvilForCausalLM"}
    path.write_text(json.dumps(body))
    (folder / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    return path


@pytest.mark.parametrize("config_name", ["config.json", "tokenizer/tokenizer_config.json"])
def test_a_store_that_declares_code_is_refused_at_open(tmp_path, tiny_store, config_name):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    marker = tmp_path / "ran"
    path = _declare_code(store if config_name == "config.json" else store / "tokenizer", Path(config_name).name,
                         marker)
    with pytest.raises(StoreError, match=rf"{path} declares Python code of its own \(auto_map: .*never runs code"):
        open_store(store)
    with pytest.raises(StoreError, match=str(path)):
        Engine.open(store, device="cpu")
    from airquant.store.side_files import load_tokenizer, read_config

    with pytest.raises(StoreError, match=str(path)):  # batch jobs, the server and the UI read the tokenizer alone
        load_tokenizer(store / "tokenizer") if "tokenizer" in config_name else read_config(store)
    assert not marker.exists()


def test_a_model_whose_tokenizer_declares_code_is_refused_at_shard(tmp_path, tiny_llama):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    marker = tmp_path / "ran"
    path = _declare_code(folder, "tokenizer_config.json", marker)
    with pytest.raises(UnsupportedModelError, match=rf"{path} names the model's own Python code.*--trust-remote-code"):
        resolve(str(folder))
    assert not marker.exists()
