"""An Envoy ext_authz gRPC server (envoy.service.auth.v3.Authorization) for the L7
filter tests, written with grpcio and xds-protos. It decides by the request's path:

  /deny...   PERMISSION_DENIED, denied_response 401 with a header and a body
  /bare...   UNAUTHENTICATED with no denied_response (the proxy's default 403)
  /error...  fails the RPC (UNAVAILABLE): the proxy's status_on_error / failure mode
  else       OK, with headers to set, append and remove upstream, one for the response

A check of a TCP connection (network ext_authz: no HTTP request) is decided by the
last digit of its destination port: 1 denies, 2 fails the RPC, anything else allows.

Every allowed check also reports what it saw: the method, the body, the source
principal and the context extensions, as x-authz-saw-* headers added upstream.
Prints "ready" once serving; argv[1] is the port."""

import sys
from concurrent import futures

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2


def header(key, value, append=None):
    option = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value))
    if append is not None:
        option.append.value = append
    return option


class Authorization(external_auth_pb2_grpc.AuthorizationServicer):
    def Check(self, request, context):
        if not request.attributes.request.HasField("http"):
            return self.check_tcp(request, context)
        http = request.attributes.request.http
        path = http.path
        if path.startswith("/error"):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the authz server is failing")
        if path.startswith("/deny"):
            return external_auth_pb2.CheckResponse(
                status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED),
                denied_response=external_auth_pb2.DeniedHttpResponse(
                    status=http_status_pb2.HttpStatus(code=http_status_pb2.Unauthorized),
                    headers=[header("x-denied-by", "authz")],
                    body="denied by authz\n",
                ),
            )
        if path.startswith("/bare"):
            return external_auth_pb2.CheckResponse(
                status=status_pb2.Status(code=code_pb2.UNAUTHENTICATED)
            )
        extensions = ",".join(
            f"{k}={v}" for k, v in sorted(request.attributes.context_extensions.items())
        )
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=code_pb2.OK),
            ok_response=external_auth_pb2.OkHttpResponse(
                headers=[
                    header("x-authz-set", "set-by-authz"),
                    header("x-authz-append", "appended", append=True),
                    header("x-authz-saw-method", http.method),
                    header("x-authz-saw-body", http.body or "-"),
                    header("x-authz-saw-principal", request.attributes.source.principal or "-"),
                    header("x-authz-saw-extensions", extensions or "-"),
                ],
                headers_to_remove=["x-authz-remove"],
                response_headers_to_add=[header("x-authz-response", "from-authz")],
            ),
        )

    def check_tcp(self, request, context):
        port = request.attributes.destination.address.socket_address.port_value
        if port % 10 == 2:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the authz server is failing")
        code = code_pb2.PERMISSION_DENIED if port % 10 == 1 else code_pb2.OK
        return external_auth_pb2.CheckResponse(status=status_pb2.Status(code=code))


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(Authorization(), server)
    server.add_insecure_port(f"[::]:{sys.argv[1]}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
