"""A gRPC server written with grpcio that relays every streaming call it gets to a
backend gRPC server (the tests' ADS server), bytes unchanged, the caller's metadata
passed on.

It exists for its server side: grpcio's core, like grpc-go (istiod), sends a stream's
response headers only with its first response, and sends that only after it has a
request. A client that waits for the headers before it sends its first request hangs
against istiod; a tonic test server, which sends them at once, would not show it.

argv: the TCP port to listen on (0: any; the port is printed), the backend's target
("127.0.0.1:PORT" or "unix:/path"). Prints "listening PORT" once serving; each call
is logged to stderr ("call METHOD").
"""

import sys
from concurrent import futures

import grpc

# Metadata the relay must not pass on: set by grpc itself on the backend call.
RESERVED = {"user-agent", "te", "content-type", "grpc-accept-encoding", "grpc-encoding"}


def passthrough(data):
    return data


class Relay(grpc.GenericRpcHandler):
    def __init__(self, backend):
        # grpc sends a Unix socket's path as the authority, which hyper refuses.
        self.channel = grpc.insecure_channel(
            backend, options=[("grpc.default_authority", "localhost")]
        )

    def service(self, handler_call_details):
        method = handler_call_details.method
        metadata = [
            (k, v)
            for k, v in handler_call_details.invocation_metadata
            if k not in RESERVED and not k.startswith(":")
        ]
        upstream = self.channel.stream_stream(
            method, request_serializer=passthrough, response_deserializer=passthrough
        )

        def relay(requests, context):
            print(f"call {method}", file=sys.stderr, flush=True)
            responses = upstream(requests, metadata=metadata)
            context.add_callback(responses.cancel)
            try:
                for response in responses:
                    yield response
            except grpc.RpcError as e:
                context.abort(e.code(), e.details() or "")

        return grpc.stream_stream_rpc_method_handler(
            relay, request_deserializer=passthrough, response_serializer=passthrough
        )


def main():
    port, backend = int(sys.argv[1]), sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((Relay(backend),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"listening {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
