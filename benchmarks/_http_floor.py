"""Floor server for gateway_bench: a minimal aiohttp app answering ``POST /genrm/generate``
with ``{"response": "1"}`` on uvloop, in a process of its own (hosted like the judge
gateway). Prints "ready" once listening on ``127.0.0.1:argv[1]``; runs until killed."""

import asyncio
import sys

from aiohttp import web


async def echo(request: web.Request) -> web.Response:
    await request.json()
    return web.json_response({"response": "1"})


async def main(port: int) -> None:
    app = web.Application()
    app.router.add_post("/genrm/generate", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import uvloop

    uvloop.install()
    asyncio.run(main(int(sys.argv[1])))
