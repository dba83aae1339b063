"""The compose-up check's probe, run inside the daemon's network namespace (standard library only).

1. ``GET /v1/models`` on the router until it lists the model (engines registered through etcd);
2. one ``POST /v1/completions`` through the router, which must answer 200 with text;
3. read the trace back from the OTLP sink's Jaeger-style query API until one trace has spans from
   router, flow_control, epp and kv_indexer. Prints one JSON line with what it saw and the timings.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

ROUTER = "http://127.0.0.1:8000"
QUERY = "http://127.0.0.1:16686"
WANTED = {"kvmesh-router", "kvmesh-flow_control", "kvmesh-epp", "kvmesh-kv_indexer"}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def until(what: str, probe, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
            last = value
        except Exception as exc:
            last = exc
        time.sleep(0.5)
    sys.exit(f"probe: timed out waiting for {what}; last: {last!r}")


def main() -> None:
    t0 = time.monotonic()
    models = until("the router to list a model", lambda: [m["id"] for m in get(f"{ROUTER}/v1/models")["data"]])
    t_models = time.monotonic() - t0
    body = json.dumps({"model": models[0], "prompt": "compose up check " * 30, "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{ROUTER}/v1/completions", body, {"content-type": "application/json"})
    t1 = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    t_request = time.monotonic() - t1
    assert answer["choices"][0]["text"], answer

    def complete_trace():
        for trace in get(f"{QUERY}/api/traces?service=kvmesh-router")["data"]:
            if {s["serviceName"] for s in trace["spans"]} >= WANTED:
                return trace
        return None

    t2 = time.monotonic()
    trace = until("one trace across router, flow_control, epp, kv_indexer", complete_trace, 30)
    print(json.dumps({
        "model": models[0], "usage": answer.get("usage"),
        "trace_id": trace["traceID"], "spans": sorted({(s["serviceName"], s["operationName"]) for s in trace["spans"]}),
        "seconds": {"models_listed": round(t_models, 2), "request": round(t_request, 3), "trace_read_back": round(time.monotonic() - t2, 2)},
    }))


if __name__ == "__main__":
    main()
