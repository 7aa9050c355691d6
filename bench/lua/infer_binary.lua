-- wrk script: POST a KServe v2 binary-tensor-extension body read from $BENCH_BODY
-- (JSON header of $BENCH_HEADER_LEN bytes followed by the raw FP32 bytes).
-- done() prints one machine-readable line (BENCH_RESULT {...}) for bench/run.py.
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.headers["Inference-Header-Content-Length"] = assert(os.getenv("BENCH_HEADER_LEN"))

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%d,"duration_us":%d,"bytes":%d,"err_connect":%d,"err_read":%d,' ..
    '"err_write":%d,"err_status":%d,"err_timeout":%d,"lat_mean_us":%.2f,"lat_p50_us":%d,' ..
    '"lat_p90_us":%d,"lat_p99_us":%d,"lat_max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
