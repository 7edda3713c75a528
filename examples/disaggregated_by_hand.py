"""Disaggregated generation by hand: prefill in one process, decode in another, layers streamed between.

A child process prefills the prompt and, from the per-layer callback, writes
each layer's state to a TCP socket as soon as its forward ends (u64 length +
``state_codec`` bytes; times below are since it connected). This process
rebuilds the state and decodes; the tokens must equal transformers' own
``generate`` on the same weights, which shares none of this state handling
(``model.reference``; preset weights are seeded noise, so equality counts).

    python examples/disaggregated_by_hand.py
"""

from __future__ import annotations

import multiprocessing
import socket
import struct
import time

from minifaas.model import state_codec
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.layer_state import LayerState, ModelState
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

PROMPT = "Prefill here, decode over there: every layer's state crosses a socket."
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
LENGTH = struct.Struct("<Q")


def prefill_side(port: int) -> None:
    """The prefill process: one layer record per forward hook, then (0, seq_len, first token)."""
    runtime = ModelRuntime.load()
    with socket.create_connection(("127.0.0.1", port)) as sock:

        def send_layer(state: LayerState) -> None:
            parts = state_codec.encode(state)
            sock.sendall(LENGTH.pack(sum(memoryview(p).nbytes for p in parts)))
            for part in parts:
                sock.sendall(part)

        result = runtime.prefill(runtime.tokenizer.encode(PROMPT), on_layer=send_layer, sampling=PARAMS)
        sock.sendall(struct.pack("<QQQ", 0, result.state.seq_len, result.next_token))


def read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"the prefill side hung up {n - len(data)} bytes short")
        data += chunk
    return bytes(data)


def main() -> None:
    runtime = ModelRuntime.load()
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = multiprocessing.get_context("spawn").Process(target=prefill_side, args=(server.getsockname()[1],))
        child.start()
        server.settimeout(120)  # a child that dies before it connects must not hang us
        conn, _ = server.accept()
        start = time.monotonic()
        layers: list[LayerState] = []
        with conn:
            while size := LENGTH.unpack(read_exactly(conn, LENGTH.size))[0]:
                layer = state_codec.decode(read_exactly(conn, size))
                print(f"layer {layer.layer} {layer.kind.name:<16} {size:>6} bytes, +{time.monotonic() - start:.3f} s")
                layers.append(layer)
            seq_len, first_token = struct.unpack("<QQ", read_exactly(conn, 16))
        child.join()
    assert child.exitcode == 0, f"the prefill process exited {child.exitcode}"
    remote = DecodeStream(runtime, ModelState(layers, seq_len), first_token, PARAMS).run()
    expected = reference_tokens(runtime, runtime.tokenizer.encode(PROMPT), PARAMS)
    print(f"prompt of {seq_len} tokens, {sum(s.nbytes for s in layers)} state bytes over the socket")
    print(f"decoded from the received state: {remote}")
    print(f"same tokens as transformers' generate(): {remote == expected}")
    if remote != expected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
