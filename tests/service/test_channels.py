"""The channels TransferKV keeps to its targets: reused, bounded, dropped when the target is unavailable."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from chunkattn_server.service.channels import ChannelPool
from tests.helpers.server_process import free_port

SHUTDOWN = grpc.ChannelConnectivity.SHUTDOWN


def test_a_target_keeps_its_channel_and_the_least_recently_used_idle_one_is_closed() -> None:
    async def main() -> None:
        pool = ChannelPool([], limit=2)
        async with pool.use("127.0.0.1:1") as a:
            pass
        async with pool.use("127.0.0.1:1") as again:
            assert again is a
        async with pool.use("127.0.0.1:2") as b, pool.use("127.0.0.1:3") as c:
            # Three channels, two allowed: a is closed only when it is not in use and least recent.
            assert a.get_state() == SHUTDOWN
            assert SHUTDOWN not in (b.get_state(), c.get_state())
        assert len(pool) == 2
        async with pool.use("127.0.0.1:1") as fresh:
            assert fresh is not a
        await pool.close()
        assert len(pool) == 0
        assert b.get_state() == c.get_state() == SHUTDOWN

    asyncio.run(main())


def test_a_channel_in_use_is_never_closed_by_the_limit() -> None:
    async def main() -> None:
        pool = ChannelPool([], limit=1)
        async with pool.use("127.0.0.1:1") as a:
            async with pool.use("127.0.0.1:2") as b:
                assert SHUTDOWN not in (a.get_state(), b.get_state())  # over the limit while both are in use
            assert b.get_state() == SHUTDOWN  # done with, and over the limit
            assert a.get_state() != SHUTDOWN
        assert len(pool) == 1
        await pool.close()

    asyncio.run(main())


def test_an_unavailable_target_drops_its_channel_so_the_next_use_connects_afresh() -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        pool = ChannelPool([])
        channels: list[grpc.aio.Channel] = []

        async def call() -> None:
            async with pool.use(target) as channel:
                channels.append(channel)
                info: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    "/chunkattn.v1.ChunkAttn/Info", request_serializer=bytes, response_deserializer=bytes
                )
                await info(b"", timeout=10)

        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        broken = channels[0]
        assert broken.get_state() == SHUTDOWN
        assert len(pool) == 0
        async with pool.use(target) as fresh:
            assert fresh is not broken
        await pool.close()

    asyncio.run(main())


def test_other_errors_keep_the_channel() -> None:
    async def main() -> None:
        pool = ChannelPool([])
        channels: list[grpc.aio.Channel] = []

        async def fail() -> None:
            async with pool.use("127.0.0.1:1") as channel:
                channels.append(channel)
                raise ValueError("not the channel's fault")

        with pytest.raises(ValueError, match="not the channel's fault"):
            await fail()
        a = channels[0]
        async with pool.use("127.0.0.1:1") as again:
            assert again is a
        await pool.close()

    asyncio.run(main())


def test_a_dropped_channel_shared_by_two_transfers_closes_when_the_last_one_leaves() -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        pool = ChannelPool([])
        both_in = asyncio.Event()
        channels: list[grpc.aio.Channel] = []

        async def transfer(fail: bool) -> None:
            async with pool.use(target) as channel:
                channels.append(channel)
                if len(channels) == 2:
                    both_in.set()
                await both_in.wait()
                if fail:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
                    )
                await asyncio.sleep(0.05)  # still using it after the other dropped it
                assert channel.get_state() != SHUTDOWN

        results = await asyncio.gather(transfer(True), transfer(False), return_exceptions=True)
        assert isinstance(results[0], grpc.aio.AioRpcError)
        assert results[1] is None
        assert channels[0] is channels[1]
        assert channels[0].get_state() == SHUTDOWN
        assert len(pool) == 0
        await pool.close()

    asyncio.run(main())


def test_a_kept_channel_that_broke_while_idle_is_replaced() -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        pool = ChannelPool([])
        async with pool.use(target) as first:
            pass
        # One read of the state per turn (read twice, a change in between was waited for again), and a channel
        # left IDLE after a failed attempt asked to connect again: else it may never reach TRANSIENT_FAILURE.
        state = first.get_state(try_to_connect=True)
        async with asyncio.timeout(30):
            while state != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                await first.wait_for_state_change(state)
                state = first.get_state(try_to_connect=True)
        async with pool.use(target) as second:
            assert second is not first
        assert first.get_state() == SHUTDOWN
        await pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            async with pool.use(target):
                pass

    asyncio.run(main())
