"""One GPU check in its own process: ``python benchmarks/gpu_probe.py CHECK --device cuda:0``; one JSON line out.

Each check runs in a fresh process because a process that loaded a model on the
CPU has fla blocked (``model.kernels``) and one that loaded it on CUDA has fla
imported: the two kernel sets never share a process. ``tests/test_gpu.py``
asserts on these results; ``benchmarks/gpu_check.py`` collects them into one
file. With ``--device cpu`` every check runs here, on the reference kernels.

Checks (a check whose figures break its tolerance prints them, then exits 1 saying why):
  reference   final logits and states of a prefill, saved for ``kernels`` to compare against (run on cpu)
  kernels     the kernels in use, and the same prefill against the saved reference
  exactness   prefill, host staging, decode (unbatched and batched) against transformers' own greedy
              generate() on the same device and dtype (``model.reference``), bf16 and fp32
  pipelining  a chunked prefill streamed from device memory to a receiver: prefill end to last byte
  runtime     prefill and decode tokens/s
  decode      decode tokens/s batched at 16 streams and one at a time
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from minifaas.model.batch_decoder import make_decoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.host_copy import HostCopier
from minifaas.model.layer_state import ModelState
from minifaas.model.reference import ReferenceRun, divergence, reference_run
from minifaas.model.runtime import ModelRuntime, PrefillResult
from minifaas.model.sampling import SamplingParams
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.transport.sender import KVSender
from minifaas.transport.sender_config import SenderConfig
from minifaas.worker.prefill_service import LayerForwarder

SECRET = b"gpu-probe-secret-0123456789abcdef"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# fla against the torch reference: logits and each state slot within 1% of their largest magnitude. Greedy
# tokens against transformers' generate(): equal on the CPU in float32; elsewhere chunked prefill, batch
# shapes and bfloat16 round differently, so equal up to a first divergence where the reference's logit of
# the token taken is within 1% of its largest |logit| of its top one: a near tie that rounding flipped. (A
# broken state may also first show at a near tie; the CPU tests, held to exact equality, are what catch it.)
TOLERANCE = 0.01


def prompt(n: int) -> list[int]:
    return [(37 * i + 11) % 256 for i in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def reference(model: str, device: str, tokens: int, out: str) -> dict:
    rt = ModelRuntime.load(model, device, dtype=torch.float32)
    result = rt.prefill(prompt(tokens), chunk_tokens=64)
    states = [[t.float().cpu() for _, t in s.slots] for s in result.state.layers]
    torch.save({"logits": result.logits, "states": states}, out)
    return {"model": model, "tokens": tokens, "kernels": rt.kernels.label}


def kernels(model: str, device: str, tokens: int, against: str) -> dict:
    """Tolerance, fp32: |logit diff| <= 1% of the reference logits' largest magnitude, the greedy token
    equal, and each state slot within 1% of its own largest magnitude (fla accumulates in tf32 dots)."""
    rt = ModelRuntime.load(model, device, dtype=torch.float32)
    result = rt.prefill(prompt(tokens), chunk_tokens=64)
    ref = torch.load(against)
    logit_err = float((result.logits - ref["logits"]).abs().max() / ref["logits"].abs().max())
    state_err = 0.0
    for s, slots in zip(result.state.layers, ref["states"], strict=True):
        for (_, t), r in zip(s.slots, slots, strict=True):
            state_err = max(state_err, float((t.float().cpu() - r).abs().max() / max(float(r.abs().max()), 1e-6)))
    same_token = int(result.logits.argmax()) == int(ref["logits"].argmax())
    errors = {"logit error": logit_err, "state error": state_err}
    failures = [f"{what} {err:.4g} over the tolerance {TOLERANCE}" for what, err in errors.items() if err > TOLERANCE]
    failures += [] if same_token else ["the greedy token differs from the reference's"]
    return {"model": model, **rt.kernels.to_json(), "logit_rel_err": logit_err, "state_rel_err": state_err,
            "same_token": same_token, "tolerance": TOLERANCE, "ok": not failures,
            "failures": failures}  # fmt: skip


def staged_prefill(rt: ModelRuntime, ids: list[int], copier: HostCopier) -> tuple[PrefillResult, ModelState]:
    """A chunked prefill whose layers are staged to host memory as the hook hands them on."""
    staged = []
    result = rt.prefill(ids, on_layer=lambda s: staged.append(copier.stage(s)), chunk_tokens=32)
    for _, done in staged:
        if done is not None:
            done.synchronize()
    return result, ModelState([s for s, _ in staged], result.state.seq_len)


def agreement(tokens: list[int], expected: ReferenceRun, tolerance: float) -> dict:
    """One path's tokens against the reference: equal, or where they first differ and the logit gap there."""
    diverged = divergence(tokens, expected)
    if diverged is None:
        return {"equal": True, "ok": True}
    return {"equal": False, "diverged_at": diverged.index, "gap": diverged.gap, "ok": diverged.gap <= tolerance}


def exactness(model: str, device: str, tokens: int) -> dict:
    out: dict = {"model": model, "tokens": tokens, "failures": []}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for name, dtype in DTYPES.items():
        rt = ModelRuntime.load(model, device, dtype=dtype)
        ids = prompt(tokens)
        expected = reference_run(rt, ids, params)
        tolerance = 0.0 if device == "cpu" and dtype == torch.float32 else TOLERANCE
        result, host = staged_prefill(rt, ids, HostCopier(device))
        on_host = all(t.device.type == "cpu" for s in host.layers for _, t in s.slots)
        unbatched = rt.start_decode(host, result.next_token, params).run()
        decoder = make_decoder(rt, DecoderConfig(max_batch=4))
        for i in range(3):
            decoder.submit(f"r{i}", host, result.next_token, params)
        batched: dict[str, list[int]] = {f"r{i}": [result.next_token] for i in range(3)}
        while decoder.load:
            for step in decoder.step():
                batched[step.request].append(step.token)
        paths = {"unbatched": unbatched, **{f"batched {row}": got for row, got in batched.items()}}
        checked = {path: agreement(got, expected, tolerance) for path, got in paths.items()}
        out[name] = {"staged_on_host": on_host, "tolerance": tolerance, **checked}
        for path, c in checked.items():
            if not c["ok"]:
                out["failures"].append(f"{name} {path}: left the reference at token {c['diverged_at']}, "
                                       f"logit gap {c['gap']:.4g} over the tolerance {tolerance}")  # fmt: skip
        if not on_host:
            out["failures"].append(f"{name}: the staged state is not in host memory")
    return {**out, "ok": not out["failures"]}


def pipelining(model: str, device: str, tokens: int) -> dict:
    rt = ModelRuntime.load(model, device)
    ids = prompt(tokens)
    rt.prefill(ids, chunk_tokens=256)  # compiled and autotuned before the timed run

    async def main() -> dict:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            async with KVSender(SenderConfig("127.0.0.1", rx.port, SECRET, connections=4)) as tx:
                async with tx.stream(1, rt.num_states) as out:
                    forward = LayerForwarder(out.put_threadsafe, out.put_tokens_threadsafe, 0, len(ids))
                    start = time.perf_counter()
                    await asyncio.to_thread(
                        rt.prefill, ids, on_layer=forward, chunk_tokens=256, on_tokens=forward.tokens
                    )
                    sync(device)
                    computed = time.perf_counter()
                done = time.perf_counter()
                state = await rx.transfer(1).model_state()
            prefill_s, tail_s = computed - start, done - computed
            return {"model": rt.spec.name, "tokens": tokens, "kv_bytes": state.nbytes, "prefill_s": prefill_s,
                    "tail_s": tail_s, "tail_over_prefill": tail_s / prefill_s, "copy_wait_s": out.copy_wait_s,
                    "goodput_gbit_s": 8 * state.nbytes / (done - start) / 1e9}  # fmt: skip

    return asyncio.run(asyncio.wait_for(main(), 120))


def runtime_speed(model: str, device: str, tokens: int) -> dict:
    rt = ModelRuntime.load(model, device)
    ids = prompt(tokens)
    rt.prefill(ids, chunk_tokens=512)
    sync(device)
    start = time.perf_counter()
    result = rt.prefill(ids, chunk_tokens=512)
    sync(device)
    prefill_s = time.perf_counter() - start
    stream = rt.start_decode(result.state, result.next_token, SamplingParams(max_tokens=33, ignore_eos=True))
    stream.step()
    start, steps = time.perf_counter(), 0
    while not stream.finished:
        stream.step()
        steps += 1
    sync(device)
    decode_s = time.perf_counter() - start
    return {"model": rt.spec.name, "device": device, "kernels": rt.kernels.label, "tokens": tokens,
            "prefill_tok_s": tokens / prefill_s, "decode_tok_s": steps / decode_s}  # fmt: skip


def decode_batching(model: str, device: str, tokens: int, streams: int = 16) -> dict:
    rt = ModelRuntime.load(model, device)
    result = rt.prefill(prompt(tokens))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rates = {}
    for max_batch in (streams, 1):
        decoder = make_decoder(rt, DecoderConfig(max_batch=max_batch))
        for i in range(streams):
            decoder.submit(f"r{i}", result.state, result.next_token, params)
        start, made = time.perf_counter(), 0
        while decoder.load:
            made += len(decoder.step())
        sync(device)
        rates[max_batch] = made / (time.perf_counter() - start)
    return {"model": rt.spec.name, "streams": streams, "batched_tok_s": rates[streams], "unbatched_tok_s": rates[1],
            "ratio": rates[streams] / rates[1]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", choices=("reference", "kernels", "exactness", "pipelining", "runtime", "decode"))
    p.add_argument("--model", default="kimi-linear-tiny")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--streams", type=int, default=16, help="decode: streams at once")
    p.add_argument("--file", default="", help="reference: where to save; kernels: what to compare against")
    a = p.parse_args(argv)
    if a.check in ("reference", "kernels") and not a.file:
        p.error(f"{a.check} needs --file")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    if a.check == "reference":
        result = reference(a.model, a.device, a.tokens, a.file)
    elif a.check == "kernels":
        result = kernels(a.model, a.device, a.tokens, a.file)
    elif a.check == "exactness":
        result = exactness(a.model, a.device, a.tokens)
    elif a.check == "pipelining":
        result = pipelining(a.model, a.device, a.tokens)
    elif a.check == "runtime":
        result = runtime_speed(a.model, a.device, a.tokens)
    else:
        result = decode_batching(a.model, a.device, a.tokens, a.streams)
    print(json.dumps(result))
    if result.get("ok") is False:
        sys.exit(f"{a.check} {a.model} failed: " + "; ".join(result["failures"]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
