"""`agentspec` command line: fetch the model, answer a prompt, run the demo, distill, bench, calibrate,
serve, run a fleet, start a vLLM worker."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

DEMO_PROMPT = (
    "Here is the result of the tool `get_order`:\n"
    '{"order_id": "A-10293", "status": "shipped", "carrier": "DHL", "tracking": "JD014600003451", '
    '"items": [{"sku": "KB-87", "name": "mechanical keyboard", "qty": 1}, '
    '{"sku": "MS-12", "name": "wireless mouse", "qty": 2}]}\n'
    "Tell the customer the status of order A-10293, its carrier and tracking number, and list the items."
)


def _chat_ids(pair, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    out = pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def cmd_fetch(args: argparse.Namespace) -> int:
    from agentspec.models import ensure_default_model

    print(f"default model ready at {ensure_default_model()}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Answer a prompt with the pair, plain and speculative, and print the speed-up."""
    from agentspec import generate, load_pair

    pair = load_pair(args.model, args.draft_model)
    ids = _chat_ids(pair, args.prompt)
    opts = dict(max_new_tokens=args.max_tokens, num_draft_tokens=args.draft_tokens)
    generate(pair, ids[:8], max_new_tokens=2)  # warm-up: first calls pay one-off costs
    t0 = time.perf_counter()
    plain = generate(pair, ids, speculative=False, **opts)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    spec = generate(pair, ids, drafter=args.drafter, **opts)
    t_spec = time.perf_counter() - t0
    print(spec.text)
    print("-" * 72)
    s = spec.stats
    print(f"plain decoding:       {len(plain.token_ids)} tokens in {t_plain:.2f} s")
    print(
        f"speculative ({s.drafter}): {len(spec.token_ids)} tokens in {t_spec:.2f} s, "
        f"acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_acceptance_length:.2f}"
    )
    same = plain.token_ids == spec.token_ids
    print(f"speed-up: {t_plain / t_spec:.2f}x   identical output: {same}")
    return 0 if same else 1


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def cmd_distill(args: argparse.Namespace) -> int:
    """Distill a draft model for the target into --out (see agentspec.distill)."""
    from agentspec.distill import DistillConfig, distill

    if args.architecture == "eagle3":  # speculators' format and trainer (agentspec.distill.heads)
        from agentspec.distill.heads import distill_eagle3

        budget = args.time_budget_s if args.time_budget_s is not None else 3600
        out = distill_eagle3(
            args.target, args.out, prompts=args.prompts or 2000, minutes=budget / 60, responses=args.responses
        )
        print(f"head ready: {out}  (load_pair(..., draft_model={str(out)!r}); vLLM: method 'eagle3')")
        return 0

    given = {
        "architecture": args.architecture,
        "n_layers": args.layers,
        "eagle_unroll": args.eagle_unroll,
        "init_layers": args.init_layers,
        "n_prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.steps,
        "draft_vocab": args.draft_vocab,
        "seed": args.seed,
        "device": args.device,
        "resume": args.resume,
    }
    options = {k: v for k, v in given.items() if v is not None}  # unset: DistillConfig's default
    if args.draft_vocab == 0:
        options["draft_vocab"] = None  # 0: the whole vocabulary (draft_vocab=None)
    if args.time_budget_s is not None:
        options["time_budget_s"] = args.time_budget_s or None  # 0: no limit
    try:
        config = DistillConfig(**options)
    except ValueError as exc:
        print(f"agentspec distill: {exc}", file=sys.stderr)
        return 2
    out = distill(args.target, args.out, config=config)
    print(f"draft ready: {out}  (load_pair(..., draft_model={str(out)!r}))")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure the pair the options name (default: the embedded one) against the baselines."""
    from agentspec.bench.own_pair import PairError, draft_source, load
    from agentspec.bench.run import Settings, run

    settings = Settings(
        mode="full" if args.full else "quick",
        model=args.model,
        draft_model=draft_source(args),
        drafter=args.drafter,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats or 1,
        out=Path(args.out),
        llama_cpp=args.llama_cpp,
        device=args.device,
        dtype=args.dtype,
        static_compiled=args.static_compiled,
    )
    try:
        pair = load(args)
    except PairError as exc:
        print(f"agentspec bench: {exc}", file=sys.stderr)
        return 2
    result = run(settings, pair)
    print(Path(settings.out).with_suffix(".md").read_text())
    print("wrote", Path(settings.out).with_suffix(".json"), *result["plots"])
    return 0 if all(result["single"]["identical_to_generate"].values()) else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Time the target's passes now and print the fitted latency-saved cost model as JSON.

    Tracing never calibrates (its estimate starts from a prior and learns from the passes calls
    make); an app that wants the fit from its first call installs this file's model:
    ``set_cost_model(pair, CostModel(**json.load(f)["cost_model"]))`` (same thread count).
    """
    import json

    import torch

    from agentspec import load_pair
    from agentspec.cost import calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.model, draft_model=False, device=args.device)
    t0 = time.perf_counter()
    cost = calibrate(pair)
    result = {
        "model": pair.name,
        "device": str(pair.device),
        "threads": torch.get_num_threads(),
        "calibration_s": time.perf_counter() - t0,
        "cost_model": cost.as_dict(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "calibrate", help="time the target's passes and print the latency-saved estimate's cost model (JSON)"
    )
    c.add_argument("--model", default=None, help="target: hub id, folder or .gguf (default: embedded)")
    c.add_argument("--device", help="cpu, cuda, ... (default: CUDA when available)")
    c.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    c.add_argument("--out", help="also write the JSON here")
    c.set_defaults(func=cmd_calibrate)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    """The ``generate`` and ``demo`` verbs: one prompt, plain and speculative."""
    for name, help_ in (
        ("generate", "answer a prompt, plain and speculative, and print the speed-up"),
        ("demo", "the main job: answer the demo prompt with the default pair"),
    ):
        p = sub.add_parser(name, help=help_)
        if name == "generate":
            p.add_argument("prompt")
        else:
            p.set_defaults(prompt=DEMO_PROMPT)
        p.add_argument("--model", default=None, help="target: hub id, folder or .gguf (default: embedded)")
        p.add_argument("--draft-model", default=None, help="draft model (default: none)")
        p.add_argument("--drafter", default="auto", help="auto, suffix, model, model_scheduled, ...")
        p.add_argument("--max-tokens", type=int, default=96)
        p.add_argument("--draft-tokens", type=int, default=None, help="cap per pass (default: the drafter's)")
        p.set_defaults(func=cmd_generate)


def _add_distill(sub: argparse._SubParsersAction) -> None:
    """The ``distill`` verb: ``DistillConfig`` fields as options, unset ones left to the config."""
    d = sub.add_parser("distill", help="train a draft model for a target on the target's own responses")
    d.add_argument("--target", default=None, help="hub id, folder or .gguf (default: the embedded model)")
    d.add_argument("--out", required=True, help="the draft folder to write (data/ and checkpoints/ inside)")
    d.add_argument(
        "--architecture",
        choices=("eagle", "layers", "eagle3"),
        help="eagle: one layer on the target's hidden states (default); layers: a small model of tokens; "
        "eagle3: an EAGLE-3 head in the speculators format, trained by speculators in .venv-vllm",
    )
    d.add_argument(
        "--responses", help="eagle3: the responses file to grow and train on (default: the target's)"
    )
    d.add_argument(
        "--eagle-unroll",
        type=int,
        choices=(1, 2),
        help="eagle: 2 also trains a chained step on the head's own output (default 1)",
    )
    d.add_argument("--layers", type=int, help="layers architecture: decoder layers of the draft (default 2)")
    d.add_argument(
        "--init-layers", type=_layer_list, help="target layers to copy, e.g. 0,1 (default: the first n)"
    )
    d.add_argument(
        "--prompts", type=int, help="prompts to answer (default 2000; the data budget may stop first)"
    )
    d.add_argument("--max-new-tokens", type=int, help="response length cap (default 128)")
    d.add_argument("--steps", type=int, help="training steps (default: what the time budget allows)")
    d.add_argument(
        "--time-budget-s", type=float, help="the whole run, in seconds (default 3600; 0: no limit)"
    )
    d.add_argument("--draft-vocab", type=int, help="ids the draft's LM head scores (default 8192; 0: all)")
    d.add_argument("--seed", type=int, help="default 0")
    d.add_argument("--device", help="cpu, cuda, ... (default: CUDA when available)")
    d.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue from --out's data and checkpoints (default) or start over",
    )
    d.set_defaults(func=cmd_distill)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` verb: agentspec against the baselines on the same work, on any pair."""
    from agentspec.bench.own_pair import add_pair_arguments

    b = sub.add_parser(
        "bench",
        help="measure agentspec against transformers generate / assisted generation / prompt lookup "
        "and (optionally) llama.cpp on the same work; writes JSON, Markdown and PNG (the agent loop "
        "against ChatHuggingFace: python -m benchmarks loop)",
    )
    b.add_argument("--full", action="store_true", help="all 8 prompts, longer outputs (~20 min)")
    b.add_argument("--out", default="benchmarks/results/bench", help="path stem of the .json/.md/.png files")
    b.add_argument("--max-new-tokens", type=int, help="per single call (quick 24, full 96)")
    b.add_argument("--repeats", type=int, help="decodes per prompt and system (default 1)")
    b.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (needs llama-cpp-python)")
    add_pair_arguments(
        b,
        drafter_default=None,
        drafter_help="agentspec's rows: 'agentspec none' and this drafter's (default: a row per drafter "
        "the pair can build)",
    )
    b.add_argument(
        "--static-compiled",
        action=argparse.BooleanOptionalAction,
        help="the row of generate() with a static cache and a compiled step (default: on CUDA only; "
        "compiling takes minutes on a small CPU)",
    )
    b.set_defaults(func=cmd_bench)


def api_keys(given: list[str] | None, env: str | None) -> list[str]:
    """The keys of ``--api-key`` (repeatable) and of ``AGENTSPEC_API_KEYS`` (comma-separated), in order."""
    keys = [*(given or []), *(env or "").split(",")]
    return list(dict.fromkeys(k.strip() for k in keys if k.strip()))


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the pair over OpenAI's chat-completions API (``agentspec.serve``) until interrupted."""
    try:
        import uvicorn

        from agentspec.serve import create_app
        from agentspec.serve.app import DEFAULT_MAX_NUM_SEQS
    except ImportError as exc:
        print(
            f"agentspec serve: {exc}; install agentspec-decode's serve extra (docs/install.md)",
            file=sys.stderr,
        )
        return 2
    import torch

    from agentspec import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    draft = False if args.no_draft_model else args.draft_model
    pair = load_pair(args.model, draft, device=args.device, dtype=args.dtype)
    keys = api_keys(args.api_key, os.environ.get("AGENTSPEC_API_KEYS"))
    max_num_seqs = DEFAULT_MAX_NUM_SEQS if args.max_num_seqs is None else args.max_num_seqs
    app = create_app(pair, api_keys=keys, max_num_seqs=max_num_seqs, drafter=args.drafter)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the pair (the `serve` extra)")
    s.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", default=None, help="target: hub id, folder or .gguf (default: embedded)")
    s.add_argument("--draft-model", default=None, help="draft model (default: the embedded target's own)")
    s.add_argument("--no-draft-model", action="store_true", help="no draft model (suffix/n-gram drafts only)")
    s.add_argument("--device", help="cpu, cuda, ... (default: CUDA when available)")
    s.add_argument(
        "--dtype",
        help="float32, bfloat16, auto (default: $AGENTSPEC_DTYPE, else bfloat16 on CUDA, float32 on CPU)",
    )
    s.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    s.add_argument(
        "--drafter", default="auto", help="auto, suffix, model, model_scheduled, prompt_lookup, none"
    )
    s.add_argument(
        "--api-key",
        action="append",
        help="a key requests must bear (Authorization: Bearer); repeatable; also AGENTSPEC_API_KEYS=k1,k2",
    )
    s.add_argument(
        "--max-num-seqs",
        "--queue-size",  # its name before calls shared passes: the fleet's workers are started with it
        dest="max_num_seqs",
        type=int,
        help="sequences running at once (requests admitted, decoding together in the pair's passes); "
        "more get 503, and with API keys a key past ceil(this / keys) of them gets 429 "
        "(default: agentspec.serve's, 16)",
    )
    s.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    s.set_defaults(func=cmd_serve)


def cmd_fleet(args: argparse.Namespace) -> int:
    """N ``agentspec serve`` workers behind vllm-router (``agentspec.fleet``) until interrupted."""
    from agentspec.fleet import Fleet
    from agentspec.fleet.router import router_binary

    if router_binary() is None:
        print(
            "agentspec fleet: vllm-router is missing: install agentspec-decode's dev extra (docs/install.md)",
            file=sys.stderr,
        )
        return 2
    # SIGTERM (a supervisor, a test) stops the workers as Ctrl-C does: through the Fleet's exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    options = [*(["--model", args.model] if args.model else []), "--drafter", args.drafter]
    fleet = Fleet(
        args.workers,
        port=args.port,
        policy=args.policy,
        threads_per_worker=args.threads_per_worker,
        api_keys=api_keys(args.api_key, os.environ.get("AGENTSPEC_API_KEYS")),
        worker_options=options,
        log_dir=args.log_dir,
    )
    print(f"agentspec fleet: starting {args.workers} workers ({args.policy})...", flush=True)
    with fleet:
        for url, cpus, process in zip(fleet.workers, fleet.cpus, fleet.processes):
            print(f"  worker {url} on CPUs {','.join(map(str, cpus))}, log {process.log}", flush=True)
        print(
            f"agentspec fleet: ready at {fleet.url}/v1 (router log {fleet.router.log}); Ctrl-C stops it",
            flush=True,
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def _add_fleet(sub: argparse._SubParsersAction) -> None:
    from agentspec.fleet.router import POLICIES

    f = sub.add_parser("fleet", help="N agentspec serve workers behind vllm-router on 127.0.0.1 (dev extra)")
    f.add_argument("--workers", type=int, default=2, help="agentspec serve workers (default 2)")
    f.add_argument("--port", type=int, default=8000, help="the router's port, the fleet's address")
    f.add_argument("--policy", default="consistent_hash", choices=POLICIES, help="vllm-router's --policy")
    f.add_argument(
        "--threads-per-worker", type=int, help="torch threads of each worker (default: its share of CPUs)"
    )
    f.add_argument("--model", default=None, help="target of every worker (default: embedded)")
    f.add_argument("--drafter", default="auto", help="every worker's --drafter (see agentspec serve)")
    f.add_argument("--api-key", action="append", help="a key requests must bear; repeatable (as serve)")
    f.add_argument(
        "--log-dir", type=Path, help="where router.log and worker-<i>.log go (default: temp files)"
    )
    f.set_defaults(func=cmd_fleet)


def cmd_vllm_worker(args: argparse.Namespace) -> int:
    """Become a vLLM worker on the embedded model (``agentspec.fleet.vllm``) until interrupted: the
    process is replaced, so signals reach vLLM itself."""
    from agentspec.fleet.vllm import VLLM_PYTHON, vllm_worker_command

    python = Path(args.python) if args.python else VLLM_PYTHON
    if not python.exists():
        print(f"agentspec vllm-worker: {python} not found; run `make vllm` first", file=sys.stderr)
        return 2
    try:
        command = vllm_worker_command(
            args.port,
            speculative=not args.no_speculation,
            head=args.head,
            python=python,
            threads=args.threads,
            first_cpu=args.first_cpu,
            eager=args.eager,
        )
    except ValueError as exc:
        print(f"agentspec vllm-worker: {exc}", file=sys.stderr)
        return 2
    os.execvp(command[0], command)


def _add_vllm_worker(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "vllm-worker",
        help="vLLM's OpenAI server on the embedded model, on 127.0.0.1 (needs .venv-vllm: make vllm)",
    )
    w.add_argument("--port", type=int, default=8000)
    w.add_argument("--no-speculation", action="store_true", help="no n-gram speculation (the baseline)")
    w.add_argument(
        "--head", help="draft with this head folder in the speculators format instead (e.g. an EAGLE-3 head)"
    )
    w.add_argument(
        "--threads",
        type=int,
        help="CPU: threads, bound to N allowed CPUs from --first-cpu (default: vLLM's binding)",
    )
    w.add_argument("--first-cpu", type=int, default=0, help="with --threads: the first CPU (default 0)")
    w.add_argument(
        "--eager", action="store_true", help="skip vLLM's start-up compile: starts faster, runs slower"
    )
    w.add_argument("--python", help="the interpreter with vLLM (default: the checkout's .venv-vllm)")
    w.set_defaults(func=cmd_vllm_worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and convert the embedded default model").set_defaults(
        func=cmd_fetch
    )
    _add_generate(sub)
    _add_distill(sub)
    _add_bench(sub)
    _add_calibrate(sub)
    _add_serve(sub)
    _add_fleet(sub)
    _add_vllm_worker(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
