"""A trace collector for tests/tracing.rs: OTLP/gRPC
(opentelemetry.proto.collector.trace.v1.TraceService/Export, served by grpcio) and
Zipkin v2 JSON over HTTP (POST /api/v2/spans), each span printed to stdout as one JSON
line in one shape: {"format", "service", "trace_id", "span_id", "parent_id", "name",
"kind", "tags"}. Ports from argv: OTLP, then Zipkin."""

import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

LOCK = threading.Lock()
KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def emit(span):
    with LOCK:
        print(json.dumps(span, sort_keys=True), flush=True)


def value(v):
    which = v.WhichOneof("value")
    return str(getattr(v, which)) if which else ""


def export(request, context):
    try:
        spans(request)
    except Exception as e:  # a collector bug must show in the test's output
        print(f"collector error: {e!r}", file=sys.stderr, flush=True)
        raise
    return trace_service_pb2.ExportTraceServiceResponse()


def spans(request):
    for rs in request.resource_spans:
        resource = {a.key: value(a.value) for a in rs.resource.attributes}
        # xds-protos bundles OTLP from before `scope_spans`: the same field (2) and
        # layout under its old name.
        scopes = getattr(rs, "scope_spans", None) or rs.instrumentation_library_spans
        for ss in scopes:
            scope = getattr(ss, "scope", None) or ss.instrumentation_library
            for s in ss.spans:
                emit({
                    "format": "otlp",
                    "service": resource.get("service.name", ""),
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_id": s.parent_span_id.hex(),
                    "name": s.name,
                    "kind": KINDS.get(s.kind, str(s.kind)),
                    "tags": {a.key: value(a.value) for a in s.attributes},
                    "status": s.status.code,
                    "resource": resource,
                    "scope": scope.name,
                    "duration_ns": s.end_time_unix_nano - s.start_time_unix_nano,
                })


class Zipkin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.body()
        for s in json.loads(body or b"[]"):
            emit({
                "format": "zipkin",
                "service": s.get("localEndpoint", {}).get("serviceName", ""),
                "trace_id": s.get("traceId", ""),
                "span_id": s.get("id", ""),
                "parent_id": s.get("parentId", ""),
                "name": s.get("name", ""),
                "kind": s.get("kind", ""),
                "tags": s.get("tags", {}),
                "shared": s.get("shared", False),
                "path": self.path,
                "content_type": self.headers.get("content-type", ""),
                "local_endpoint": s.get("localEndpoint", {}),
            })
        self.send_response(202)
        self.send_header("content-length", "0")
        self.end_headers()

    def body(self):
        if "chunked" not in self.headers.get("transfer-encoding", ""):
            return self.rfile.read(int(self.headers.get("content-length", "0")))
        out = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            out += self.rfile.read(size)
            self.rfile.readline()
            if size == 0:
                return out

    def log_message(self, *args):
        pass


def main():
    otlp_port, zipkin_port = int(sys.argv[1]), int(sys.argv[2])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(
            export,
            request_deserializer=trace_service_pb2.ExportTraceServiceRequest.FromString,
            response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString,
        )},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"0.0.0.0:{otlp_port}")
    server.start()
    http = ThreadingHTTPServer(("0.0.0.0", zipkin_port), Zipkin)
    print("ready", flush=True)
    http.serve_forever()


main()
