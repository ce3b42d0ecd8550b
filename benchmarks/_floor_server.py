"""Floor server for relay_bench: a raw pyzmq ROUTER echo loop (msgpack [id, payload] or a
raw buffer frame answered with a small ack). No framework, no event loop."""

import sys

import msgpack
import zmq


def main() -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(sys.argv[1])
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, head, *bufs = frames
        if bufs:  # bulk: ack with the byte count
            sock.send_multipart([ident, msgpack.packb([msgpack.unpackb(head.buffer)[0], sum(len(b) for b in bufs)])])
        else:
            rid, payload = msgpack.unpackb(head.buffer)
            if payload == "stop":
                return
            sock.send_multipart([ident, msgpack.packb([rid, payload])])


if __name__ == "__main__":
    main()
