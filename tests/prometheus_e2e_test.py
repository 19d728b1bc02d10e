#!/usr/bin/env python3
"""End-to-end check of the metrics, the dashboards and the alert rules against real processes.

  python3 tests/prometheus_e2e_test.py --binary build/cli/infersweep [--root REPO] [--keep]

Starts `infersweep coordinator` and one CPU `infersweep agent` on loopback ports, Debian's
`prometheus` scraping both every second (with deploy/prometheus/alerts.yml loaded), submits a
small CPU sweep and waits for it; then evaluates EVERY PromQL expression of dashboards/*.json
and of the alert rules through Prometheus's HTTP API (/api/v1/query):

- dashboard expressions must succeed and return data. Grafana variables are substituted first
  ($__rate_interval -> 1m, $__interval -> 15s, $__range -> 1h, $var -> .* inside regex
  matchers) and `label_values(m, l)` variable queries are evaluated as `count by (l) (m)`.
  Exception: expressions on the NVML GPU families (infersweep_agent_gpu_*, except
  infersweep_agent_gpu_sampler_nvml) only need to succeed, because a CPU agent has no GPUs;
  they must return data when the agent reports infersweep_agent_gpu_sampler_nvml 1. Likewise
  infersweep_roofline_ratio only needs to succeed: results carry a roofline only from GPUs with
  measured figures (docs/METRICS.md), never from this CPU sweep (tests/metrics_test.cc checks
  its values); so does infersweep_batch_memory_verdict, whose verdicts come from CUDA trials'
  memory plans (tests/metrics_test.cc checks it too).
- alert expressions must succeed, but they are legitimately empty while the system is healthy
  (AgentDown, ConfigTurnedIncorrect...). So each vector selector inside them
  (`up{job="infersweep-agent"}`, `infersweep_config_status{status="OK"}`, ...) is evaluated on
  its own and must return data: that proves every metric and label value the rule relies on
  exists under that name. Every rule must also report health "ok" in /api/v1/rules.
- the SQLite queries of every dashboard run against the coordinator's database (Grafana macros
  substituted, with history.json's variables) and must return rows.
- a second sweep with a serving workload fills the serving gauges (dashboards/serving.json), and
  `best --metric goodput` answers from its load points.

Bounded: everything must finish within --budget seconds (default 90). Every process started is
killed at the end. Exit 77 (ctest SKIP) when the prometheus binary is missing.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

try:
    import yaml
except ImportError:  # pragma: no cover - depends on the host
    if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != os.path.realpath(
            "/usr/bin/python3") and not os.environ.get("INFERSWEEP_REEXEC"):
        os.environ["INFERSWEEP_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("FAIL: PyYAML is not installed (Debian: apt-get install python3-yaml)")
    sys.exit(1)

SPEC = """\
name: e2e-observability
model: preset:tiny-moe
layers: 1
device: cpu
matrix:
  matmul: [naive, blocked]
  threads: [1, 2]
workload: {prompt: 8, output: 4, batch: [1, 2], repeats: 1, warmup: 0, timeout: 60}
"""

# A serving workload through the same fleet: 2 configs x 2 load points fill the serving panels,
# and the SLO gives every point a goodput for `best --metric goodput`.
SERVING_SPEC = """\
name: e2e-serving
model: preset:tiny-moe
layers: 1
device: cpu
matrix:
  matmul: [naive, blocked]
workload:
  mode: serving
  concurrency: [1, 4]
  isl: 8
  osl: 4
  requests: 4
  slo: {ttft_ms: 100000, tpot_ms: 100000}
  timeout: 60
"""

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset",
                   "bool", "and", "or", "unless", "inf", "nan", "le"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()

    def wait_for(self, what, predicate, interval=0.25):
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                pass
            if self.left() <= 0:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(interval)


def substitute_grafana(expr):
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
    expr = expr.replace("$__range", "1h")
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(?::[a-z]+)?\}?", ".*", expr)


def vector_selectors(expr):
    """The vector selectors of a PromQL expression: metric names with their optional matchers,
    leaving out functions, keywords, label lists of by/on/... and durations."""
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    s = re.sub(r"\[[^\]]*\]", " ", s)                 # [5m], [1h:1m]
    s = re.sub(r"\boffset\s+\S+", " ", s)
    out = []
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", s):
        name, matchers = m.group(1), m.group(2) or ""
        following = s[m.end():].lstrip()
        if following.startswith("(") or name in PROMQL_KEYWORDS:
            continue
        # Skip identifiers inside a matcher block or a string ({job="x"} was consumed above).
        before = s[:m.start()]
        if before.count('"') % 2 == 1:
            continue
        if re.fullmatch(r"[0-9.eE+-]+", name):
            continue
        out.append(name + matchers)
    return sorted(set(out))


def is_gpu_family(expr):
    names = set(re.findall(r"\binfersweep_agent_gpu_[a-z_]+", expr))
    return bool(names) and not names <= {"infersweep_agent_gpu_sampler_nvml"}


def needs_measured_gpu(expr):
    return re.search(r"\binfersweep_(roofline_ratio|batch_memory_verdict)\b", expr) is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True, help="the infersweep binary")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--budget", type=float, default=90)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()

    args.binary = os.path.abspath(args.binary)
    if not os.access(args.binary, os.X_OK):
        print(f"FAIL: {args.binary} is not an executable")
        return 1
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("SKIP: the prometheus binary is not installed (apt-get install prometheus)")
        return 77
    deadline = Deadline(args.budget)
    tmp = tempfile.mkdtemp(prefix="infersweep-prom-e2e.")
    procs = []
    failures = []

    def start(name, argv):
        log = open(os.path.join(tmp, f"{name}.log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                             start_new_session=True)
        procs.append((name, p))
        return p

    def fail(msg):
        print(f"FAIL: {msg}")
        failures.append(msg)

    try:
        grpc_port, coord_metrics, agent_metrics, prom_port = (free_port() for _ in range(4))
        coord = f"127.0.0.1:{grpc_port}"
        start("coordinator", [args.binary, "coordinator", "--listen", coord,
                              "--db", os.path.join(tmp, "infersweep.db"),
                              "--metrics-listen", f"127.0.0.1:{coord_metrics}"])
        deadline.wait_for("the coordinator's /metrics", lambda: http_get(
            f"http://127.0.0.1:{coord_metrics}/metrics")[0] == 200)
        start("agent", [args.binary, "agent", "--coordinator", coord, "--id", "e2e-agent",
                        "--spool", os.path.join(tmp, "spool.db"),
                        "--metrics-listen", f"127.0.0.1:{agent_metrics}"])
        deadline.wait_for("the agent's /metrics", lambda: http_get(
            f"http://127.0.0.1:{agent_metrics}/metrics")[0] == 200)

        rules = os.path.join(args.root, "deploy", "prometheus", "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules],
            "scrape_configs": [
                {"job_name": "infersweep-coordinator",
                 "static_configs": [{"targets": [f"127.0.0.1:{coord_metrics}"]}]},
                {"job_name": "infersweep-agent",
                 "static_configs": [{"targets": [f"127.0.0.1:{agent_metrics}"]}]},
            ],
        }
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            yaml.safe_dump(config, f)
        # A port free_port() saw free can be taken before Prometheus binds it (an outgoing
        # connection's ephemeral port, seen in CI): if Prometheus exits, retry on another port.
        for attempt in range(5):
            if attempt:
                prom_port = free_port()
            prom = start("prometheus", [prometheus, f"--config.file={tmp}/prometheus.yml",
                                        f"--storage.tsdb.path={tmp}/tsdb",
                                        f"--web.listen-address=127.0.0.1:{prom_port}"])
            ready = deadline.wait_for(
                "Prometheus to be ready or to exit",
                lambda: prom.poll() is not None or
                http_get(f"http://127.0.0.1:{prom_port}/-/ready")[0] == 200)
            if prom.poll() is None and ready:
                break
            print(f"# Prometheus exited (code {prom.returncode}) on port {prom_port}; retrying")
        else:
            raise TimeoutError("Prometheus did not start in 5 attempts")
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def query(expr):
            status, body = http_get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))
            return json.loads(body)

        def has_data(resp):
            data = resp.get("data") or {}
            if data.get("resultType") == "scalar":
                return True
            return bool(data.get("result"))

        # A first scrape before the sweep, so counters and the histogram are seen rising.
        deadline.wait_for("the first scrapes", lambda: has_data(
            query('count_over_time(up{job="infersweep-agent"}[1m]) >= 2')))

        spec = os.path.join(tmp, "sweep.yaml")
        with open(spec, "w") as f:
            f.write(SPEC)
        r = subprocess.run([args.binary, "submit", spec, "--coordinator", coord, "--wait"],
                           capture_output=True, text=True, cwd=tmp,
                           timeout=max(5, deadline.left() - 25))
        print(f"# submit: rc={r.returncode}\n" + "\n".join(
            "#   " + l for l in (r.stdout + r.stderr).strip().splitlines()[-6:]))
        if r.returncode != 0:
            raise RuntimeError("the sweep failed")
        serving_spec = os.path.join(tmp, "serving.yaml")
        with open(serving_spec, "w") as f:
            f.write(SERVING_SPEC)
        r = subprocess.run([args.binary, "submit", serving_spec, "--coordinator", coord, "--wait"],
                           capture_output=True, text=True, cwd=tmp,
                           timeout=max(5, deadline.left() - 20))
        print(f"# submit serving: rc={r.returncode}\n" + "\n".join(
            "#   " + l for l in (r.stdout + r.stderr).strip().splitlines()[-6:]))
        if r.returncode != 0:
            raise RuntimeError("the serving sweep failed")

        # A few scrapes and rule evaluations after the last result.
        time.sleep(min(4, max(0, deadline.left() - 20)))
        deadline.wait_for("the results in Prometheus", lambda: has_data(
            query("sum(infersweep_trials_total) >= 6")))
        deadline.wait_for("the agent's counters in Prometheus", lambda: has_data(
            query("sum(infersweep_agent_trials_total) >= 6")))

        checked = 0
        # The values, not only their presence: 4 lockstep trials x 2 batch sizes, each counted
        # once, and 2 serving trials x 2 load points (their configs, threads at its default,
        # are 2 more config statuses).
        def scalar(expr):
            result = query(expr)["data"]["result"]
            return float(result[0]["value"][1]) if result else None
        deadline.wait_for("the scheduler's gauges", lambda: scalar(
            "max(infersweep_queue_depth) + max(infersweep_leased_trials)") == 0)
        for expr, want in (("sum(infersweep_trials_total)", 6),
                           ('sum(infersweep_trials_total{status="OK"})', 6),
                           ("sum(infersweep_agent_trials_total)", 6),
                           ("max(infersweep_agents_connected)", 1),
                           ("max(infersweep_metrics_config_series)", 8),
                           ("count(infersweep_output_tokens_per_second > 0)", 8),
                           ("count(infersweep_serving_output_tokens_per_second > 0)", 4),
                           ("count(infersweep_serving_goodput_requests_per_second > 0)", 4),
                           ('count(infersweep_serving_load{mode="closed_loop"})', 4),
                           ("count(infersweep_config_status == 1)", 6),
                           ("sum(infersweep_ingest_latency_seconds_count)", 6),
                           ("max(infersweep_agent_spool_depth)", 0),
                           ("count(infersweep_agent_running_trial)", None)):
            got = scalar(expr)
            checked += 1
            if got != want:
                fail(f"{expr} = {got}, expected {want}")

        # `best` answers from the serving points, within one load point, and never from the
        # lockstep batches of the first sweep.
        for argv, want in ((["--metric", "goodput", "--load-point", "concurrency=4"],
                            "# best goodput for preset:tiny-moe on cpu serving at concurrency=4"),
                           (["--metric", "p99_tpot_ms", "--load-point", "concurrency=1"],
                            "# serving       concurrency=1 OK"),
                           (["--metric", "output_tok_s", "--serving", "--load-point",
                             "concurrency=4"], "# serving       concurrency=4 OK")):
            r = subprocess.run([args.binary, "best", "--coordinator", coord, "--model",
                                "preset:tiny-moe", "--sm-arch", "cpu"] + argv,
                               capture_output=True, text=True, cwd=tmp, timeout=10)
            checked += 1
            if r.returncode != 0 or want not in r.stdout:
                fail(f"best {' '.join(argv)}: rc={r.returncode}, expected '{want}':\n"
                     f"{r.stdout}{r.stderr}")
        # Without a load point, the two load points are two groups: listed, never ranked.
        r = subprocess.run([args.binary, "best", "--coordinator", coord, "--model",
                            "preset:tiny-moe", "--sm-arch", "cpu", "--metric", "goodput"],
                           capture_output=True, text=True, cwd=tmp, timeout=10)
        checked += 1
        if r.returncode != 2 or "concurrency=1" not in r.stderr or "concurrency=4" not in r.stderr:
            fail(f"best --metric goodput over two load points: rc={r.returncode}, expected the "
                 f"groups listed:\n{r.stdout}{r.stderr}")

        nvml = has_data(query("infersweep_agent_gpu_sampler_nvml == 1"))

        # ---- dashboards: every PromQL target and variable query
        for path in sorted(glob.glob(os.path.join(args.root, "dashboards", "*.json"))):
            dash = json.load(open(path))
            exprs = []
            for var in (dash.get("templating") or {}).get("list") or []:
                if (var.get("datasource") or {}).get("type") != "prometheus":
                    continue
                q = var.get("definition") or (var.get("query") or {}).get("query", "")
                m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_]+)\)\s*", q)
                exprs.append((f"variable ${var['name']}",
                              f"count by ({m.group(2)}) ({m.group(1)})" if m else q))
            for panel in dash.get("panels") or []:
                for t in panel.get("targets") or []:
                    if t.get("expr"):
                        exprs.append((f"panel '{panel.get('title')}' {t.get('refId')}", t["expr"]))
            for where, expr in exprs:
                promql = substitute_grafana(expr)
                resp = query(promql)
                checked += 1
                name = f"{os.path.basename(path)}: {where}: {promql}"
                if resp.get("status") != "success":
                    fail(f"{name}: {resp.get('error')}")
                elif (not has_data(resp) and not (is_gpu_family(promql) and not nvml)
                      and not needs_measured_gpu(promql)):
                    fail(f"{name}: no data")

        # ---- alert rules: the expression evaluates, and every selector in it has data
        groups = yaml.safe_load(open(rules))["groups"]
        for g in groups:
            for rule in g["rules"]:
                name = rule.get("alert") or rule.get("record")
                resp = query(rule["expr"])
                checked += 1
                if resp.get("status") != "success":
                    fail(f"alert {name}: {resp.get('error')}")
                    continue
                selectors = vector_selectors(rule["expr"])
                if not selectors:
                    fail(f"alert {name}: found no vector selector in its expression")
                for sel in selectors:
                    checked += 1
                    r2 = query(sel)
                    if r2.get("status") != "success" or not has_data(r2):
                        fail(f"alert {name}: selector {sel} has no data")
        status, body = http_get(f"{api}/rules")
        loaded = {r["name"]: r for g in json.loads(body)["data"]["groups"] for r in g["rules"]}
        for g in groups:
            for rule in g["rules"]:
                name = rule.get("alert") or rule.get("record")
                got = loaded.get(name)
                if got is None:
                    fail(f"alert {name}: not loaded by Prometheus")
                elif got.get("health") != "ok":
                    fail(f"alert {name}: health {got.get('health')}: {got.get('lastError')}")

        # ---- history.json: the SQLite queries against the coordinator's database
        db = sqlite3.connect(f"file:{os.path.join(tmp, 'infersweep.db')}?mode=ro", uri=True)
        dash = json.load(open(os.path.join(args.root, "dashboards", "history.json")))
        values = {}
        for var in dash["templating"]["list"]:
            rows = db.execute(var["query"]["queryText"]).fetchall()
            checked += 1
            if not rows:
                fail(f"history.json: variable ${var['name']}: no rows")
            values[var["name"]] = [row[0] for row in rows]

        def render(sql):
            def one(m):
                name, fmt = m.group(1), m.group(2)
                vals = values.get(name, [])
                if fmt == "sqlstring":
                    return ",".join("'" + str(v).replace("'", "''") + "'" for v in vals)
                return ",".join(str(v) for v in vals)
            sql = re.sub(r"\$\{(\w+):(\w+)\}", one, sql)
            sql = sql.replace("$__from", "0")
            return sql.replace("$__to", str(int(time.time() * 1000) + 3_600_000))

        # Every dashboard's SQLite targets (history.json's variables feed its own panels).
        for path in sorted(glob.glob(os.path.join(args.root, "dashboards", "*.json"))):
            panels = json.load(open(path)).get("panels") or []
            for panel in panels:
                for t in panel.get("targets") or []:
                    if (t.get("datasource") or {}).get("type") != "frser-sqlite-datasource":
                        continue
                    sql = render(t["queryText"])
                    where = f"{os.path.basename(path)}: panel '{panel['title']}'"
                    checked += 1
                    try:
                        rows = db.execute(sql).fetchall()
                    except sqlite3.Error as e:
                        fail(f"{where}: {e}: {sql}")
                        continue
                    if not rows:
                        fail(f"{where}: no rows: {sql}")
        db.close()
        print(f"# {checked} expressions and queries checked"
              + ("" if nvml else " (no NVML on this agent: GPU panels only had to succeed)"))
    except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        fail(str(e))
    finally:
        for name, p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, p in reversed(procs):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if failures:
            for name, _ in procs:
                log = os.path.join(tmp, f"{name}.log")
                if os.path.exists(log):
                    tail = open(log).read().splitlines()[-15:]
                    print(f"# --- {name}.log (last lines)\n" + "\n".join("#   " + l for l in tail))
        if args.keep:
            print(f"# kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"# {len(failures)} failure(s)")
        return 1
    print("# prometheus e2e OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
