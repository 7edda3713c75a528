"""Local workers forked from the pre-loaded parent: real processes, their exits, restarts and the fallback.

Every served test starts its workers this way (``fork_workers`` is the
default); this module checks what only the launcher can see: whose child each
worker is, the exit status the parent reports, a restart, one parent shared by
the launchers of a process, and a parent that dies: its workers live on (and
still die with the gateway), the next worker starts as a fresh interpreter and
the ones after it fork from a new parent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from minifaas.config import ServeConfig
from minifaas.control.secret import new_secret
from minifaas.launch import forked, local
from minifaas.launch.forked import ForkedProcess
from minifaas.launch.launcher import WorkerSpec
from minifaas.launch.local import LocalLauncher, on_cpu
from minifaas.launch.worker_specs import worker_spec
from minifaas.parent_watch import running

MODEL = "kimi-linear-tiny"
SPEC = worker_spec(ServeConfig(model=MODEL), "pd-d0", "decode", "pd")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def gone_or_zombie(pid: int) -> bool:
    return not running(pid)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def until(check, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)


def test_a_forked_worker_is_the_parents_child_reports_its_exit_and_restarts() -> None:
    async def scenario() -> None:
        async with LocalLauncher(new_secret(), model=MODEL) as launcher:
            await launcher.start(SPEC)
            kv_port = launcher.kv_ports[SPEC.name]  # the free port its first start bound and reported
            process = launcher.processes[SPEC.name]
            zygote = launcher.forks.parent  # type: ignore[union-attr]
            assert isinstance(process, ForkedProcess) and zygote is not None
            assert parent_of(process.pid) == zygote.pid != os.getpid()
            process.kill()
            assert await asyncio.wait_for(process.wait(), 10) == -signal.SIGKILL  # reaped and reported
            assert not launcher.alive(SPEC)
            await launcher.start(SPEC)  # what the pool does when its session is lost
            again = launcher.processes[SPEC.name]
            assert isinstance(again, ForkedProcess) and again.pid != process.pid and launcher.restarts[SPEC.name] == 1
            assert kv_port > 0 and launcher.kv_ports[SPEC.name] == kv_port  # where the link's route points
            worker = again.pid
        await until(lambda: gone(worker))
        assert zygote.poll() is None, "the shared parent ended with one launcher"
        return zygote.pid

    zygote = asyncio.run(scenario())

    async def next_launcher() -> None:  # another event loop, as the next test's gateway has
        async with LocalLauncher(new_secret(), model=MODEL) as launcher:
            await launcher.start(SPEC)
            assert launcher.forks.parent.pid == zygote  # type: ignore[union-attr]  # no second parent's imports
            assert parent_of(launcher.processes[SPEC.name].pid) == zygote

    asyncio.run(next_launcher())
    forked.close_shared()  # what the end of this process does
    assert gone(zygote)


def test_the_launcher_keeps_the_exit_status_of_its_last_ended_workers_and_forgets_the_oldest(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(local, "KEPT_EXITS", 2)

    async def scenario() -> None:
        async with LocalLauncher(new_secret(), model=MODEL) as launcher:
            ended = []
            for _ in range(3):  # killed, then started again: the restart notes how the killed one ended
                await launcher.start(SPEC)
                process = launcher.processes[SPEC.name]
                process.kill()
                await asyncio.wait_for(process.wait(), 10)
                ended.append(process.pid)
            await launcher.start(SPEC)
            assert [launcher.exit_of(SPEC, pid) for pid in ended] == [None, -signal.SIGKILL, -signal.SIGKILL]
            assert len(launcher.exits) == 2

    asyncio.run(scenario())


def test_when_the_parent_dies_its_workers_live_on_one_starts_fresh_and_a_new_parent_forks_the_next() -> None:
    async def scenario() -> None:
        config = ServeConfig(model=MODEL)
        other, third = (worker_spec(config, f"pd-p{i}", "prefill", "pd") for i in (0, 1))
        async with LocalLauncher(new_secret(), model=MODEL) as launcher:
            await launcher.start(SPEC)
            forked_one, old = launcher.processes[SPEC.name], launcher.forks
            old.parent.kill()  # type: ignore[union-attr]
            await launcher.start(other)
            fresh = launcher.processes[other.name]
            assert not isinstance(fresh, ForkedProcess) and parent_of(fresh.pid) == os.getpid()
            assert launcher.forks is not None and launcher.forks is not old and not old.running  # type: ignore[union-attr]
            await launcher.start(third)  # from the new parent
            assert parent_of(launcher.processes[third.name].pid) == launcher.forks.parent.pid  # type: ignore[union-attr]
            assert launcher.alive(SPEC) and running(forked_one.pid), "a worker died with the pre-loaded parent"
            _, writer = await asyncio.open_connection(*launcher.addresses[SPEC.name])  # and it still listens
            writer.close()
        await until(lambda: gone_or_zombie(forked_one.pid) and gone(fresh.pid))

    asyncio.run(scenario())


# run as a fresh interpreter: its abrupt end is what is tested
ORPHAN = """
import asyncio, os
from minifaas.control.secret import new_secret
from minifaas.launch.local import LocalLauncher
from test_fork_launcher import SPEC

async def main() -> None:
    launcher = LocalLauncher(new_secret(), model="kimi-linear-tiny")
    await launcher.__aenter__()
    await launcher.start(SPEC)
    launcher.forks.parent.kill()
    await asyncio.sleep(0.5)  # the worker has had its signal from the parent's death, and lives on
    print(launcher.processes[SPEC.name].pid, flush=True)
    os._exit(0)  # the gateway dies with nothing torn down

asyncio.run(main())
"""


def test_a_worker_that_outlived_its_pre_loaded_parent_still_dies_with_the_gateway() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    worker = int(done.stdout.split()[-1])
    asyncio.run(until(lambda: gone_or_zombie(worker), timeout=20))


# run as a fresh interpreter: start_here forks its caller, which must not be this test process
HERE = """
import asyncio, os
import minifaas.commands.serve  # what `minifaas serve` has imported when it forks the parent
from minifaas.launch import forked, local

MODEL = "kimi-linear-tiny"
inside_a_loop = asyncio.run(asyncio.to_thread(forked.start_here, MODEL))  # a thread runs: never a fork
assert forked.start_here(MODEL) is True, "no pre-loaded parent forked from a quiet main thread"
assert forked.start_here(MODEL) is False  # one per model
zygote = forked.acquire(MODEL).parent

from minifaas.control.secret import new_secret
from minifaas.launch.local import LocalLauncher
from test_fork_launcher import SPEC, parent_of

def environ(pid):  # a forked parent keeps this one's; a fresh one is started with MINIFAAS_PARENT_PID added
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


assert parent_of(zygote.pid) == os.getpid() and zygote.poll() is None
assert environ(zygote.pid) == environ(os.getpid()), "the shared parent is a fresh interpreter, not this one forked"
forked.release(forked.acquire(MODEL))


async def started() -> int:
    async with LocalLauncher(new_secret(), model=MODEL) as launcher:
        await launcher.start(SPEC)
        assert launcher.forks.parent is zygote, "the launcher started a parent of its own"
        return parent_of(launcher.processes[SPEC.name].pid)


print(inside_a_loop, zygote.pid, asyncio.run(started()))
"""


def test_a_command_forks_the_parent_from_itself_and_its_launchers_use_that_one() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", HERE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    inside_a_loop, zygote, worker_parent = done.stdout.split()
    assert inside_a_loop == "False" and worker_parent == zygote
    assert gone(int(zygote))  # it ended with its process


def test_only_cpu_workers_are_forked() -> None:
    assert on_cpu(SPEC) and on_cpu(WorkerSpec("w", "prefill", "pd", ("--model", MODEL)))
    assert not on_cpu(WorkerSpec("w", "prefill", "prfaas", ("--model", MODEL, "--device", "cuda:0")))


def test_a_fork_whose_parent_dies_before_it_answers_fails_and_leaves_no_pipe_open() -> None:
    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    async def scenario() -> None:
        forks = forked.ForkServer(MODEL)
        forks.start()
        try:
            await asyncio.wrap_future(forks._ready)  # the parent has imported and listens
            before = open_fds()
            forks.parent.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]  # it takes the request, answers none
            spawning = asyncio.ensure_future(forks.spawn(list(SPEC.argv), dict(os.environ)))
            await asyncio.sleep(0.5)
            forks.parent.kill()  # type: ignore[union-attr]
            try:
                await spawning
                raise AssertionError("a fork from a parent that died answered")
            except forked.ForkError:
                pass
            assert open_fds() <= before
        finally:
            forks.close()

    asyncio.run(scenario())
