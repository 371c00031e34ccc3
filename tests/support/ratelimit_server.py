"""An Envoy rate limit service (envoy.service.ratelimit.v3.RateLimitService) for the
rate limit tests, written with grpcio and xds-protos.

Each descriptor is counted (by its domain and entries) against its limit: the value of
its entry keyed "limit" when it has one, else 1000 a minute. The answer is OVER_LIMIT
when a descriptor is over; every status carries its limit (MINUTE), what remains and a
fixed 42 s until reset, so two proxies' answers do not depend on the clock. Every
answer adds `x-rls-request: seen` upstream and `x-rls-descriptors: <count>` downstream;
an OVER_LIMIT one has a body.

A descriptor entry keyed "mode" changes the answer: "fail" fails the call
(UNAVAILABLE), "slow" answers OK after 1.5 s (beyond the proxies' timeout) without
counting.

Every request is appended to the file argv[2] as a JSON line (domain, descriptors as
lists of [key, value]) before it is answered. Prints "ready" once serving; argv[1] is
the port."""

import json
import sys
import threading
import time
from concurrent import futures

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

RESET_SECONDS = 42
DEFAULT_LIMIT = 1000


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):
    def __init__(self, log_path):
        self.hits = {}
        self.lock = threading.Lock()
        self.log = open(log_path, "a")

    def ShouldRateLimit(self, request, context):
        descriptors = [[[e.key, e.value] for e in d.entries] for d in request.descriptors]
        with self.lock:
            self.log.write(json.dumps({"domain": request.domain, "descriptors": descriptors}) + "\n")
            self.log.flush()
        modes = {value for d in descriptors for key, value in d if key == "mode"}
        if "fail" in modes:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the rate limit service is failing")
        if "slow" in modes:
            # Answered after the proxy gave up; not counted, so later answers do
            # not depend on when this one ends.
            time.sleep(1.5)
            return rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
        statuses = []
        over = False
        for descriptor in descriptors:
            limit = next((int(v) for k, v in descriptor if k == "limit"), DEFAULT_LIMIT)
            key = json.dumps([request.domain, descriptor])
            with self.lock:
                self.hits[key] = self.hits.get(key, 0) + 1
                hits = self.hits[key]
            code = rls_pb2.RateLimitResponse.OK
            if hits > limit:
                code = rls_pb2.RateLimitResponse.OVER_LIMIT
                over = True
            statuses.append(
                rls_pb2.RateLimitResponse.DescriptorStatus(
                    code=code,
                    current_limit=rls_pb2.RateLimitResponse.RateLimit(
                        requests_per_unit=limit,
                        unit=rls_pb2.RateLimitResponse.RateLimit.MINUTE,
                    ),
                    limit_remaining=max(limit - hits, 0),
                    duration_until_reset={"seconds": RESET_SECONDS},
                )
            )
        response = rls_pb2.RateLimitResponse(
            overall_code=rls_pb2.RateLimitResponse.OVER_LIMIT if over else rls_pb2.RateLimitResponse.OK,
            statuses=statuses,
            request_headers_to_add=[base_pb2.HeaderValue(key="x-rls-request", value="seen")],
            response_headers_to_add=[
                base_pb2.HeaderValue(key="x-rls-descriptors", value=str(len(descriptors)))
            ],
        )
        if over:
            response.raw_body = b"over the limit\n"
        return response


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimitService(sys.argv[2]), server)
    server.add_insecure_port(f"[::]:{sys.argv[1]}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
