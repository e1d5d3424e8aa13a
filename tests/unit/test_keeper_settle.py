"""An attach waits for the reset of the IPUs it wants, not for the rest of their take-back
(forgetting the last host: a host whose connection dropped is given seconds to exit);
``status`` waits for all of it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ipu_emulator.daemon._keeper import ProcessKeeper


def test_an_attach_waits_for_the_reset_and_status_for_the_whole_take_back():
    ipus: list[Any] = [SimpleNamespace(index=0), SimpleNamespace(index=1)]
    keeper = ProcessKeeper(ipus, lambda ipu: None)
    seen: list[str] = []

    async def main() -> None:
        freed, forgotten = asyncio.Event(), asyncio.Event()

        async def take_back() -> None:
            await freed.wait()
            keeper.usable(ipus[:1])
            await forgotten.wait()

        task = asyncio.get_running_loop().create_task(take_back())
        keeper.resetting(ipus[:1], task)

        async def attach() -> None:
            await keeper.settle(ipus[:1], whole=False)
            seen.append("attach")

        async def status() -> None:
            await keeper.settle(ipus)
            seen.append("status")

        waiters = [asyncio.ensure_future(attach()), asyncio.ensure_future(status())]
        await asyncio.sleep(0)
        assert seen == []                       # the reset is under way: both wait
        await keeper.settle(ipus[1:], whole=False)   # another IPU: no wait at all
        freed.set()
        await waiters[0]
        assert seen == ["attach"] and not task.done()
        forgotten.set()
        await waiters[1]
        assert seen == ["attach", "status"]
        await keeper.settle(ipus[:1], whole=False)   # done: nothing left to wait for

    asyncio.run(asyncio.wait_for(main(), 10))
