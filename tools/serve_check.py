"""16 concurrent greedy completions against a local `k3compile serve` on port 30000, then the /metrics lines
that show what the server sized and admitted (used by tools/gpu_serve_check.sh and tools/gpu_final.sh)."""
import concurrent.futures as cf, json, re, urllib.request
def post(i):
    body = json.dumps({"model": "mini", "prompt": f"request {i}: " + "x" * (8 * i), "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:30000/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.load(r)["choices"][0]["finish_reason"]
with cf.ThreadPoolExecutor(16) as pool:
    print("16 concurrent completions:", list(pool.map(post, range(16))))
m = urllib.request.urlopen("http://127.0.0.1:30000/metrics").read().decode()
print("\n".join(l for l in m.splitlines() if re.match(r"k3compile_(requests_max_running|kv_pages_total|state_slots_total"
                                                       r"|time_to_first_token_seconds_count|request_errors)", l)))
