"""Safe loading: no pickle on the load path, remote code only when the user asks for it."""

import ast
import json
import shutil
from pathlib import Path

import pytest

import airquant
from airquant.cli import build_parser
from airquant.errors import UnsupportedModelError
from airquant.models import resolve

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
