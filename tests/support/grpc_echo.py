"""A gRPC service and a client for the gRPC stats tests, written with grpcio and no
generated code (messages are raw bytes).

  grpc_echo.py serve PORT     serves test.Echo, prints "ready":
      Unary         echoes the request; a request "fail:N" fails with status N
                    (before any response message: a trailers-only answer)
      ServerStream  answers a request "K" with K messages
      ClientStream  reads every message, answers with their count
      Chat          echoes every message back
  grpc_echo.py call HOST:PORT runs the fixed table of calls below through the proxy
                    at HOST:PORT and prints one JSON line per call: the method, the
                    status code's number, the number of messages answered.
"""

import json
import sys
from concurrent import futures

import grpc

SERVICE = "test.Echo"


def unary(request, context):
    if request.startswith(b"fail:"):
        code = int(request[5:])
        status = next(c for c in grpc.StatusCode if c.value[0] == code)
        context.abort(status, "asked to fail")
    return request


def server_stream(request, context):
    for i in range(int(request)):
        yield b"m%d" % i


def client_stream(requests, context):
    return b"%d" % sum(1 for _ in requests)


def chat(requests, context):
    for message in requests:
        yield message


def serve(port):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port("[::]:%d" % port)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


# (method, kind, request): the calls made through each proxy, in order.
CALLS = [
    ("Unary", "unary", b"hello"),
    ("Unary", "unary", b"again"),
    ("Unary", "unary", b"fail:5"),
    ("Unary", "unary", b"fail:14"),
    ("ServerStream", "server", b"3"),
    ("ServerStream", "server", b"0"),
    ("ClientStream", "client", [b"a", b"b", b"c", b"d"]),
    ("Chat", "chat", [b"x", b"y"]),
    ("Missing", "unary", b"nobody"),
]


def call(target):
    with grpc.insecure_channel(target) as channel:
        for method, kind, request in CALLS:
            path = "/%s/%s" % (SERVICE, method)
            answered = 0
            code = 0
            try:
                if kind == "unary":
                    channel.unary_unary(path)(request, timeout=10)
                    answered = 1
                elif kind == "server":
                    for _ in channel.unary_stream(path)(request, timeout=10):
                        answered += 1
                elif kind == "client":
                    channel.stream_unary(path)(iter(request), timeout=10)
                    answered = 1
                else:
                    for _ in channel.stream_stream(path)(iter(request), timeout=10):
                        answered += 1
            except grpc.RpcError as err:
                code = err.code().value[0]
            print(json.dumps({"method": method, "code": code, "answered": answered}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        call(sys.argv[2])
