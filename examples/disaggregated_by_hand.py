"""Disaggregated generation by hand: prefill in one process, decode in another, layers streamed between.

A child process loads the model, prefills the prompt and, from the per-layer
callback, writes each layer's state to a TCP socket the moment that layer's
forward ends (u64 length + ``state_codec`` bytes). This process decodes every
record as it lands, rebuilds the model state and decodes from it; the tokens
must equal ``ModelRuntime.generate`` run here in one piece. (The presets have
seeded random weights, so the tokens are noise; that they match is the point.)

    python examples/disaggregated_by_hand.py
"""

from __future__ import annotations

import multiprocessing
import socket
import struct
import time

from minifaas.model import state_codec
from minifaas.model.layer_state import LayerState, ModelState
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
        conn, _ = server.accept()
        start = time.monotonic()
        layers: list[LayerState] = []
        with conn:
            while size := LENGTH.unpack(read_exactly(conn, LENGTH.size))[0]:
                layer = state_codec.decode(read_exactly(conn, size))
                at = time.monotonic() - start
                print(f"received layer {layer.layer} {layer.kind.name:<16} {size:>7} bytes at +{at:.3f} s")
                layers.append(layer)
            seq_len, first_token = struct.unpack("<QQ", read_exactly(conn, 16))
        child.join()
    remote = runtime.start_decode(ModelState(layers, seq_len), first_token, PARAMS).run()
    local = runtime.generate(runtime.tokenizer.encode(PROMPT), PARAMS)
    print(f"prompt of {seq_len} tokens, {sum(s.nbytes for s in layers)} state bytes over the socket")
    print(f"decoded from the received state: {remote}")
    print(f"same tokens as generate() in one process: {remote == local}")
    if remote != local:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
