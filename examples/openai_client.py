"""The official ``openai`` client against a minifaas server started in this process.

``running_server`` starts the gateway, its worker processes (a PrfaaS prefill
worker, a PD prefill and a PD decode worker) and the link emulator between the
clusters, and serves the OpenAI-compatible API on a free port. A long prompt
is prefilled on PrfaaS and its KV crosses the emulated link; a short chat stays
in the local PD cluster. Every response carries a ``minifaas`` object saying
where it went and what it cost.

    python examples/openai_client.py
"""

from __future__ import annotations

import asyncio
import json

import openai

from minifaas.commands.serve import running_server
from minifaas.config import ServeConfig

LONG = "Long prompts go to the remote prefill cluster; short ones stay local. " * 5
THRESHOLD = 128  # prompt tokens above which prefill goes to PrfaaS


async def main() -> None:
    config = ServeConfig(port=0, threshold=THRESHOLD, api_key="example-key")
    async with running_server(config) as (_, port):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="example-key", max_retries=0)
        model = (await client.models.list()).data[0].id
        print(f"serving {model} on port {port}")

        completion = await client.completions.create(model=model, prompt=LONG, max_tokens=8, temperature=0)
        print(f"completion: {completion.usage.prompt_tokens} prompt tokens -> {completion.choices[0].text!r}")
        print("its minifaas object:", json.dumps(completion.model_extra["minifaas"], indent=2))

        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = []
        async for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
            if chunk.usage is not None:
                print(f"streamed chat: {len(pieces)} chunks, {chunk.usage.completion_tokens} tokens")
                info = (chunk.model_extra or {}).get("minifaas", {})
                print(
                    f"route {info.get('route')}: {info.get('prefill_worker')} -> {info.get('decode_worker')}, "
                    f"TTFT {info.get('ttft_s', 0):.3f} s, {info.get('kv_bytes')} KV bytes"
                )
        print(f"streamed text: {''.join(pieces)!r}")
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
