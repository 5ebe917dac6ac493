"""The real-model path end to end, at Qwen3's real vocabulary (151,936) with its real tokenizer.

`python -m ais_jax.tools.random_qwen3` (run in-process through its ``main``) writes a random
two-layer, hidden-64 Qwen3 checkpoint around the real Qwen3 tokenizer files
(``tests/data/qwen3-tokenizer``, as in tests/test_chat_template.py); a made-up GSM8K JSONL of
a dozen lines is the data. Then the
commands a user runs, in-process through `ais_jax.cli.main`: ``train --config
configs/qwen3_0p6b_gsm8k.yaml --set ...`` for 2 GRPO steps (FP8 rollouts, AIS, as configured),
``eval`` (pass@1 / mean@k / maj@k, per-example JSONL), ``sample`` (the prompt ids the sampler
sees are transformers' chat-template ids, starting ``<|im_start|>user``) and ``export-hf``,
whose directory `transformers` loads (weights and tokenizer) with logits equal to ours
(float32, ``|ours - ref| <= 1e-4 max(1, |ref|)``).
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
import safetensors
import torch
import transformers
from test_chat_template import FIXTURE

from ais_jax.cli.main import main
from ais_jax.config import load_config
from ais_jax.io.hf import HFTokenizer, load_hf, read_config
from ais_jax.models import forward
from ais_jax.rollout import sampler
from ais_jax.tools import random_qwen3

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3_0p6b_gsm8k.yaml"
VOCAB, IM_END, ENDOFTEXT, IM_START_USER = 151_936, 151645, 151643, [151644, 872]
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
SMALL += ["--intermediate", "128"]
# 2 prompts x 2 samples per step, 8 new tokens; the whole file is the held-out set too
RUN_SETTINGS = [
    "steps=2",
    "checkpoint_every=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_prompt_len=64",
    "optim.minibatches=1",
    "task.eval_examples=4",
]


def gsm8k_lines() -> str:
    """Twelve made-up GSM8K-format records."""
    names = ["Tom", "Ana", "Li", "Sam", "Eva", "Raj", "Mia", "Oto", "Zoë", "Ben", "Ida", "Kai"]
    rows = []
    for i, name in enumerate(names):
        a, b = 3 + 2 * i, 5 + i
        rows.append(
            {
                "question": f"{name} has {a} apples and buys {b} more. How many apples now?",
                "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }
        )
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def run_cli(argv: list[str]) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory) -> Path:
    """The random checkpoint alone (seconds; `real` trains on it)."""
    ckpt = tmp_path_factory.mktemp("real_ckpt") / "ckpt"
    assert random_qwen3.main(["--tokenizer", str(FIXTURE), "--out", str(ckpt), *SMALL]) == 0
    return ckpt


@pytest.fixture(scope="module")
def real(tmp_path_factory, real_ckpt):
    root = tmp_path_factory.mktemp("real")
    ckpt, data, run = real_ckpt, root / "gsm8k.jsonl", root / "run"
    data.write_text(gsm8k_lines(), encoding="utf-8")
    argv = ["train", "--config", str(CONFIG), "--out", str(run), "--no-progress"]
    argv += ["--set", f"model.checkpoint={ckpt}", "--set", f"task.options.path={data}"]
    argv += ["--set", f"task.eval_path={data}"]
    for setting in RUN_SETTINGS:
        argv += ["--set", setting]
    code, stdout = run_cli(argv)
    return dict(ckpt=ckpt, data=data, run=run, code=code, summary=json.loads(stdout))


def test_random_checkpoint_has_the_real_vocabulary_and_tokenizer(real_ckpt):
    ckpt = real_ckpt
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == VOCAB
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 64)
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END, ENDOFTEXT]
    with safetensors.safe_open(str(ckpt / "model.safetensors"), "numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert embed.shape == (VOCAB, 64) and embed.dtype == np.float32
    assert 0.015 < embed.std() < 0.025 and np.abs(norm - 1).max() > 0.05  # random, not ones
    tok = HFTokenizer(ckpt)
    assert tok.eos_ids == (IM_END, ENDOFTEXT) and tok.chat_template is not None


@pytest.mark.slow
def test_train_on_the_real_shape(real):
    assert real["code"] == 0
    run, summary = real["run"], real["summary"]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values())
    assert all(r["response/length_mean"] > 0 for r in rows)
    assert summary["steps"] == 2 and summary["eval/examples"] == 4
    assert load_config(run / "config.yaml").rollout.format == "float8_e4m3fn"


@pytest.mark.slow
def test_eval_reports_pass_mean_and_maj_at_k(real):
    out = real["run"] / "eval.k2.jsonl"
    argv = ["eval", "--run", str(real["run"]), "--data", str(real["data"]), "--examples", "4"]
    code, stdout = run_cli([*argv, "--k", "2", "--out", str(out)])
    assert code == 0
    result = json.loads(stdout)
    assert (result["examples"], result["k"], result["temperature"]) == (4, 2, 1.0)
    assert {"pass@1", "mean@2", "maj@2", "pass@2"} <= set(result)
    # the same prompts, batch and keys as the run's final evaluation
    for key in ("eval/accuracy", "eval/reward", "eval/sampled_accuracy", "eval/examples"):
        assert result[key] == real["summary"][key], key
    rows = [json.loads(ln) for ln in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4 and all(len(r["samples"]) == 2 for r in rows)
    assert rows[3]["prompt"].startswith("Sam has 9 apples") and rows[3]["ground_truth"] == "17"
    assert result["pass@1"]["value"] == np.mean([r["greedy"]["correct"] for r in rows])


@pytest.mark.slow
def test_sample_prompts_through_the_chat_template(real, monkeypatch):
    seen = []

    def recording(params, config, prompts, key, **kwargs):
        seen.append((np.asarray(prompts), np.asarray(kwargs["prompt_mask"]), kwargs["eos_ids"]))
        return generate(params, config, prompts, key, **kwargs)

    generate = sampler.generate
    monkeypatch.setattr(sampler, "generate", recording)
    prompt = "Lena has 3 apples. How many now? Ünïcode ✓"
    argv = ["sample", "--run", str(real["run"]), "--prompt", prompt, "--n", "2"]
    code, stdout = run_cli([*argv, "--max-new-tokens", "4", "--thinking", "off"])
    assert code == 0
    lines = [json.loads(ln) for ln in stdout.splitlines()]
    assert len(lines) == 2 and all(ln["prompt"] == prompt for ln in lines)
    assert all(math.isfinite(ln["logp"]) and ln["logp"] < 0 for ln in lines)

    ((prompts, mask, eos_ids),) = seen
    reference = transformers.AutoTokenizer.from_pretrained(real["ckpt"]).apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=True,
    )
    reference = list(getattr(reference, "input_ids", reference))
    for row, valid in zip(prompts, mask, strict=True):
        ids = row[valid].tolist()
        assert ids[:2] == IM_START_USER and ids == reference
    assert eos_ids == (IM_END, ENDOFTEXT)


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_equal_logits(real, tmp_path):
    hf_dir = tmp_path / "hf"
    code, _ = run_cli(["export-hf", "--run", str(real["run"]), "--to", str(hf_dir)])
    assert code == 0
    config, params = load_hf(hf_dir, dtype=jnp.float32)
    assert config == read_config(real["ckpt"]) and config.vocab_size == VOCAB

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)  # the tokenizer travelled too
    assert tok.eos_token == "<|im_end|>" and HFTokenizer(hf_dir).eos_ids == (IM_END, ENDOFTEXT)
    messages = [[{"role": "user", "content": q}] for q in ("What is 7 * 6?", "Sum 1..10 ✓")]
    texts = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages
    ]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="np")
    tokens, mask = batch["input_ids"], batch["attention_mask"].astype(bool)
    assert mask[1].sum() < mask[0].sum() or mask[0].sum() < mask[1].sum()  # padding is exercised

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = model(
            input_ids=torch.as_tensor(tokens),
            attention_mask=torch.as_tensor(mask.astype(np.int64)),
            position_ids=torch.as_tensor(positions),
        ).logits.numpy()
    ours = np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))
    ours, ref = ours[mask], ref[mask]
    assert ref.shape[-1] == VOCAB and np.abs(ref).max() > 0.1
    diff = np.abs(ours - ref)
    assert (diff <= 1e-4 * np.maximum(1.0, np.abs(ref))).all(), f"max |diff| {diff.max():.3g}"
