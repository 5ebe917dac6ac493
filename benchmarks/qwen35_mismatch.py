"""FP8-vs-BF16 mismatch of a random Qwen3.5-shaped model next to a Qwen3-shaped one of equal size.

The two policies of the paper: the BF16 trainer (bfloat16 params) and the FP8 rollout engine
(W8A8 per-tensor copy of the same params: `quant.quantize_fp8` for Qwen3,
`qwen35.quantize_params` for Qwen3.5, which also quantizes ``in_proj_qkv/z/b/a`` and
``out_proj``). Both score the same random token sequences (teacher forcing, one forward each);
at every valid position a token is drawn from the FP8 distribution (as a rollout would) and
`ais.mismatch_metrics` compares ``logp_bf16`` with ``logp_fp8`` there: mean |dlogp|, the k3 KL
estimate, and the token ESS ratio ``(sum r)^2 / (n sum r^2)``, ``r = pi_bf16 / pi_fp8``. Rows
are left-padded to several lengths, so the padding paths run too.

Random weights are variance-preserving (every projection N(0, 1/fan_in), depthwise conv taps
N(0, 1/X), embeddings N(0, 1), an untied LM head N(0, 4/D) so next-token entropies are a few
nats), norms and the Gated DeltaNet decay parameters as Hugging Face initialises them. Both
models share vocabulary, width, depth and attention shape; Qwen3.5's linear-attention layers
have as many key heads as attention heads and twice as many value heads (Qwen3.5-9B: 16 and
32), of the attention head dim, and its MLP width is set so the parameter counts match within
1%.

    python benchmarks/qwen35_mismatch.py                 # default: D 256, 8 layers, V 8192
    python benchmarks/qwen35_mismatch.py --hidden 512 --layers 8 --seqs 4 --seq-len 256
    python benchmarks/qwen35_mismatch.py --ablate      # + FP8 on one projection group only

It prints the host line, one table and a JSON line. CPU is fine: XLA emulates FP8 with the same
roundings.
"""

from __future__ import annotations

import argparse
import json
import time

import common
import jax
import jax.numpy as jnp
import numpy as np

from ais_jax import models as model
from ais_jax.ais import mismatch_metrics
from ais_jax.models import qwen35
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn.layers import cast_params
from ais_jax.nn.quant import LINEAR_WEIGHTS, quantize_fp8


def configs(args) -> tuple[ModelConfig, qwen35.Qwen35Config]:
    D, L, H = args.hidden, args.layers, args.heads
    E = D // H
    qwen3 = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=D,
        num_layers=L,
        num_heads=H,
        num_kv_heads=max(1, H // 4),
        head_dim=E,
        intermediate_size=3 * D,
        tie_embeddings=False,
        max_position_embeddings=4096,
    )
    layer_types = tuple(
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)
    )
    shape = dict(
        vocab_size=args.vocab,
        hidden_size=D,
        num_layers=L,
        num_heads=H,
        num_kv_heads=max(1, H // 4),
        head_dim=E,
        layer_types=layer_types,
        linear_num_key_heads=H,
        linear_num_value_heads=2 * H,
        linear_key_head_dim=E,
        linear_value_head_dim=E,
        tie_embeddings=False,
        max_position_embeddings=4096,
    )
    probe = qwen35.Qwen35Config(intermediate_size=3 * D, **shape)
    mlp_params_per_unit = 3 * D * L
    F = 3 * D + round((qwen3.num_params - probe.num_params) / mlp_params_per_unit)
    return qwen3, qwen35.Qwen35Config(intermediate_size=max(F, 8), **shape)


def variance_preserving(params, key):
    """Every ``[..., O, I]`` matrix N(0, 1/I), conv taps N(0, 1/X), embed N(0, 1), lm_head
    N(0, 4/D); everything else (norms, a_log, dt_bias) as initialised."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        if "embed" in name:
            out.append(noise)
        elif "lm_head" in name:
            out.append(noise * 2.0 / np.sqrt(leaf.shape[-1]))
        elif "conv_weight" in name or (leaf.ndim == 3 and "norm" not in name):
            out.append(noise / np.sqrt(leaf.shape[-1]))
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def measure(name, forward, config, params, fp8, tokens_BS, mask_BS, key) -> dict:
    bf16 = cast_params(params, jnp.bfloat16)
    run = jax.jit(forward, static_argnums=1)
    t0 = time.perf_counter()
    logp_train = jax.nn.log_softmax(run(bf16, config, tokens_BS, mask_BS), -1)
    logp_rollout = jax.nn.log_softmax(run(fp8, config, tokens_BS, mask_BS), -1)
    sampled_BS = jax.random.categorical(key, logp_rollout)
    pick = lambda lp: jnp.take_along_axis(lp, sampled_BS[..., None], -1)[..., 0]  # noqa: E731
    m = mismatch_metrics(pick(logp_train), pick(logp_rollout), mask_BS)
    entropy = -(jnp.exp(logp_train) * logp_train).sum(-1)
    return {
        "model": name,
        "params_M": round(config.num_params / 1e6, 2),
        "mean_abs_dlogp": float(m["mismatch/mean_abs"]),
        "k3": float(m["mismatch/k3"]),
        "token_ess_ratio": float(m["mismatch/ess_ratio_raw"]),
        "ratio_max": float(m["mismatch/ratio_max"]),
        "entropy_nats": float(entropy[mask_BS].mean()),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ablate",
        action="store_true",
        help="also Qwen3.5 with FP8 on only its DeltaNet projections, or only the others",
    )
    args = p.parse_args()

    qwen3_config, qwen35_config = configs(args)
    key_w3, key_w35, key_tok, key_s3, key_s35 = jax.random.split(jax.random.key(args.seed), 5)
    tokens_BS = jax.random.randint(key_tok, (args.seqs, args.seq_len), 0, args.vocab)
    pads = np.linspace(0, args.seq_len // 2, args.seqs).astype(int)
    mask_BS = jnp.asarray(np.arange(args.seq_len)[None] >= pads[:, None])

    p3 = variance_preserving(model.init_params(qwen3_config, key_w3), key_w3)
    p35 = variance_preserving(qwen35.init_params(qwen35_config, key_w35), key_w35)
    fp8_35 = qwen35.quantize_params(p35)
    variants = [("qwen3.5", fp8_35)]
    if args.ablate:  # FP8 on one group of Qwen3.5's projections, bf16 elsewhere
        bf16_35 = cast_params(p35, jnp.bfloat16)
        for label, names in (
            ("  +DeltaNet proj only", qwen35.LINEAR_ATTENTION_WEIGHTS),
            ("  +attn/MLP proj only", tuple(n for n in fp8_35["layers"] if n in LINEAR_WEIGHTS)),
        ):
            layers = {**bf16_35["layers"], **{n: fp8_35["layers"][n] for n in names}}
            variants.append((label, {**bf16_35, "layers": layers}))
    rows = [
        measure(
            "qwen3", model.forward, qwen3_config, p3, quantize_fp8(p3), tokens_BS, mask_BS, key_s3
        )
    ] + [
        measure(label, qwen35.forward, qwen35_config, p35, fp8, tokens_BS, mask_BS, key_s35)
        for label, fp8 in variants
    ]
    print(common.host_line(jax_version=True))
    print(
        f"D={args.hidden} L={args.layers} H={args.heads} V={args.vocab} "
        f"tokens={int(mask_BS.sum())} (left-padded rows); "
        f"qwen3.5 F={qwen35_config.intermediate_size}"
    )
    print(
        f"{'model':22} {'params':>8} {'mean|dlogp|':>12} {'k3':>10} {'ESS ratio':>10} "
        f"{'max r':>8} {'H (nats)':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:22} {r['params_M']:7.2f}M {r['mean_abs_dlogp']:12.4f} {r['k3']:10.5f} "
            f"{r['token_ess_ratio']:10.4f} {r['ratio_max']:8.3f} {r['entropy_nats']:9.2f}"
        )
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
