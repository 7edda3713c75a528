"""A decode step's tokens cross the control session as one signed frame, and reach each request's inbox in order.

A worker's gateway session over a real socket: the tokens a step hands out in one turn of the loop leave as one
``tokens`` message (not a signed frame each); a message that is not a token sends them first, so each request
sees its tokens before its ``done``; the gateway's handle puts each entry in its request's inbox as a ``token``.
"""

from __future__ import annotations

import asyncio

from minifaas.cache.prefix_index import PrefixDirectory
from minifaas.control.server import ControlServer
from minifaas.control.session import Session, connect
from minifaas.control.worker_ops import Attached, Done, Token
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.launch.launcher import WorkerSpec
from minifaas.model.runtime import ModelRuntime
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.worker.decode_service import DecodeService
from minifaas.worker.gateway_session import DecodeSession

SECRET = b"token-frames-secret-0123456789"


def token(req: str, n: int, finish: str | None = None) -> Token:
    return Token(req, 7, n, finish)


def test_a_steps_tokens_leave_as_one_frame_and_arrive_in_each_requests_inbox() -> None:
    runtime = ModelRuntime.load("kimi-linear-tiny")

    async def scenario() -> tuple[list[dict], dict[str, list]]:
        read = asyncio.Event()  # the gateway side has every frame: the worker side may end
        async with KVReceiver(ReceiverConfig(SECRET)) as receiver:
            service = DecodeService(runtime, receiver, 30.0)
            node = Attached(
                name="pd-d0",
                role="decode",
                cluster="pd",
                model="kimi-linear-tiny",
                kv=None,
                pid=1,
                codecs={},
                kernels="unknown",
                deadline_s=30.0,
            )

            async def worker_side(session: Session) -> None:
                worker = DecodeSession(node, session, service)
                for step in range(2):  # two steps, each one turn of the loop
                    for req in ("a", "b", "c"):
                        worker.emit(token(req, 10 * step + ord(req), "length" if step and req == "b" else None))
                    await asyncio.sleep(0)  # the loop turns: this step's tokens go
                worker.emit(token("a", 99))
                worker.emit(Done(req="c", transfer=7, finish="stop"))  # sends the token first
                await session.drain(5)
                await read.wait()

            async with ControlServer(("127.0.0.1", 0), SECRET, worker_side) as server:
                session = await connect("127.0.0.1", server.port, SECRET, 5.0)
                handle = WorkerHandle(
                    WorkerSpec("pd-d0", "decode", "pd"),
                    "pd-d0",
                    "decode",
                    "pd",
                    PrefixDirectory(False, 16, "test", False, ()),
                )
                inboxes = {req: handle.open(req) for req in ("a", "b", "c")}
                frames = [await session.recv(5) for _ in range(4)]
                read.set()
                session.close()
        for frame in frames:
            handle._deliver(frame)  # as the handle's session pump does with each frame
        return frames, {req: [inbox.get_nowait() for _ in range(inbox.qsize())] for req, inbox in inboxes.items()}

    frames, inboxes = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [f["op"] for f in frames] == ["tokens", "tokens", "tokens", "done"]
    assert [len(f["tokens"]) for f in frames[:3]] == [3, 3, 1]
    assert [m.token for m in inboxes["a"]] == [ord("a"), 10 + ord("a"), 99]
    assert inboxes["b"] == [token("b", ord("b")), token("b", 10 + ord("b"), "length")]
    assert [m.op for m in inboxes["c"]] == ["token", "token", "done"]
