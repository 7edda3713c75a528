"""Process A of the disaggregation tests: prefill prompts and stream every layer's state over TCP.

Usage: python prefill_child.py PORT SEED PRESET[,PRESET ...] LEN [LEN ...]
For each preset in turn, and each prompt (random bytes seeded by its length), it
connects, sends one record per layer as soon as the layer is final (u64 length +
state_codec bytes), then a final record: u64 0, u64 seq_len, u64 next_token.
Last, it prints one line per preset: the preset and its weights' digest.
"""

import socket
import struct
import sys

import torch
from weights import weights_digest

from minifaas.model import state_codec
from minifaas.model.runtime import ModelRuntime


def prompt(length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def main() -> None:
    port, seed, presets, *lengths = sys.argv[1:]
    digests = []
    for preset in presets.split(","):
        rt = ModelRuntime.load(preset, seed=int(seed))
        digests.append(f"{preset} {weights_digest(rt.model)}")
        for n in map(int, lengths):
            with socket.create_connection(("127.0.0.1", int(port))) as sock:

                def send_layer(state, sock=sock):
                    parts = state_codec.encode(state)
                    sock.sendall(struct.pack("<Q", sum(memoryview(p).nbytes for p in parts)))
                    for p in parts:
                        sock.sendall(p)

                result = rt.prefill(prompt(n), on_layer=send_layer)
                sock.sendall(struct.pack("<QQQ", 0, result.state.seq_len, result.next_token))
    print("\n".join(digests), flush=True)


if __name__ == "__main__":
    main()
