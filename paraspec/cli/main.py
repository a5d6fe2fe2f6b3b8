"""The `paraspec` command line: generate, serve (and the subcommands other modules register)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

# nothing heavy (torch) at module level: main() protects Ctrl-C first, then imports


def add_model_args(p: argparse.ArgumentParser, several_drafts: bool = False) -> None:
    """Flags shared by every command that builds an Engine (named like the Engine keyword arguments)."""
    from paraspec.strategies import OPTIONS, STRATEGIES

    def show(value, option) -> str:  # None is the option's own word (adaptive: auto)
        return option.none if value is None and option.none else repr(value)

    p.add_argument("--target", required=True, help="target model: checkpoint folder, .gguf file or hub id")
    if several_drafts:
        p.add_argument(
            "--draft",
            action="append",
            help="draft model (needed by every speculative strategy), or "
            "a model-free drafter: 'ngram' (prompt lookup) or 'suffix' (sd, tree, dsi). Several "
            "--draft are tried in order: sd/tree take each round's drafts from the first with any "
            "(--draft ngram --draft MODEL: the hybrid); dsi cuts each chunk from the first that has "
            "drafted it (give one --draft-devices entry per draft model, or one for all)",
        )
    else:
        p.add_argument("--draft", help="draft model (needed by every speculative strategy)")
    for option in OPTIONS.values():  # every strategy's options, from the registry; None: not given
        flag = "--" + option.name.replace("_", "-")
        others = "".join(
            f"; {name}: {show(cls.option_defaults[option.name], option)}"
            for name, cls in STRATEGIES.items()
            if option.name in cls.option_defaults
        )
        help = f"{option.help} (default {show(option.default, option)}{others})"
        if option.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            p.add_argument(flag, type=option.type, default=None, help=help)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto: bfloat16 on GPUs and AMX/AVX512-BF16 CPUs, float32 elsewhere (faster there)",
    )
    p.add_argument(
        "--target-devices",
        nargs="+",
        default=["cpu"],
        metavar="D",
        help="devices of the target: cpu, cpu:N, cpu:A-B, cuda:N; NODE/cpu:0-3 or NODE/cuda:N on a Ray "
        "node (--runtime-kind ray: NODE is a node name, id prefix, custom resource, or head)",
    )
    p.add_argument("--draft-devices", nargs="+", default=["cpu"], metavar="D", help="devices of the draft")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "native", "hf", "llamacpp"],
        help="llamacpp: llama.cpp's quantized CPU kernels on the GGUF file (exact configuration); "
        "native: paraspec's PyTorch decoder (Llama/Qwen2/Mistral); hf: any transformers causal "
        "LM; auto (default): llamacpp for GGUF-backed models on CPU with --dtype auto and a "
        "strategy without token trees, else native",
    )
    p.add_argument("--max-context", type=int, default=4096, help="KV cache size in tokens")
    p.add_argument(
        "--padded-width",
        type=padded_width,
        default="auto",
        metavar="W",
        help="native backend: pad every forward to W rows (one kernel shape, a CUDA graph on GPUs, so "
        "a token's logits do not depend on the forward's width); 'auto' (default): measured on "
        "CUDA, off on CPU; 'none': off",
    )
    p.add_argument(
        "--compile-step",
        action="store_true",
        help="native backend with a padded width: run the padded step through torch.compile (fused "
        "kernels, then a CUDA graph: a faster step on GPUs, docs/GPU.md; a compile per model at load)",
    )
    p.add_argument(
        "--runtime-kind",
        default="process",
        choices=["process", "inprocess", "ray"],
        help="where the workers of amusd, dsi and easyspec (its extra --draft-devices) run: one process "
        "per device group, threads (tests), or Ray actors (pip install 'paraspec[ray]'); ar, sd "
        "and tree start no workers and reject ray",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="--runtime-kind ray: the cluster to join (`ray start --head` "
        "prints it; default: RAY_ADDRESS, else a local Ray)",
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shm", "tcp"],
        help="how workers reach the token channels: auto = shared memory on this host, TCP to workers on "
        "other nodes; tcp forces the network (tests, benchmarks)",
    )
    p.add_argument("--link-latency-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # benchmarks only
    p.add_argument(
        "--allow-vocab-mismatch", action="store_true", help="skip the check that draft and target share a tokenizer"
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)


def padded_width(text: str):
    """--padded-width's values: an integer, 'auto' or 'none'."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, 'auto' or 'none', got {text!r}") from None


def given_options(args) -> dict:
    """The strategy options given on the command line (a flag left out is None: the strategy's default applies)."""
    from paraspec.strategies import OPTIONS

    return {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}


def engine_config(args, strategy: str | None = None, options: dict | None = None):
    """The EngineConfig of add_model_args' flags (validated: every error before any model loads). `options`
    defaults to the options given on the command line; one the strategy does not take is an error."""
    from paraspec.config import EngineConfig

    draft = args.draft[0] if isinstance(args.draft, list) and len(args.draft) == 1 else args.draft
    return EngineConfig(
        target=args.target,
        draft=draft,
        strategy=strategy or args.strategy,
        dtype=args.dtype,
        target_devices=args.target_devices,
        draft_devices=args.draft_devices,
        backend=args.backend,
        max_context=args.max_context,
        allow_vocab_mismatch=args.allow_vocab_mismatch,
        runtime_kind=getattr(args, "runtime_kind", "process"),
        options=given_options(args) if options is None else options,
        transport=getattr(args, "transport", "auto"),
        ray_address=getattr(args, "ray_address", None),
        link_latency_ms=getattr(args, "link_latency_ms", 0.0),
        padded_width=getattr(args, "padded_width", "auto"),
        compile_step=getattr(args, "compile_step", False),
        # one request per command, except `serve` (--max-num-seqs): no sequences held for nobody
        max_num_seqs=getattr(args, "max_num_seqs", 1),
    )


def sampling_params(args):
    from paraspec.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )


def read_prompt(args):
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None
    else:
        text = args.prompt
    return [{"role": "user", "content": text}] if args.chat else text


def cmd_generate(args) -> int:
    from paraspec.engine import Engine

    params = sampling_params(args)
    prompt = read_prompt(args)
    with Engine.from_config(engine_config(args)) as engine:
        if args.json:
            result = engine.generate(prompt, params)
            print(
                json.dumps(
                    {
                        "text": result.text,
                        "token_ids": result.token_ids,
                        "finish_reason": result.finish_reason,
                        "stats": result.stats.to_dict(),
                    }
                )
            )
        else:
            stream = engine.stream(prompt, params)
            try:
                for delta in stream:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
            finally:
                sys.stdout.write("\n")  # also when interrupted: "interrupted" gets a line of its own
                sys.stdout.flush()
            assert stream.result is not None  # read to its end
            print(stream.result.stats.summary(), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from paraspec.engine import Engine
    from paraspec.server import serve

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0 (requests that may wait for the running one), got {args.max_queue}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0 .. 65535 (0: any free port), got {args.port}")
    config = engine_config(args)
    with Engine.from_config(config) as engine:
        return serve(
            engine,
            host=args.host,
            port=args.port,
            model_name=args.served_model_name or str(args.target),
            api_key=args.api_key,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            log_level=args.log_level,
        )


def build_parser() -> argparse.ArgumentParser:
    from paraspec.strategies import STRATEGIES

    parser = argparse.ArgumentParser(
        prog="paraspec",
        description="Lossless speculative decoding on several "
        "devices at once (AMUSD, DSI, EasySpec) and its baselines.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with one strategy, streaming it to stdout")
    add_model_args(gen, several_drafts=True)
    gen.add_argument("--strategy", default="ar", choices=list(STRATEGIES))
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="read the prompt from a file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser(
        "serve",
        help="serve one strategy over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /health, /metrics)",
    )
    add_model_args(srv, several_drafts=True)
    srv.add_argument("--strategy", default="ar", choices=list(STRATEGIES))
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0: any free port (the printed URL names it)")
    srv.add_argument("--served-model-name", help="the model name clients send (default: --target as given)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    srv.add_argument(
        "--max-num-seqs",
        type=int,
        default=4,
        help="requests generated at once, their forwards batched, each answer bit-identical to the "
        "request alone (ar and sd on llama.cpp's kernels; other strategies run one at a time)",
    )
    srv.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait while --max-num-seqs generate; more get 429"
    )
    srv.add_argument(
        "--request-timeout",
        type=float,
        help="seconds a generation may run; then it is stopped with an error (default: no limit)",
    )
    srv.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info: one line per request)",
    )
    srv.set_defaults(func=cmd_serve)

    for module in ("paraspec.cli.bench", "paraspec.cli.simulate", "paraspec.cli.study"):
        try:
            mod = __import__(module, fromlist=["add_commands"])
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.add_commands(sub)
    return parser


class Terminated(Exception):
    """SIGTERM, raised in the main thread so that every `with Engine(...)` closes (and unlinks its segments)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _exit_interrupted(signum, frame):
    """Ctrl-C while paraspec starts (imports, parsing, checks): nothing to clean up yet (no worker, no segment),
    so end at once, without a KeyboardInterrupt raised somewhere inside an import."""
    os.write(2, b"interrupted\n")
    os._exit(130)


def _caused_by(error: BaseException | None, kind: type) -> bool:
    """Whether an exception of `kind` (KeyboardInterrupt, Terminated) is in `error`'s chain: Python wraps one raised
    where it calls back into an object while building a class (3.11: "RuntimeError: Error calling __set_name__"), as
    modules do while they import, and a library may wrap it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _interrupted() -> int:
    """The one line and exit 130. A KeyboardInterrupt raised inside code run by `exec` of a string (dataclasses,
    typing and enum build classes that way while a module imports) leaves CPython's "unhandled KeyboardInterrupt"
    flag set even though we caught it, and `python -m paraspec` would then end by killing itself with SIGINT
    (returncode -2) instead of exiting 130 (CPython 3.10-3.13). An `exec` that completes clears that flag."""
    exec("pass")
    print("interrupted", file=sys.stderr)
    return 130


def main(argv=None) -> int:
    """Ctrl-C at any moment prints one line and exits 130 (workers ignore SIGINT: the Engine stops them);
    SIGTERM closes the Engine the same way and exits 143. Until the command runs, Ctrl-C exits at once
    (`_exit_interrupted`); from then on it raises KeyboardInterrupt, so that every `with Engine(...)` closes."""
    in_main = threading.current_thread() is threading.main_thread()  # (signals are the main thread's)
    previous_int = signal.signal(signal.SIGINT, _exit_interrupted) if in_main else None
    if previous_int is None:  # a handler set outside Python (embedding): Python's default after us
        previous_int = signal.default_int_handler
    previous_term = None
    try:
        parser = build_parser()  # imports torch and the strategies
        args = parser.parse_args(argv)
        import paraspec.engine  # noqa: F401  -- the rest of what a command loads before it starts workers

        if in_main:
            previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
            signal.signal(signal.SIGINT, previous_int)
        return args.func(args)
    except (KeyboardInterrupt, Exception) as e:  # Terminated is an Exception; either may come wrapped
        if _caused_by(e, KeyboardInterrupt):
            return _interrupted()
        if _caused_by(e, Terminated):
            print("terminated", file=sys.stderr)
            return 143
        if isinstance(e, (ValueError, FileNotFoundError)):
            print(f"paraspec: error: {e}", file=sys.stderr)
            return 2
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous_int)
            if previous_term is not None:
                signal.signal(signal.SIGTERM, previous_term)


def run() -> int:
    """The `paraspec` command and `python -m paraspec`: `main`, then, with its command done and its Engine closed, a
    Ctrl-C while the interpreter exits still ends with the one line and 130, not with CPython killing itself by
    SIGINT (returncode -2)."""
    code = main()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_interrupted)
    return code


if __name__ == "__main__":
    sys.exit(run())
