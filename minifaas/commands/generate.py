"""``minifaas generate``: one prompt through prefill and decode in this process, with timings."""

from __future__ import annotations

import argparse
import time

from minifaas.commands import arguments
from minifaas.commands.arguments import add_model_arguments
from minifaas.commands.main import BadInput, stdout_console, user_input
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.loader import checked_spec, resolve_dtype
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--device", type=arguments.device, default="cpu", help="cpu or cuda:N")
    parser.add_argument("--prompt", default="To be, or not to be, that is the question:", help="the prompt's text")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate (the end token does not stop it)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature; 0: greedy (default: the checkpoint's generation_config.json, else greedy)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    parser.add_argument("--seed", type=int, help="sampling seed (default: none, a fresh one per run)")


def run(args: argparse.Namespace) -> int:
    console = stdout_console()
    with user_input():
        arguments.present_device(args.device)
        checked_spec(args.model, args.trust_remote_code)
        dtype = resolve_dtype(args.dtype, args.device)
    rt = ModelRuntime.load(args.model, args.device, dtype=dtype, trust_remote_code=args.trust_remote_code)
    # by default the checkpoint's generation_config.json: its temperature where it samples, else greedy (a preset)
    config = getattr(rt.model, "generation_config", None)
    default = float(config.temperature or 1.0) if config is not None and config.do_sample else 0.0
    temperature = default if args.temperature is None else args.temperature
    with user_input():
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=temperature, top_p=args.top_p, seed=args.seed, ignore_eos=True
        )
    ids = rt.tokenizer.encode(args.prompt)
    if not ids:
        raise BadInput(f"--prompt: {args.prompt!r} is no tokens to {rt.spec.name}'s tokenizer")
    if len(ids) + args.max_tokens > rt.max_context:
        raise BadInput(f"--prompt of {len(ids)} tokens and --max-tokens {args.max_tokens}: more than "
                       f"{rt.spec.name}'s context of {rt.max_context} tokens")  # fmt: skip
    layers: list[str] = []
    result = rt.prefill(ids, sampling=params, on_layer=lambda s: layers.append(f"{s.layer}:{s.kind.name.lower()}"))
    start = time.perf_counter()
    tokens = DecodeStream(rt, result.state, result.next_token, params).run()
    decode_s = time.perf_counter() - start
    console.print(
        f"[bold]{rt.spec.name}[/] on {args.device}: {len(ids)} prompt tokens, layers handed over in order "
        f"{' '.join(layers)}"
    )
    decoded = len(tokens) - 1  # the first token comes from the prefill
    decode = (
        f"decode {decoded / decode_s:.1f} tokens/s" if decoded else "no decode step (the prefill made the one token)"
    )
    console.print(
        f"state {result.state.nbytes / 1024:.1f} KiB, prefill {len(ids) / result.seconds:.0f} tokens/s, {decode}, "
        + (f"temperature {temperature:g}, seed {params.resolved_seed}" if temperature else "greedy")
    )
    console.print(repr(rt.tokenizer.decode(tokens)))
    return 0
