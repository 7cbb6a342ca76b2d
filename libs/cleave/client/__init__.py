"""A small asyncio client of the cleave Gateway gRPC API.

    async with GatewayClient("localhost:50051") as client:
        async for response in client.generate("What is 2 + 2?", max_tokens=64):
            ...
        result = await client.complete("What is 2 + 2?", max_tokens=64)
        print(result.samples[0].reasoning_text, result.samples[0].text)
"""

from cleave.client.gateway import Completion, GatewayClient, SampleResult, wait_until_serving

__all__ = ["Completion", "GatewayClient", "SampleResult", "wait_until_serving"]
