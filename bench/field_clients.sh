#!/usr/bin/env bash
# Field clients against the proxy (issue 23): AIPerf (--use-server-token-count), guidellm and
# the openai SDK, unmodified, with n > 1, response_format (json_object / json_schema) and
# usage.prompt_tokens_details.cached_tokens. Fails (exit 1) on any client-side error.
#
#   bench/field_clients.sh [VENV_DIR] [RUN_DIR] [OUT_DIR]
#
# VENV_DIR (default /tmp/fieldvenv): a separate venv for aiperf + guidellm, made if missing
#   (never the repo's .venv). AIPERF_SPEC / GUIDELLM_SPEC override the pins (last verified:
#   aiperf==0.13.0, guidellm==0.8.1 on Python 3.11).
# RUN_DIR (default /tmp/pdserve-field): pdserve up's --run-dir; logs in RUN_DIR/logs.
# OUT_DIR (default /tmp/pdserve-field-out): client artifacts and logs.
# Ports: FIELD_PORT_BASE (default 10611) -> proxy BASE, prefill BASE-2000, decode BASE-1999,
#   registry BASE+20000, KV BASE+4000 / BASE+4001 (off the defaults, so a developer's
#   `pdserve up` can run beside it). REQUESTS (50), CONCURRENCY (4), GUIDELLM_REQUESTS (30).
# The system is always stopped (pdserve down) on exit. Clients run under nice.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/fieldvenv}"
RUN_DIR="${2:-/tmp/pdserve-field}"
OUT="${3:-/tmp/pdserve-field-out}"
BASE="${FIELD_PORT_BASE:-10611}"
REQUESTS="${REQUESTS:-50}"
CONCURRENCY="${CONCURRENCY:-4}"
GREQUESTS="${GUIDELLM_REQUESTS:-30}"
PY="$REPO/.venv/bin/python"
PROXY_PORT="$BASE"
URL="http://127.0.0.1:$PROXY_PORT"

# 1. client venv
if [ ! -x "$VENV/bin/aiperf" ] || [ ! -x "$VENV/bin/guidellm" ]; then
  python3 -m venv "$VENV"
  nice -n 10 "$VENV/bin/pip" install -q "${AIPERF_SPEC:-aiperf==0.13.0}" "${GUIDELLM_SPEC:-guidellm==0.8.1}"
fi
"$VENV/bin/pip" list 2>/dev/null | grep -iE '^(aiperf|guidellm|transformers) ' || true
"$REPO/.venv/bin/pip" list 2>/dev/null | grep -iE '^openai ' || true

# The embedded model's tokenizer (a local directory; no hub download). AIPerf 0.13.0 loads a
# local tokenizer path only with HF_HUB_OFFLINE unset (offline mode looks only in the HF cache).
TOK="$(cd "$REPO" && "$PY" -c 'from common.model.embedded import ensure_embedded_model; print(ensure_embedded_model())')"
unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE

# 2. the system
mkdir -p "$OUT"
down() { (cd "$REPO" && .venv/bin/pdserve down --run-dir "$RUN_DIR") || true; }
trap down EXIT
(cd "$REPO" && .venv/bin/pdserve up --run-dir "$RUN_DIR" --proxy-port "$PROXY_PORT" \
  --prefill-port $((BASE - 2000)) --decode-port $((BASE - 1999)) --registry-port $((BASE + 20000)) \
  --prefill-kv-port $((BASE + 4000)) --decode-kv-port $((BASE + 4001)))
for _ in $(seq 60); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/ready")" = 200 ] && break
  sleep 1
done

fail=0
SCHEMA='{"name":"p","schema":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}}'

# 3. AIPerf: chat (n=2, json_object) and completions (n=2, json_schema), streaming,
#    server token counts, a shared-prefix pool so cached tokens show up.
run_aiperf() {  # endpoint-type, extra-inputs JSON
  local dir="$OUT/aiperf_$1"
  rm -rf "$dir"
  nice -n 5 "$VENV/bin/aiperf" profile --model pdserve-tiny --url "$URL" --endpoint-type "$1" \
    --streaming --use-server-token-count --tokenizer "$TOK" \
    --request-count "$REQUESTS" --concurrency "$CONCURRENCY" \
    --prompt-input-tokens-mean 128 --prompt-input-tokens-stddev 0 \
    --prompt-output-tokens-mean 16 --prompt-output-tokens-stddev 0 \
    --prompt-prefix-pool-size 2 --prompt-prefix-length 64 \
    --extra-inputs "$2" --random-seed 1 --ui-type simple --workers-max 2 \
    --artifact-dir "$dir" >"$OUT/aiperf_$1.log" 2>&1 || { echo "aiperf $1: exit $?"; fail=1; return; }
  python3 - "$dir/profile_export_aiperf.json" "$1" "$REQUESTS" <<'EOF' || fail=1
import json, sys
d = json.load(open(sys.argv[1])); want = int(sys.argv[3])
done = d.get("completed_request_count", d["request_count"])["avg"]
err = d.get("request_error_rate", {}).get("avg", 0.0)
cache = d.get("usage_prompt_cache_read_tokens", {})
print(f"aiperf {d.get('aiperf_version')} {sys.argv[2]}: requests={done:.0f} error_rate={err}% "
      f"error_summary={d.get('error_summary')} cached_tokens avg={cache.get('avg')} max={cache.get('max')} "
      f"cache_read%={d.get('overall_usage_prompt_cache_read_pct', {}).get('avg')}")
sys.exit(0 if done == want and err == 0 and not d.get("error_summary") and cache.get("max", 0) > 0 else 1)
EOF
}
run_aiperf chat '{"n": 2, "response_format": {"type": "json_object"}}'
run_aiperf completions "{\"n\": 2, \"response_format\": {\"type\": \"json_schema\", \"json_schema\": $SCHEMA}}"

# 4. guidellm: chat at a constant rate, completions synchronous.
run_guidellm() {  # request_format, profile, extras body JSON, name
  nice -n 5 "$VENV/bin/guidellm" run \
    --backend "{\"kind\":\"openai_http\",\"target\":\"$URL\",\"model\":\"pdserve-tiny\",\"request_format\":\"$1\",\"extras\":{\"body\":$3}}" \
    --tokenizer "kind=hf_auto,model=$TOK" \
    --data 'kind=synthetic_text,prompt_tokens=128,output_tokens=16,prefix_count=2,prefix_tokens=64' \
    --profile "$2" --constraint "kind=max_requests,count=$GREQUESTS" --seed 'kind=static,value=1' \
    --output kind=console --output "kind=json,path=$OUT/guidellm_$4.json" --disable-progress \
    >"$OUT/guidellm_$4.log" 2>&1 || { echo "guidellm $4: exit $?"; fail=1; return; }
  python3 - "$OUT/guidellm_$4.json" "$4" "$GREQUESTS" <<'EOF' || fail=1
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"][0]
t = b["metrics"]["request_totals"]
cached = [r["input_metrics"].get("cached_tokens") or 0 for r in b["requests"]["successful"]]
print(f"guidellm {sys.argv[2]}: {t} cached_tokens>0 in {sum(c > 0 for c in cached)}/{len(cached)} "
      f"(max {max(cached, default=0)}) warnings={len(b.get('warnings') or [])}")
sys.exit(0 if t["successful"] == int(sys.argv[3]) and t["errored"] == 0 and t["incomplete"] == 0 else 1)
EOF
}
run_guidellm /v1/chat/completions 'kind=constant,rate=4' '{"n":2,"response_format":{"type":"json_object"}}' chat
run_guidellm /v1/completions 'kind=synchronous' "{\"n\":2,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":$SCHEMA}}" completions

# 5. openai SDK (the repo venv's openai): n=3 + json_schema, streamed n=2 + json_object with
#    include_usage, completions n=3, cached_tokens of a repeated long prompt.
"$PY" - "$URL/v1" <<'EOF' || fail=1
import json, sys
import openai
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0)
model = c.models.list().data[0].id
bad = 0
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "a person as JSON"}], n=3,
                              max_tokens=48, response_format={"type": "json_schema",
                              "json_schema": {"name": "person", "schema": schema, "strict": True}})
for ch in r.choices:  # a choice cut by max_tokens (finish=length) is a prefix, not JSON
    if ch.finish_reason == "stop":
        json.loads(ch.message.content)
bad += len(r.choices) != 3
s = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON"}], n=2, max_tokens=32,
                              stream=True, stream_options={"include_usage": True},
                              response_format={"type": "json_object"})
idx, usage = set(), None
for chunk in s:
    idx |= {ch.index for ch in chunk.choices}
    usage = chunk.usage or usage
bad += idx != {0, 1} or usage is None
r = c.completions.create(model=model, prompt="def f(x):", n=3, max_tokens=8)
bad += len(r.choices) != 3
long = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
cached = []
for _ in range(2):
    usage = None
    for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=4,
                                           stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    cached.append(usage.prompt_tokens_details.cached_tokens)
bad += not cached[1]
print(f"openai {openai.__version__}: n=3/json_schema, streamed n=2/json_object, completions n=3 ok={not bad}; "
      f"repeated prompt ({usage.prompt_tokens} tokens) cached_tokens {cached}")
sys.exit(1 if bad else 0)
EOF

grep -hiE ' (ERROR|WARNING) |Traceback' "$RUN_DIR"/logs/*.log | head -20 || true
echo "artifacts in $OUT, node logs in $RUN_DIR/logs"
[ "$fail" = 0 ] && echo "field clients: OK" || { echo "field clients: FAILED"; exit 1; }
