"""`replayserve demo | generate | serve | make-tiny`: every option has help, its default and its choices;
a user error prints one line (what is wrong, how to fix it) and exits 2; Ctrl-C one line, 130."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from replayserve.config import ENGINE_OPTIONS
from replayserve.config.builtin_models import BUILTIN_MODELS, TINY_CODE, resolve_model

if TYPE_CHECKING:
    from replayserve.outputs import Logprob


class UserError(Exception):
    """A mistake in the invocation: printed as one line, exit status 2."""


# The install command of the server extra, as README's Serving section gives it (a test holds them equal).
SERVER_EXTRA_INSTALL = 'pip install -e ".[server]"'
# server/tool_parsers.py's names, here so that --help needs no server extra (a test holds them equal).
TOOL_CALL_PARSER_NAMES = ("hermes", "nemotron_json")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")  # server/reasoning.py's


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class _SubcommandParser(_Parser):
    """A subcommand's parser. argparse hands arguments a subcommand does not know back to the top
    parser, whose error points to `replayserve --help`; refused here, the error names the
    subcommand's own help, where its options are."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The options of `LLM(...)` but the LLM-only ones, from their table (`config/options.py`),
    shared by every command that builds an engine."""
    g = p.add_argument_group("engine")
    for option in ENGINE_OPTIONS.values():
        if option.llm_only:
            continue
        if option.type is bool:  # every such flag turns on what is off by default
            g.add_argument(option.cli_flag, dest=option.name, action="store_true", help=option.help)
            continue
        # An option whose default is None says in its help what it then is.
        help_text = option.help if option.default is None else f"{option.help} (default %(default)s)"
        g.add_argument(option.cli_flag, dest=option.name, type=_flag_type(option.type), default=option.default,
                       choices=option.choices, metavar=option.metavar, help=help_text)


def _flag_type(hint: Any) -> type | None:
    """What argparse converts a flag's text to: an int or a float; text stays text (a JSON object
    is parsed by `engine_options`, which can say what is wrong with it)."""
    given = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    return given[0] if given[0] in (int, float) else None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """LLM keyword arguments from the parsed engine options."""
    options = {name: getattr(args, name) for name, option in ENGINE_OPTIONS.items() if not option.llm_only}
    if args.speculative is not None:
        try:
            options["speculative"] = json.loads(args.speculative)
        except json.JSONDecodeError as e:
            raise UserError(f"--speculative is not valid JSON ({e.msg}); e.g. "
                            '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from e
        if not isinstance(options["speculative"], dict):
            raise UserError("--speculative must be a JSON object")
    return options


def _add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=TINY_CODE,
                   help="a Hugging Face model directory (config.json, safetensors) or the built-in "
                        f"{TINY_CODE} (default %(default)s)")


def _model_dir(path: str) -> str:
    """The directory `--model` names: a built-in model's, or the path itself when it exists."""
    resolved = resolve_model(path)
    if Path(resolved).exists() and not Path(resolved).is_dir():
        raise UserError(f"--model {path} is a file, not a model directory (a directory with config.json and "
                        f"the safetensors weights, or {TINY_CODE})")
    if not Path(resolved).is_dir():
        raise UserError(f"the model directory {path} does not exist")
    return resolved


def _demo(args: argparse.Namespace) -> None:
    from replayserve.demo import run_demo

    if args.num_drafts < 1:
        raise UserError(f"--num-drafts must be >= 1, got {args.num_drafts}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1 (the rounds the medians are taken over), got {args.repeats}")
    run_demo(_model_dir(args.model), args.max_tokens, args.repeats, args.num_drafts, engine_options(args))


def _generate(args: argparse.Namespace) -> None:
    from replayserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop or [], logprobs=args.logprobs, ignore_eos=args.ignore_eos, n=args.n,
        prompt_logprobs=args.prompt_logprobs,
    )
    with LLM(model=_model_dir(args.model), **engine_options(args)) as llm:
        outputs = llm.generate(args.prompt, params)
    for i, (prompt, out) in enumerate(zip(args.prompt, outputs, strict=True)):
        print(f"=== prompt {i} ===\n{prompt}")
        if out.prompt_logprobs is not None:
            print("prompt logprobs:", *_logprob_lines(out.prompt_token_ids, out.prompt_logprobs), sep="\n")
        for c in out.outputs:
            print(f"--- completion {c.index} (finish: {c.finish_reason}"
                  f"{'' if c.stop_reason is None else f', stop: {c.stop_reason!r}'}) ---\n{c.text}")
            if c.logprobs is not None:
                print("logprobs:", *_logprob_lines(c.token_ids, c.logprobs), sep="\n")


def _logprob_lines(token_ids: list[int], logprobs: list[dict[int, Logprob] | None]) -> list[str]:
    """One line per position: its token, log-probability and rank, then the other top tokens'."""
    def name(token: int, lp: Logprob | None) -> str:
        return f"#{token}" if lp is None or lp.decoded_token is None else repr(lp.decoded_token)

    lines = []
    for i, (token, entry) in enumerate(zip(token_ids, logprobs, strict=True)):
        if entry is None:  # the first prompt token: nothing precedes it
            lines.append(f"  {i}: #{token} -")
            continue
        own = entry[token]
        top = ", ".join(f"{name(t, lp)} {lp.logprob:.4f}" for t, lp in entry.items() if t != token)
        lines.append(f"  {i}: {name(token, own)} {own.logprob:.4f} (rank {own.rank})" + (top and f"; top: {top}"))
    return lines


def _serve(args: argparse.Namespace) -> None:
    try:
        from replayserve.server import create_app, serve
    except ImportError as e:
        raise UserError(f"serve needs the server extra ({e.name} is missing): {SERVER_EXTRA_INSTALL} in the "
                        "replayserve checkout") from e

    if not 1 <= args.port <= 65535 and args.port != 0:
        raise UserError(f"--port must be in [1, 65535] (or 0: any free port), got {args.port}")
    if args.max_waiting_requests < 0:
        raise UserError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not args.keep_alive_timeout > 0:
        raise UserError(f"--keep-alive-timeout must be > 0 seconds, got {args.keep_alive_timeout}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from replayserve.server.core_process import EngineStartError, ProcessCore

    model = _model_dir(args.model)
    core = ProcessCore(model, engine_options(args))
    try:
        core.launch()
    except EngineStartError as e:
        core.stop(0)
        raise UserError(str(e)) from e
    except BaseException:
        core.stop(0)
        raise
    try:
        app = create_app(core, args.served_model_name or served_name(args.model), args.max_waiting_requests,
                         api_key=args.api_key or None, max_request_bytes=args.max_request_bytes,
                         tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
        served = serve(app, args.keep_alive_timeout, args.host, args.port, args.shutdown_timeout)
    finally:
        core.stop()  # the app stops it when it shuts down; this covers a failure before it ran
    if not served:
        print(f"replayserve serve: error: {app.state.engine.death}", file=sys.stderr)
        sys.exit(1)


def served_name(model: str) -> str:
    """The name a model is served under without --served-model-name: a built-in model's own name,
    else its directory's name (not the path, which says where it lies on the server)."""
    return model if model in BUILTIN_MODELS else Path(model).resolve().name


def _make_tiny(args: argparse.Namespace) -> None:
    from replayserve.builtin.tiny import make_tiny

    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise UserError(f"{out} exists and is not an empty directory; pass --force to overwrite it")
    try:
        print(f"wrote {make_tiny(out, seed=args.seed, layers=args.layers, family=args.family, mtp=args.mtp)}")
    except ValueError as e:  # an unknown layer character for the family, --mtp for one without MTP
        raise UserError(str(e)) from e


def _quantize(args: argparse.Namespace) -> None:
    from replayserve.quantize import quantize_from_args

    try:
        print(quantize_from_args(args, _model_dir(args.model_dir)))
    except FileExistsError as e:
        raise UserError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    from replayserve import __version__
    from replayserve.quantize import add_quantize_arguments

    parser = _Parser(prog="replayserve", description="A serving engine for hybrid Mamba2/attention models.")
    parser.add_argument("--version", action="version", version=f"replayserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)

    demo = sub.add_parser("demo", help="continue a few Python prompts with the built-in model; tok/s and "
                                       "acceptance without speculation and with n-gram and MTP drafts")
    _add_model_option(demo)
    # 5 rounds of 56 tokens: on 2 cores shared with two busy processes a demo took 39-53 s, and in
    # two of three sets of three demos every row's medians agreed within 25% (each row's spread in
    # a set: 8-21%; in the third 34% for one row); an idle VM alone moves a whole demo by about 10%.
    demo.add_argument("--max-tokens", type=int, default=56, help="tokens per prompt (default %(default)s)")
    demo.add_argument("--repeats", type=int, default=5,
                      help="timed rounds after a warm-up, each running every configuration once; medians and "
                           "ranges are over them (default %(default)s)")
    demo.add_argument("--num-drafts", type=int, default=3,
                      help="draft tokens per step of the n-gram and MTP rows (default %(default)s)")
    add_engine_options(demo)

    gen = sub.add_parser("generate", help="generate from a model directory")
    _add_model_option(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="(default %(default)s)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default %(default)s)")
    s.add_argument("--top-k", type=int, default=-1, help="-1 is off (default %(default)s)")
    s.add_argument("--top-p", type=float, default=1.0, help="(default %(default)s)")
    s.add_argument("--min-p", type=float, default=0.0, help="(default %(default)s)")
    s.add_argument("--seed", type=int, help="per-request sampling seed")
    s.add_argument("--stop", action="append", help="a stop string; repeat for several")
    s.add_argument("--n", type=int, default=1, help="completions per prompt (default %(default)s)")
    s.add_argument("--logprobs", type=int,
                   help="print each generated token's log-probability and rank and the top-k others' (default: none)")
    s.add_argument("--prompt-logprobs", type=int,
                   help="print the same for each prompt token given the tokens before it (default: none)")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    add_engine_options(gen)

    srv = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    _add_model_option(srv)
    h = srv.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    h.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default %(default)s)")
    h.add_argument("--served-model-name",
                   help="the model name clients send and see (default: the built-in model's name or the model "
                        "directory's name)")
    h.add_argument("--api-key", default=os.environ.get("REPLAYSERVE_API_KEY"),
                   help="every /v1 request must send 'Authorization: Bearer KEY' (default: $REPLAYSERVE_API_KEY; "
                        "unset: no key); /health and /metrics stay open")
    h.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies are answered 413 (default %(default)s)")
    h.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests (a prompt times n) queued beyond the running batch; more are answered 429 "
                        "with Retry-After (default %(default)s)")
    h.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGTERM/SIGINT before they are "
                        "aborted (default %(default)s)")
    # Longer than clients keep idle connections in their pools (httpx, and so the OpenAI client: 5 s;
    # aiohttp: 15 s). At uvicorn's 5 s, equal to httpx's, the server closed a connection just as a client
    # reused it: the request reached a closed socket, the kernel answered with a reset, and the client saw
    # httpx.ReadError (issue 38's cut streams). A client never reuses a connection idle past its own expiry.
    h.add_argument("--keep-alive-timeout", type=float, default=30.0,
                   help="seconds an idle connection stays open; keep it above your clients' idle expiry (httpx: 5) "
                        "or a request sent as the server closes the connection fails (default %(default)s)")
    h.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_NAMES,
                   help="the format of the model's tool calls, for tool_choice 'auto': hermes (<tool_call>{...}"
                        "</tool_call>: Hermes, Qwen) or nemotron_json (<TOOLCALL>[...]</TOOLCALL>: Nemotron-H, "
                        "Nemotron Nano 2); unset: 'auto' is refused, 'required' and named calls still work")
    h.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES,
                   help="split <think>...</think> out of chat replies as reasoning_content (deepseek_r1 and qwen3 "
                        "read them alike); a grammar (response_format, tool calls) then applies after the block")
    add_engine_options(srv)

    tiny = sub.add_parser("make-tiny", help="write a random tiny model of a supported family in Hugging Face format")
    tiny.add_argument("dir", help="the directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (default %(default)s)")
    tiny.add_argument("--family", default="nemotron_h",
                      choices=("nemotron_h", "granite", "bamba", "falcon_h1", "qwen3_next", "qwen3_5", "qwen3_5_moe"),
                      help="the model family (default %(default)s)")
    tiny.add_argument("--layers", default=None,
                      help="layer pattern: M Mamba2, * attention, - MLP, E MoE (nemotron_h only); default M*-ME "
                           "for nemotron_h, M*MM*M for granite and bamba (every layer has its MLP), MMM for "
                           "falcon_h1 (one M per layer, each with both mixers); G Gated DeltaNet, * gated "
                           "attention for the qwen families, default GG*G")
    tiny.add_argument("--mtp", action="store_true",
                      help="also write one MTP layer (mtp.*; nemotron_h and the qwen families), for "
                           "speculative method mtp")
    tiny.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    quant = sub.add_parser("quantize", help="write an FP8 (NVIDIA ModelOpt layout) copy of a 16/32-bit checkpoint "
                                            f"or of {TINY_CODE}")
    add_quantize_arguments(quant)
    return parser


def main(argv: list[str] | None = None) -> None:
    from replayserve.models.loader import CheckpointError

    args = build_parser().parse_args(argv)
    command = {"demo": _demo, "generate": _generate, "serve": _serve, "make-tiny": _make_tiny,
               "quantize": _quantize}[args.command]
    try:
        command(args)
    except (UserError, ValueError, FileNotFoundError, CheckpointError) as e:  # ConfigError is a ValueError
        one_line = " ".join(str(e).split())
        print(f"replayserve {args.command}: error: {one_line}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("replayserve: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
