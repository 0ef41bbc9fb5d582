"""`await work`: waits for a ccl.Work in the event loop's default executor."""

import asyncio


async def wait_async(work):
    """Waits for `work` without blocking the event loop."""
    await asyncio.get_running_loop().run_in_executor(None, work.wait)
