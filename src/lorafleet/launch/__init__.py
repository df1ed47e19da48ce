"""The one way lorafleet starts its servers: typed specs, pre-bound sockets, managed processes.

The launcher binds each server's listening socket itself and passes the descriptor to the child
(``--fd``), so a port is never probed, released and then taken by someone else. A server that
cannot take a socket (real vLLM, SGLang) gets a reserved port and is retried on a new one if the
port was taken first. Every process runs in its own session, logs to a file and is stopped with
its whole process group::

    from lorafleet.agent.spec import AgentSpec
    from lorafleet.engine.spec import ReferenceEngineSpec
    from lorafleet.launch import Launcher

    with Launcher("logs") as launcher:
        engine = launcher.start(ReferenceEngineSpec(model=model_dir))
        agent = launcher.start(
            AgentSpec(engine_url=engine.url, data_dir=Path("store"), token=token)
        )
        print(agent.url)  # http://127.0.0.1:<the port the launcher bound>

Used by ``lorafleet up`` (``LocalFleet``), the demo, ``lorafleet.testing``, the tests and the
benchmarks. ``forkserver`` starts lorafleet's own servers as forks of a process that imported
their modules once, where a caller opts in (the test suite does).
"""

from lorafleet.launch.launcher import Launcher, Server
from lorafleet.launch.listen import bind_listener, reserve_port
from lorafleet.launch.process import ManagedProcess, ProcessExited, lorafleet_argv
from lorafleet.launch.specs import (
    PortServerSpec,
    ServerSpec,
    SGLangSpec,
    SocketServerSpec,
    VLLMSpec,
)

__all__ = [
    "Launcher",
    "ManagedProcess",
    "PortServerSpec",
    "ProcessExited",
    "SGLangSpec",
    "Server",
    "ServerSpec",
    "SocketServerSpec",
    "VLLMSpec",
    "bind_listener",
    "lorafleet_argv",
    "reserve_port",
]
