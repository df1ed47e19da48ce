"""``wait_until`` and ``wait_until_async``: the one way a test waits for a condition."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from lorafleet.testing import wait_until, wait_until_async


def test_wait_until_returns_the_predicates_truthy_value():
    answers = iter([None, [], {"offset": 12}])
    assert wait_until(lambda: next(answers)) == {"offset": 12}


def test_wait_until_fails_with_the_message_and_the_last_value():
    with pytest.raises(AssertionError, match=r"never ready: still false after 0\.1s \(last: 0\)"):
        wait_until(lambda: 0, timeout=0.1, message="never ready")


def test_wait_until_async_takes_plain_and_coroutine_predicates_and_lets_the_loop_run():
    async def main() -> None:
        flag = asyncio.Event()
        asyncio.get_running_loop().call_soon(flag.set)  # runs only if the poll yields the loop
        assert await wait_until_async(flag.is_set) is True
        counter = itertools.count()

        async def third() -> int | None:
            n = next(counter)
            return n if n >= 2 else None

        assert await wait_until_async(third) == 2
        with pytest.raises(AssertionError, match=r"still false after 0\.1s"):
            await wait_until_async(lambda: False, timeout=0.1)

    asyncio.run(main())
