"""`ais-jax` command line: thin wrappers over the library.

    ais-jax train     [--config F] [--set k=v ...] [--out DIR] [--resume [--resume-fallback]]
    ais-jax eval      --run DIR [--step N] [--data FILE] [--examples N] [--k 4] [--temperature T]
                      [--out F]
    ais-jax sample    (--run DIR [--step N] | --checkpoint HF_DIR) --prompt TEXT [--n 4]
                      [--format bf16] [--thinking on|off] [--temperature 1] [--max-new-tokens N]
                      [--seed 0]
    ais-jax export-hf --run DIR [--step N] --to HF_DIR
    ais-jax compare   [--config F] [--seeds 5] [--arms bf16,fp8,fp4,fp4+tis,fp4+ais,fp4+mis]
                      [--vary-sft | --start RUN_DIR[@STEP]] [--set k=v ...] [--out DIR]
    ais-jax plan      [--model qwen3-8b] [--mesh data=1,fsdp=1,tensor=1] [--batch 64]
                      [--seq 2048] [--gen-length N]
    ais-jax --help | --version

`train` with no arguments runs the embedded default (configs/quickstart.yaml, shipped in the
package): a tiny Qwen3-style model, SFT warm start, then GRPO with FP8 rollouts and AIS on
built-in arithmetic, on CPU in minutes. Errors in the user's input end in one line on stderr
and exit status 2, not a traceback; so do a full disk, an unwritable --out, an --out that
another live run holds (its lock, paths.claim_run_dir) and a damaged checkpoint, whose line
ends in what that command can do about it: --step N for eval, sample and export-hf (which read
the newest checkpoint unless told another), --resume-fallback for train, and for compare the
folder to delete before it is run again. Ctrl-C or SIGTERM during `train` or `compare`
finishes the current RL step, writes its checkpoint and ends with one line saying how to
resume, exit status 130 or 143 (preemption.py); a second one stops at once. Every JSON
document printed or written is strict JSON: a non-finite number is null, with a warning.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import shlex
import sys
from importlib import resources
from pathlib import Path

from ais_jax.config import SEED_RANGE, show
from ais_jax.io.hf import CheckpointError
from ais_jax.io.paths import dumps_strict, os_error_message, write_atomic
from ais_jax.tasks import RewardError
from ais_jax.train import preemption

log = logging.getLogger("ais_jax.cli")


def default_config_path() -> Path:
    return Path(str(resources.files("ais_jax") / "configs" / "quickstart.yaml"))


def _new_run_dir(prefix: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{prefix}-{stamp}"


def _print_json(obj, where: str, **kwargs) -> None:
    """``obj`` on stdout as strict JSON; non-finite numbers become null, with a warning."""
    text, bad = dumps_strict(obj, **kwargs)
    if bad:
        log.warning("%s: non-finite %s printed as null.", where, bad)
    print(text)


def _require(ok: bool, option: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{option} {show(value)} is invalid: {allowed}.")


def _positive(option: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    _require(1 <= value < 2**31, option, value, "must be an integer in [1, 2**31)")


def _load(args):
    from ais_jax.config import load_config

    return load_config(args.config or default_config_path(), args.set or [])


def _cmd_train(args) -> int:
    from ais_jax.io.checkpoint import UnreadableCheckpoint, steps_words
    from ais_jax.io.run_log import describe
    from ais_jax.train.job import run_training

    out = Path(args.out) if args.out else _new_run_dir("train")
    if args.resume and not args.config and (out / "config.yaml").is_file():
        from ais_jax.config import load_config

        # resuming continues the run's own configuration (plus any --set overrides)
        cfg = load_config(out / "config.yaml", args.set or [])
    else:
        cfg = _load(args)
    if not args.out:  # a directory named here: say which
        print(f"ais-jax train: writing to {out}", file=sys.stderr)
    try:
        with preemption.graceful_stop(out) as stop:
            summary = run_training(
                cfg,
                out,
                resume=args.resume,
                fallback=args.resume_fallback,
                show_progress=not args.no_progress,
            )
    except UnreadableCheckpoint as e:
        if args.resume_fallback:  # every checkpoint failed; the error lists them
            raise
        raise e.advise(
            f"Add --resume-fallback to resume from the newest readable one of {out}'s other "
            f"checkpoints ({steps_words(e.others)})."
            if e.others
            else f"{out} has no other checkpoint to resume from."
        ) from None
    _print_json(summary, "summary", indent=2)
    print(describe(summary), file=sys.stderr)
    return _late_signal(stop, "train", out)


def _late_signal(stop, command: str, out: Path) -> int:
    """A signal that came after the last stop point: the run finished anyway; say so, and
    exit with the signal's status as a stopped process does."""
    if stop is None or stop.signum is None:
        return 0
    import signal

    name = signal.Signals(stop.signum).name
    print(
        f"ais-jax {command}: {name} arrived after the last step; {out} is complete.",
        file=sys.stderr,
    )
    return 128 + stop.signum


def _restored_run(run_dir: Path, step: int | None = None):
    """The run in ``run_dir`` restored from its checkpoint of ``step`` (--step; default: the
    newest). A damaged checkpoint is one error naming the other steps --step can pick."""
    from ais_jax.config import load_config
    from ais_jax.io.checkpoint import UnreadableCheckpoint, steps_words
    from ais_jax.train.job import make_run

    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir} is not a training run directory (no config.yaml).")
    run = make_run(load_config(run_dir / "config.yaml"), run_dir)
    steps = run.checkpointer.steps()
    if step is not None and steps:  # no checkpoint at all: restore says so
        _require(
            step in steps, "--step", step, f"{run_dir} has checkpoints of {steps_words(steps)}"
        )
    try:
        run.restore(step=step)
    except UnreadableCheckpoint as e:
        raise e.advise(
            f"Pick another checkpoint with --step N ({run_dir} also has {steps_words(e.others)})."
            if e.others
            else f"It is {run_dir}'s only checkpoint."
        ) from None
    return run


def _cmd_eval(args) -> int:
    """pass@1 (greedy), mean@k, maj@k and pass@k with 95% intervals (`ais_jax.analysis.evaluation`),
    printed as JSON with the settings they hold for; one row per example in ``--out``."""
    from ais_jax.analysis import evaluation

    _positive("--examples", args.examples, optional=True)
    _positive("--k", args.k)
    if args.temperature is not None:
        _require(
            math.isfinite(args.temperature) and args.temperature > 0,
            "--temperature",
            args.temperature,
            "must be a finite number > 0",
        )
    if args.data is not None and not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data!r} is not a file.")
    run_dir = Path(args.run)
    run = _restored_run(run_dir, args.step)
    step, r = int(run.state.step), run.cfg.rollout
    temperature = r.temperature if args.temperature is None else args.temperature
    draws = run.evaluate_at_k(args.examples, k=args.k, temperature=temperature, data_path=args.data)
    metrics, rows = evaluation.score_draws(draws)
    greedy_rewards, sample_rewards = draws.greedy_rewards_N, draws.sample_rewards_NK
    data_name = (
        args.data or run.cfg.task.eval_path or f"{run.cfg.task.name} held-out split (seed 0)"
    )
    if args.out:
        out = Path(args.out)
    else:
        stem = Path(args.data).stem if args.data else "heldout"
        out = run_dir / "eval" / f"step{step}-{stem}-k{args.k}-t{temperature:g}.jsonl"
    if run.host == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = [dumps_strict(row, ensure_ascii=False)[0] + "\n" for row in rows]
        write_atomic(out, "".join(lines))
    result = {
        "run": str(run_dir),
        "step": step,
        "task": run.cfg.task.name,
        "data": str(data_name),
        "examples": len(rows),
        "k": args.k,
        "temperature": temperature,
        "top_k": r.top_k,
        "top_p": r.top_p,
        "max_new_tokens": r.max_new_tokens,
        "confidence": 0.95,
        "intervals": {name: evaluation.INTERVALS[m.interval] for name, m in metrics.items()},
        **{name: m.to_dict() for name, m in metrics.items()},
        # Run.evaluate's metrics, from the same draws (sample 0 at --temperature)
        "eval/accuracy": float((greedy_rewards >= 1.0).mean()),
        "eval/reward": float(greedy_rewards.mean()),
        "eval/sampled_accuracy": float((sample_rewards[:, 0] >= 1.0).mean()),
        "eval/examples": float(len(rows)),
        "outputs": str(out),
    }
    _print_json(result, "eval", indent=2)
    return 0


def _cmd_sample(args) -> int:
    import jax
    import numpy as np

    from ais_jax.io.hf import HFTokenizer, load_hf, require_decoder
    from ais_jax.rollout.sampler import generate
    from ais_jax.tasks.base import Example
    from ais_jax.train.data import decode_responses, encode_prompts, prompt_ids
    from ais_jax.train.step import sync_rollout_params

    _positive("--n", args.n)
    _positive("--max-new-tokens", args.max_new_tokens, optional=True)
    _require(0 <= args.seed < SEED_RANGE, "--seed", args.seed, "must be an integer in [0, 2**32)")
    _require(
        math.isfinite(args.temperature) and args.temperature > 0,
        "--temperature",
        args.temperature,
        "must be a finite number > 0",
    )
    if args.step is not None and not args.run:
        raise ValueError("--step picks a checkpoint of --run; --checkpoint is one set of weights.")
    if args.run:
        run = _restored_run(Path(args.run), args.step)
        if run.family.kind != "autoregressive":
            raise ValueError(
                f"ais-jax sample: {args.run} is a {run.family.name} ({run.family.kind}) run, "
                "which this command does not sample; ais-jax eval --run RUN --out FILE writes "
                "its responses."
            )
        config, tokenizer, rollout = run.model_config, run.tokenizer, run.cfg.rollout
        params = run.state.params
    else:
        from ais_jax.config import RolloutConfig

        tokenizer = HFTokenizer(args.checkpoint)
        config, params = load_hf(args.checkpoint)  # refuses non-finite weights, naming them
        config = require_decoder(config, args.checkpoint)
        rollout = RolloutConfig()
    import dataclasses

    rollout = dataclasses.replace(rollout, format=args.format)
    # With a chat template the prompt is one user message, ready for the assistant's answer.
    user = ({"role": "user", "content": args.prompt},) if tokenizer.chat_template else None
    prompt = Example(prompt=args.prompt, answer="", demonstration="", messages=user)
    template_kwargs = {} if args.thinking is None else {"enable_thinking": args.thinking == "on"}
    ids = prompt_ids(tokenizer, prompt, template_kwargs)
    prompts, mask = encode_prompts(
        tokenizer, [prompt] * args.n, max(rollout.max_prompt_len, len(ids)), template_kwargs
    )
    ro = generate(
        sync_rollout_params(params, rollout),
        config,
        prompts,
        jax.random.key(args.seed),
        prompt_mask=mask,
        max_new_tokens=args.max_new_tokens or rollout.max_new_tokens,
        temperature=args.temperature,
        eos_ids=tokenizer.eos_ids,
        pad_id=tokenizer.pad_id,
    )
    lengths = np.asarray(ro.lengths) - np.asarray(ro.finished)
    for i, (text, lp, m) in enumerate(
        zip(
            decode_responses(tokenizer, np.asarray(ro.tokens), lengths),
            np.asarray(ro.logp_plain),
            np.asarray(ro.mask),
            strict=True,
        )
    ):
        row = {"prompt": args.prompt, "response": text, "logp": float(lp[m].sum())}
        _print_json(row, f"sample {i}")
    return 0


def _cmd_export(args) -> int:
    from ais_jax.io.hf import save_hf

    run = _restored_run(Path(args.run), args.step)
    path = save_hf(args.to, run.model_config, run.state.params)  # in the family's own layout
    if hasattr(run.tokenizer, "save"):
        run.tokenizer.save(path)
    print(f"wrote {path}")
    return 0


def _cmd_compare(args) -> int:
    from ais_jax.experiments.compare import run_comparison

    _positive("--seeds", args.seeds)
    cfg = _load(args)
    out = Path(args.out) if args.out else _new_run_dir("compare")
    if not args.out:
        print(f"ais-jax compare: writing to {out}", file=sys.stderr)
    # an interrupted comparison continues where it stopped when it is run again
    again = [a for a in args.argv if a != "--no-progress"]
    again += [] if args.out else ["--out", str(out)]
    preemption.set_resume_hint(lambda _: "ais-jax " + shlex.join(again))
    try:
        with preemption.graceful_stop(out) as stop:
            table = run_comparison(
                cfg,
                out,
                seeds=args.seeds,
                arms=args.arms,
                vary_sft=args.vary_sft,
                start=args.start,
                show_progress=not args.no_progress,
            )
    finally:
        preemption.set_resume_hint(None)
    print(table)
    return _late_signal(stop, "compare", out)


def _cmd_plan(args) -> int:
    from ais_jax.cli.plan import main as plan_main

    return plan_main(args)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line too: ``ais-jax <command>: error: ... (see --help)``."""

    def error(self, message: str):
        message = message if len(message) <= 240 else message[:237] + "..."
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ais-jax",
        description=__doc__.split("\n\n")[0],
        # one line per command in `ais-jax --help` (the width of `-V, --version` sets the column)
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=20, width=100),
    )
    p.add_argument("-V", "--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    def with_config(sp):
        sp.add_argument("--config", help="YAML config (default: the embedded quickstart)")
        sp.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="override a config value, e.g. --set rollout.format=float4_e2m1fn",
        )
        sp.add_argument("--out", help="output directory (default: runs/<command>-<time>)")
        sp.add_argument("--no-progress", action="store_true", help="no progress bars")

    t = sub.add_parser("train", help="SFT warm start + GRPO with FP8 rollout and AIS")
    with_config(t)
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint, under the run's own config.yaml (--set may "
        "change steps, checkpoint_every, eval_every, mesh.* and distributed.*)",
    )
    t.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: use the newest *readable* checkpoint if the last is bad",
    )
    t.set_defaults(fn=_cmd_train)

    e = sub.add_parser(
        "eval",
        help="pass@1, mean@k, maj@k, pass@k of a run's latest checkpoint, 95%% intervals",
        description="Evaluate a run's latest checkpoint, or that of --step N (its BF16 policy), "
        "on its held-out set or a JSONL test set (--data, gsm8k/math runs): pass@1 (greedy), "
        "mean@k (mean accuracy of k samples per prompt), maj@k (majority vote over the k final "
        "answers; ties go to the answer sampled first) and pass@k, each with a 95% interval "
        "over prompts (Wilson score for pass@1, maj@k and pass@k; Student t for mean@k). Prints "
        "JSON; writes one row per example (prompt, greedy response, samples, extracted answers, "
        "correct flags) to --out.",
    )
    e.add_argument("--run", required=True)
    e.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the checkpoint of step N, e.g. an older one when the newest is damaged (default: "
        "the newest)",
    )
    e.add_argument(
        "--data", help="JSONL test set in the run's task format (default: the run's held-out set)"
    )
    e.add_argument(
        "--examples",
        type=int,
        default=None,
        help="the first N examples (default: task.eval_examples; all of a --data file)",
    )
    e.add_argument("--k", type=int, default=4, help="samples per prompt (default 4)")
    e.add_argument(
        "--temperature", type=float, default=None, help="(default: the run's rollout.temperature)"
    )
    e.add_argument(
        "--out",
        help="per-example JSONL (default: RUN/eval/step<N>-<data>-k<k>-t<temperature>.jsonl)",
    )
    e.set_defaults(fn=_cmd_eval)

    s = sub.add_parser("sample", help="sample responses from a run or an HF checkpoint")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--run")
    src.add_argument("--checkpoint")
    s.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="with --run: the checkpoint of step N, e.g. an older one when the newest is damaged "
        "(default: the newest)",
    )
    s.add_argument("--prompt", required=True)
    s.add_argument("--n", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--max-new-tokens", type=int, default=None)
    s.add_argument(
        "--format",
        default="bf16",
        help="bf16 (default) or a quant format (float8_e4m3fn...): a --run samples in this, not "
        "its rollout.format (an FP8 run samples in BF16 unless given float8_e4m3fn)",
    )
    s.add_argument(
        "--thinking",
        choices=["on", "off"],
        default=None,
        help="the chat template's enable_thinking (Qwen3); default: the template's own",
    )
    s.set_defaults(fn=_cmd_sample)

    x = sub.add_parser("export-hf", help="write a run's trained params as an HF directory")
    x.add_argument("--run", required=True)
    x.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the checkpoint of step N, e.g. an older one when the newest is damaged (default: "
        "the newest)",
    )
    x.add_argument("--to", required=True)
    x.set_defaults(fn=_cmd_export)

    c = sub.add_parser(
        "compare",
        help="arms (format x correction) x RL seeds from one start: paired statistics, plots",
        description="Train every arm for --seeds RL seeds (config seed, seed+1, ...), all from "
        "one start (one SFT warm start, shared by every arm and seed), evaluate on one held-out "
        "set, and write results.json, results.md (mean and 95% t-interval per arm, paired "
        "differences against the first arm), accuracy.png and diagnostics.png. Re-running "
        "with the same --out skips the finished runs.",
    )
    with_config(c)
    c.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="RL seeds: the config's seed and the next N-1 (default 5)",
    )
    c.add_argument(
        "--arms",
        default=None,
        help="comma-separated FORMAT or FORMAT+METHOD, FORMAT in bf16, fp8 (e4m3), fp8e5, "
        "fp6 (e3m2), fp6e2, fp4 (e2m1), fp8tok (e4m3, per-token activation scales) and METHOD "
        "in tis, ais, mis; the first is the "
        "reference of the paired differences (default: bf16,fp8,fp4,fp4+tis,fp4+ais,fp4+mis)",
    )
    start = c.add_mutually_exclusive_group()
    start.add_argument(
        "--vary-sft",
        action="store_true",
        help="one SFT warm start per RL seed (shared by that seed's arms) instead of one for all",
    )
    start.add_argument(
        "--start",
        metavar="RUN_DIR[@STEP]",
        help="start every arm and seed from this training run's checkpoint (default: its "
        "latest) instead of an SFT warm start",
    )
    c.set_defaults(fn=_cmd_compare)

    pl = sub.add_parser("plan", help="per-device memory of a model on a mesh (no allocation)")
    pl.add_argument("--model", default="qwen3-8b")
    pl.add_argument("--mesh", default="data=1,fsdp=1,tensor=1")
    pl.add_argument("--batch", type=int, default=64)
    pl.add_argument("--seq", type=int, default=2048)
    pl.add_argument(
        "--gen-length",
        dest="gen_length",
        type=int,
        default=None,
        help="diffusion models (llada-8b): response positions of --seq (default: all of them)",
    )
    pl.set_defaults(fn=_cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ais_jax").setLevel(logging.INFO)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv or ["train"])
        if args.command is None:
            argv = ["train", *argv]
            args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error (already reported in one line)
        return e.code if isinstance(e.code, int) else 2
    args.argv = argv or ["train"]
    try:
        return args.fn(args)
    except preemption.Interrupted as e:
        print(f"ais-jax {args.command}: {e}", file=sys.stderr)
        return e.exit_status
    except (ValueError, CheckpointError, FileNotFoundError, RewardError) as e:
        print(f"ais-jax {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a file-size limit, a read-only file system
        print(f"ais-jax {args.command}: error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run's graceful stop (loading, eval, sample)
        print(f"ais-jax {args.command}: interrupted (SIGINT).", file=sys.stderr)
        return 130


def version_line() -> str:
    """``ais-jax 0.1.0 (jax 0.10.2, jaxlib 0.10.2)``, read from the installed distributions
    (nothing imported)."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    from ais_jax import __version__

    return f"ais-jax {__version__} (jax {installed('jax')}, jaxlib {installed('jaxlib')})"


def _one_line(message: str) -> str:
    return " ".join(message.split()) if "\n" in message else message


if __name__ == "__main__":
    sys.exit(main())
