"""A small MCP server written with the official Python SDK (PyPI `mcp`,
pinned in .ci/run; `MCPServer` is FastMCP's name since mcp 2.0), served
over stdio, for keel's client tests (tests/tests/it/mcp_external.rs).

Usage: python_server.py [--without TOOL]...   (leaves those tools out, so
a test can change the manifest between two starts)
"""

import os
import sys
from typing import Annotated, Literal

import anyio
from pydantic import Field

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("keel-test-python")


def greet(name: str, times: int = 1) -> str:
    """Greets NAME, TIMES times."""
    return " ".join([f"hello {name}"] * times)


def pick(
    color: Literal["red", "green"],
    count: Annotated[int, Field(ge=1, le=5, description="How many")] = 1,
) -> str:
    """Picks COUNT things of COLOR."""
    return f"{count} {color}"


async def wait(seconds: float, fifo: str = "") -> str:
    """Waits SECONDS; writes `started` and `cancelled` lines to FIFO."""
    out = open(fifo, "w", buffering=1) if fifo else None
    try:
        if out:
            out.write("started\n")
        await anyio.sleep(seconds)
        return "waited"
    except anyio.get_cancelled_exc_class():
        if out:
            out.write("cancelled\n")
        raise
    finally:
        if out:
            out.close()


def big(n: int) -> str:
    """Returns N times the letter y."""
    return "y" * n


def fail(reason: str) -> str:
    """Fails with REASON (an error result)."""
    raise ToolError(reason)


def pid() -> str:
    """Returns its process id."""
    return str(os.getpid())


def crash() -> str:
    """Exits the process at once."""
    os._exit(3)


without = {sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--without"}
for tool in (greet, pick, wait, big, fail, pid, crash):
    if tool.__name__ not in without:
        server.tool()(tool)

if __name__ == "__main__":
    server.run("stdio")
