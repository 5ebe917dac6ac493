"""The Llama family through the whole command line, from a GGUF file.

A tiny random Llama is written as a GGUF file (`test_gguf.write_gguf`: llama.cpp's names and
q/k permutation, Q8_0/Q4_x/F16/BF16 weights, a byte-level BPE tokenizer and a chat template in
its metadata). Then the commands a SmolLM2 user runs, in-process through `ais_jax.cli.main`,
with ``configs/smollm2_arithmetic.yaml`` pointed at that file: ``train`` (chat-formatted
arithmetic, FP8 rollouts, AIS) for 2 GRPO steps, ``eval``, ``sample`` (its prompt ids are
transformers' chat-template ids of the same GGUF) and ``export-hf``, whose directory
`transformers` loads as a ``LlamaForCausalLM`` with logits equal to ours (float32,
``|ours - ref| <= 1e-4 max(1, |ref|)``) and whose tokenizer renders the same chat prompt.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_gguf import LLAMA, MIXED, write_gguf

from ais_jax.cli.main import main
from ais_jax.config import load_config
from ais_jax.io.hf import load_hf
from ais_jax.models import forward
from ais_jax.rollout import sampler

pytestmark = pytest.mark.slow  # every test reads a run the module fixture trains from a GGUF file

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_arithmetic.yaml"
RUN_SETTINGS = [
    "steps=2",
    "checkpoint_every=2",
    "eval_every=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=6",
    "optim.minibatches=1",
    "task.eval_examples=4",
]


def run_cli(argv: list[str]) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_checkpoint):
    root = tmp_path_factory.mktemp("llama_run")
    gguf = write_gguf(hf_checkpoint("llama", **LLAMA), root / "tiny.gguf", types=MIXED)
    out = root / "run"
    argv = ["train", "--config", str(CONFIG), "--out", str(out), "--no-progress"]
    argv += ["--set", f"model.checkpoint={gguf}"]
    for setting in RUN_SETTINGS:
        argv += ["--set", setting]
    code, stdout = run_cli(argv)
    return dict(gguf=gguf, out=out, code=code, summary=json.loads(stdout))


def test_train_from_a_gguf_file(run):
    assert run["code"] == 0
    rows = [json.loads(ln) for ln in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values())
    assert all(r["response/length_mean"] > 0 for r in rows)
    cfg = load_config(run["out"] / "config.yaml")
    assert cfg.rollout.format == "float8_e4m3fn" and cfg.correction.method == "ais"
    assert run["summary"]["steps"] == 2 and run["summary"]["eval/examples"] == 4


def test_eval_of_the_run(run):
    code, stdout = run_cli(["eval", "--run", str(run["out"]), "--examples", "4", "--k", "2"])
    assert code == 0
    result = json.loads(stdout)
    for key in ("eval/accuracy", "eval/reward", "eval/examples"):
        assert result[key] == run["summary"][key], key


def test_sample_prompts_through_the_gguf_chat_template(run, monkeypatch):
    seen = []

    def recording(params, config, prompts, key, **kwargs):
        seen.append((np.asarray(prompts), np.asarray(kwargs["prompt_mask"]), kwargs["eos_ids"]))
        return generate(params, config, prompts, key, **kwargs)

    generate = sampler.generate
    monkeypatch.setattr(sampler, "generate", recording)
    prompt = "What is 12 + 30? Answer with the number only."
    code, stdout = run_cli(["sample", "--run", str(run["out"]), "--prompt", prompt, "--n", "2"])
    assert code == 0 and len(stdout.splitlines()) == 2
    ((prompts, mask, eos_ids),) = seen
    gguf = run["gguf"]
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = ref.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    reference = ref.encode(text, add_special_tokens=False)
    for row, valid in zip(prompts, mask, strict=True):
        assert row[valid].tolist() == reference
    assert eos_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_export_hf_is_a_llama_transformers_loads_with_equal_logits(run, tmp_path):
    hf_dir = tmp_path / "hf"
    code, _ = run_cli(["export-hf", "--run", str(run["out"]), "--to", str(hf_dir)])
    assert code == 0
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    config, params = load_hf(hf_dir, dtype=jnp.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "What is 41 + 17?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\nWhat is 41 + 17?<|im_end|>")
    tokens = np.asarray([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)).logits.numpy()
    ours = np.asarray(forward(params, config, jnp.asarray(tokens)))
    assert np.abs(ref).max() > 0.1
    np.testing.assert_array_less(np.abs(ours - ref), 1e-4 * np.maximum(1.0, np.abs(ref)))
