"""A gRPC access log service and OTLP logs receiver for tests/access_log_service.rs.

Serves envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs and
opentelemetry.proto.collector.logs.v1.LogsService/Export on each port given, and prints
every entry it receives as one JSON line: {"port", "kind" (http, tcp or otel),
"log_name", "node_id", "entry"} (proto field names; OTLP entries carry the resource's
attributes as "resource"). Prints "listening <ports>" once it serves.

Usage: log_receiver.py PORT [PORT...]
"""

import json
import logging
import sys
import threading
from concurrent import futures

import grpc
from google.protobuf.json_format import MessageToDict

from envoy.service.accesslog.v3 import als_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

lock = threading.Lock()


def emit(record):
    with lock:
        print(json.dumps(record, sort_keys=True), flush=True)


def as_dict(message):
    return MessageToDict(message, preserving_proto_field_name=True)


def handlers(port):
    def stream_access_logs(requests, context):
        log_name, node_id = None, None
        for message in requests:
            # The first message of a stream carries the identifier.
            if message.HasField("identifier"):
                log_name = message.identifier.log_name
                node_id = message.identifier.node.id
            if message.HasField("http_logs"):
                kind, entries = "http", message.http_logs.log_entry
            else:
                kind, entries = "tcp", message.tcp_logs.log_entry
            for entry in entries:
                emit({"port": port, "kind": kind, "log_name": log_name,
                      "node_id": node_id, "entry": as_dict(entry)})
        return als_pb2.StreamAccessLogsResponse()

    def export(request, context):
        for resource_logs in request.resource_logs:
            resource = as_dict(resource_logs.resource)
            # xds-protos carries OTLP's older logs.proto, where field 2 (same wire form as
            # scope_logs) is instrumentation_library_logs.
            scopes = getattr(resource_logs, "scope_logs", None)
            if scopes is None:
                scopes = resource_logs.instrumentation_library_logs
            for scope_logs in scopes:
                records = getattr(scope_logs, "log_records", None)
                if records is None:
                    records = scope_logs.logs
                for record in records:
                    emit({"port": port, "kind": "otel", "log_name": None, "node_id": None,
                          "resource": resource, "entry": as_dict(record)})
        return logs_service_pb2.ExportLogsServiceResponse()

    return [
        grpc.method_handlers_generic_handler("envoy.service.accesslog.v3.AccessLogService", {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                stream_access_logs,
                request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
                response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString),
        }),
        grpc.method_handlers_generic_handler("opentelemetry.proto.collector.logs.v1.LogsService", {
            "Export": grpc.unary_unary_rpc_method_handler(
                export,
                request_deserializer=logs_service_pb2.ExportLogsServiceRequest.FromString,
                response_serializer=logs_service_pb2.ExportLogsServiceResponse.SerializeToString),
        }),
    ]


def main():
    # A handler's exception goes to stderr (grpcio logs it), not only to the caller.
    logging.basicConfig(level=logging.ERROR)
    ports = [int(p) for p in sys.argv[1:]]
    servers = []
    for port in ports:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers(handlers(port))
        server.add_insecure_port(f"0.0.0.0:{port}")
        server.start()
        servers.append(server)
    print("listening " + " ".join(str(p) for p in ports), flush=True)
    servers[0].wait_for_termination()


if __name__ == "__main__":
    main()
