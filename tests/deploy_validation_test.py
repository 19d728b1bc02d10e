#!/usr/bin/env python3
"""Validates the deployment files against each other: deploy/ (Prometheus, compose, Kubernetes,
systemd, Dockerfiles) and dashboards/ (Grafana JSON and provisioning).

  python3 tests/deploy_validation_test.py [--root REPO] [--self-test]

Every YAML and JSON file must parse; then cross-file checks: Kubernetes objects have apiVersion,
kind and metadata.name, the agent DaemonSet requests nvidia.com/gpu, the coordinator StatefulSet
has volumeClaimTemplates that are mounted, every Service selector matches some pod template and
its target ports exist, ServiceMonitors select a Service port; compose services reference files
and volumes that exist; the metrics ports agree between prometheus.yml, compose, Kubernetes,
systemd and the Dockerfiles; alert rules and dashboards name metrics that docs/OBSERVABILITY.md
documents and data sources that provisioning defines; every coordinator and agent deploy/ starts
has TLS and its tokens on (docs/SECURITY.md), from secrets that exist where they are referenced
and are not world-readable. When installed, `systemd-analyze verify`
checks the units and `kubectl kustomize` renders deploy/k8s (both offline).

--self-test breaks the loaded files in memory, one way at a time, and fails unless the checks
catch each break: a check that cannot fail would prove nothing.
"""
import argparse
import copy
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover - depends on the host
    if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != os.path.realpath(
            "/usr/bin/python3") and not os.environ.get("INFERSWEEP_REEXEC"):
        os.environ["INFERSWEEP_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("FAIL: PyYAML is not installed (Debian: apt-get install python3-yaml)")
    sys.exit(1)

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
CLUSTER_KINDS = ("Namespace",)


def load_bundle(root):
    """Reads every file the checks look at into one dict (so --self-test can mutate it)."""
    b = {"root": root, "errors_parse": []}

    def parse_yaml_all(path):
        try:
            with open(path) as f:
                return [d for d in yaml.safe_load_all(f) if d is not None]
        except (yaml.YAMLError, OSError) as e:
            b["errors_parse"].append(f"{rel(root, path)}: YAML does not parse: {e}")
            return []

    b["yaml_files"] = sorted(
        glob.glob(os.path.join(root, "deploy", "**", "*.y*ml"), recursive=True)
        + glob.glob(os.path.join(root, "dashboards", "**", "*.y*ml"), recursive=True))
    b["parsed"] = {rel(root, p): parse_yaml_all(p) for p in b["yaml_files"]}
    b["k8s"] = []
    for p in sorted(glob.glob(os.path.join(root, "deploy", "k8s", "*.y*ml"))):
        if os.path.basename(p).startswith("kustomization"):
            continue
        for d in b["parsed"].get(rel(root, p), []):
            b["k8s"].append((rel(root, p), d))
    kust = b["parsed"].get("deploy/k8s/kustomization.yaml", [])
    b["kustomization"] = kust[0] if kust else None
    compose = b["parsed"].get("deploy/docker/compose.yaml", [])
    b["compose"] = compose[0] if compose else None
    prom = b["parsed"].get("deploy/prometheus/prometheus.yml", [])
    b["prometheus"] = prom[0] if prom else None
    alerts = b["parsed"].get("deploy/prometheus/alerts.yml", [])
    b["alerts"] = alerts[0] if alerts else None
    ds = b["parsed"].get("dashboards/provisioning/datasources/datasources.yaml", [])
    b["datasources"] = ds[0] if ds else None
    dp = b["parsed"].get("dashboards/provisioning/dashboards/dashboards.yaml", [])
    b["dashboard_providers"] = dp[0] if dp else None
    b["dashboards"] = {}
    for p in sorted(glob.glob(os.path.join(root, "dashboards", "*.json"))):
        try:
            with open(p) as f:
                b["dashboards"][rel(root, p)] = json.load(f)
        except (ValueError, OSError) as e:
            b["errors_parse"].append(f"{rel(root, p)}: JSON does not parse: {e}")
    b["dockerfiles"] = {}
    for p in sorted(glob.glob(os.path.join(root, "deploy", "docker", "Dockerfile.*"))):
        with open(p) as f:
            b["dockerfiles"][rel(root, p)] = f.read()
    b["units"] = {}
    for p in sorted(glob.glob(os.path.join(root, "deploy", "systemd", "*.service"))):
        with open(p) as f:
            b["units"][rel(root, p)] = f.read()
    b["docs"] = {}
    for name in ("OBSERVABILITY.md", "DEPLOYMENT.md"):
        p = os.path.join(root, "docs", name)
        b["docs"][name] = open(p).read() if os.path.exists(p) else ""
    return b


def rel(root, path):
    return os.path.relpath(path, root)


def labels_match(selector, labels):
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def pod_template(obj):
    return ((obj.get("spec") or {}).get("template") or {})


def containers_of(obj):
    return (pod_template(obj).get("spec") or {}).get("containers") or []


def port_of_listen(value):
    m = re.search(r":(\d+)$", value or "")
    return int(m.group(1)) if m else None


def flag_value(args, flag):
    """The value of --flag in an argv list (either "--flag=v" or "--flag", "v")."""
    args = [str(a) for a in (args or [])]
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


# ------------------------------------------------------------------------------------ checks

def check_k8s(b, err):
    objs = b["k8s"]
    if not objs:
        err("deploy/k8s: no manifests")
    services, workloads = [], []
    for path, d in objs:
        where = f"{path}: {d.get('kind', '?')}/{(d.get('metadata') or {}).get('name', '?')}"
        for field in ("apiVersion", "kind"):
            if not d.get(field):
                err(f"{where}: missing {field}")
        meta = d.get("metadata") or {}
        if not meta.get("name"):
            err(f"{where}: missing metadata.name")
        if d.get("kind") not in CLUSTER_KINDS and meta.get("namespace") != "infersweep":
            err(f"{where}: metadata.namespace must be 'infersweep'")
        if d.get("kind") == "Service":
            services.append((where, d))
        if d.get("kind") in WORKLOAD_KINDS:
            workloads.append((where, d))

    for where, w in workloads:
        spec = w.get("spec") or {}
        tmpl_labels = (pod_template(w).get("metadata") or {}).get("labels") or {}
        if not labels_match((spec.get("selector") or {}).get("matchLabels"), tmpl_labels):
            err(f"{where}: spec.selector.matchLabels does not match the pod template labels")
        pod_spec = pod_template(w).get("spec") or {}
        volumes = {v.get("name") for v in pod_spec.get("volumes") or []}
        claims = {(c.get("metadata") or {}).get("name") for c in spec.get("volumeClaimTemplates") or []}
        mounted = set()
        if not containers_of(w):
            err(f"{where}: no containers")
        for c in containers_of(w):
            cw = f"{where} container {c.get('name')}"
            if not c.get("image"):
                err(f"{cw}: no image")
            ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
            for m in c.get("volumeMounts") or []:
                mounted.add(m.get("name"))
                if m.get("name") not in volumes | claims:
                    err(f"{cw}: volumeMount '{m.get('name')}' has no volume or claim template")
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                p = c.get(probe) or {}
                for kind in ("httpGet", "tcpSocket"):
                    port = (p.get(kind) or {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        err(f"{cw}: {probe} uses port '{port}' the container does not declare")
            listen = flag_value(c.get("args"), "--metrics-listen")
            if listen is not None and port_of_listen(listen) != ports.get("metrics"):
                err(f"{cw}: --metrics-listen {listen} but the 'metrics' port is {ports.get('metrics')}")
            for env in c.get("env") or []:
                ref = ((env.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                if ref and ref not in b["docs"]["DEPLOYMENT.md"]:
                    err(f"{cw}: Secret '{ref}' is not explained in docs/DEPLOYMENT.md")
            sc = c.get("securityContext") or {}
            if sc.get("allowPrivilegeEscalation") is not False:
                err(f"{cw}: securityContext.allowPrivilegeEscalation must be false")
        if not (pod_spec.get("securityContext") or {}).get("runAsNonRoot"):
            err(f"{where}: pod securityContext.runAsNonRoot must be true")
        if w.get("kind") == "DaemonSet":
            gpu_ok = False
            for c in containers_of(w):
                res = c.get("resources") or {}
                lim = (res.get("limits") or {}).get("nvidia.com/gpu")
                req = (res.get("requests") or {}).get("nvidia.com/gpu", lim)
                if lim is not None and int(lim) >= 1 and req == lim:
                    gpu_ok = True
            if not gpu_ok:
                err(f"{where}: a DaemonSet container must request nvidia.com/gpu (limits == requests >= 1)")
        if w.get("kind") == "StatefulSet":
            if not claims:
                err(f"{where}: StatefulSet without volumeClaimTemplates (its database would not persist)")
            for name in claims - mounted:
                err(f"{where}: volumeClaimTemplate '{name}' is not mounted by any container")
            svc_names = {(s.get("metadata") or {}).get("name") for _, s in services}
            if spec.get("serviceName") not in svc_names:
                err(f"{where}: serviceName '{spec.get('serviceName')}' is not a Service in deploy/k8s")

    for where, s in services:
        spec = s.get("spec") or {}
        selector = spec.get("selector") or {}
        targets = [w for _, w in workloads
                   if labels_match(selector, (pod_template(w).get("metadata") or {}).get("labels"))]
        if not targets:
            err(f"{where}: selector {selector} matches no pod template")
            continue
        names, numbers = set(), set()
        for w in targets:
            for c in containers_of(w):
                for p in c.get("ports") or []:
                    names.add(p.get("name"))
                    numbers.add(p.get("containerPort"))
        for p in spec.get("ports") or []:
            t = p.get("targetPort", p.get("port"))
            if (isinstance(t, str) and t not in names) or (isinstance(t, int) and t not in numbers):
                err(f"{where}: port '{p.get('name')}' targets {t!r}, which no selected container declares")

    for path, m in objs:
        if m.get("kind") != "ServiceMonitor":
            continue
        where = f"{path}: ServiceMonitor/{(m.get('metadata') or {}).get('name')}"
        sel = ((m.get("spec") or {}).get("selector") or {}).get("matchLabels")
        hits = [s for _, s in services if labels_match(sel, (s.get("metadata") or {}).get("labels"))]
        if not hits:
            err(f"{where}: selects no Service")
        port_names = {p.get("name") for s in hits for p in (s.get("spec") or {}).get("ports") or []}
        for ep in (m.get("spec") or {}).get("endpoints") or []:
            if ep.get("port") not in port_names:
                err(f"{where}: endpoint port '{ep.get('port')}' is not a port of the selected Service")

    k = b["kustomization"]
    if k is None:
        err("deploy/k8s/kustomization.yaml: missing")
    else:
        listed = set(k.get("resources") or [])
        for name in listed:
            if not os.path.exists(os.path.join(b["root"], "deploy", "k8s", name)):
                err(f"deploy/k8s/kustomization.yaml: resource {name} does not exist")
        for p in glob.glob(os.path.join(b["root"], "deploy", "k8s", "*.y*ml")):
            base = os.path.basename(p)
            if not base.startswith("kustomization") and base not in listed:
                err(f"deploy/k8s/kustomization.yaml: {base} is not listed in resources")
        # kubectl renders the kustomization offline (no cluster needed) when it is installed.
        kubectl = shutil.which("kubectl")
        if kubectl and not b.get("skip_kubectl"):
            r = subprocess.run([kubectl, "kustomize", os.path.join(b["root"], "deploy", "k8s")],
                               capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                err(f"kubectl kustomize deploy/k8s: {r.stderr.strip()}")
            elif len([d for d in yaml.safe_load_all(r.stdout) if d]) != len(objs):
                err("kubectl kustomize deploy/k8s: renders a different number of objects")


def check_compose(b, err):
    c = b["compose"]
    if c is None:
        return err("deploy/docker/compose.yaml: missing")
    base = os.path.join(b["root"], "deploy", "docker")
    services = c.get("services") or {}
    named_volumes = set((c.get("volumes") or {}).keys())
    for name, s in services.items():
        where = f"compose service {name}"
        if not s.get("image") and not s.get("build"):
            err(f"{where}: neither image nor build")
        build = s.get("build")
        if isinstance(build, str):
            build = {"context": build}
        if build:
            ctx = os.path.normpath(os.path.join(base, build.get("context", ".")))
            if not os.path.isdir(ctx):
                err(f"{where}: build context {build.get('context')} does not exist")
            df = os.path.join(ctx, build.get("dockerfile", "Dockerfile"))
            if not os.path.isfile(df):
                err(f"{where}: dockerfile {build.get('dockerfile')} does not exist")
        for v in s.get("volumes") or []:
            src = v.split(":")[0] if isinstance(v, str) else v.get("source")
            if src.startswith((".", "/")):
                if not os.path.exists(os.path.normpath(os.path.join(base, src))):
                    err(f"{where}: bind mount source {src} does not exist")
            elif src not in named_volumes:
                err(f"{where}: volume '{src}' is not declared under volumes:")
        deps = s.get("depends_on") or []
        for d in deps if isinstance(deps, list) else deps.keys():
            if d not in services:
                err(f"{where}: depends_on unknown service '{d}'")


def mounts(service):
    """[(source, target)] of a compose service's volumes."""
    out = []
    for v in service.get("volumes") or []:
        parts = v.split(":") if isinstance(v, str) else [v.get("source"), v.get("target")]
        out.append((parts[0], parts[1]))
    return out


def check_prometheus_and_ports(b, err):
    p = b["prometheus"]
    if p is None:
        return err("deploy/prometheus/prometheus.yml: missing")
    pdir = os.path.join(b["root"], "deploy", "prometheus")
    for rf in p.get("rule_files") or []:
        if not glob.glob(os.path.join(pdir, rf)):
            err(f"prometheus.yml: rule file {rf} does not exist")
    jobs = {j.get("job_name"): j for j in p.get("scrape_configs") or []}
    for needed in ("infersweep-coordinator", "infersweep-agent"):
        if needed not in jobs:
            err(f"prometheus.yml: no scrape job '{needed}' (the alerts and dashboards select it)")
    for j in jobs.values():
        for sd in j.get("file_sd_configs") or []:
            files = [f for pat in sd.get("files") or [] for f in glob.glob(os.path.join(pdir, pat))]
            if not files:
                err(f"prometheus.yml: job {j.get('job_name')}: file_sd pattern matches no file")
            for f in files:
                docs = yaml.safe_load(open(f))
                if not isinstance(docs, list):
                    err(f"{rel(b['root'], f)}: file_sd must be a list of target groups")

    # Coordinator: prometheus target host:port == compose service : --metrics-listen port.
    coord = jobs.get("infersweep-coordinator") or {}
    targets = [t for sc in coord.get("static_configs") or [] for t in sc.get("targets") or []]
    services = (b["compose"] or {}).get("services") or {}
    for t in targets:
        host, _, port = t.rpartition(":")
        s = services.get(host)
        if s is None:
            err(f"prometheus.yml: coordinator target {t}: no compose service '{host}'")
            continue
        listen = flag_value(s.get("command"), "--metrics-listen")
        if port_of_listen(listen) != int(port):
            err(f"prometheus.yml: coordinator target {t} but compose '{host}' serves metrics on {listen}")
        if not str(listen).startswith("0.0.0.0:"):
            err(f"compose '{host}': --metrics-listen {listen} is not reachable from Prometheus")
        exposed = {str(e) for e in s.get("expose") or []} | {str(x).split(":")[-1] for x in s.get("ports") or []}
        if port not in exposed:
            err(f"compose '{host}': metrics port {port} is neither exposed nor published")

    # The same ports everywhere: coordinator 9464, agent 9465 (Kubernetes, systemd, Dockerfiles).
    expected = {}
    for _, d in b["k8s"]:
        if d.get("kind") in WORKLOAD_KINDS:
            for c in containers_of(d):
                for port in c.get("ports") or []:
                    if port.get("name") == "metrics":
                        expected[d["metadata"]["name"]] = port.get("containerPort")
    for name, role in (("infersweep-coordinator", "coordinator"), ("infersweep-agent", "agent")):
        port = expected.get(name)
        if port is None:
            err(f"deploy/k8s: {name} declares no 'metrics' container port")
            continue
        if role == "coordinator":
            for t in targets:
                if int(t.rpartition(":")[2]) != port:
                    err(f"prometheus.yml: coordinator target {t} differs from Kubernetes' metrics port {port}")
        unit = b["units"].get(f"deploy/systemd/infersweep-{role}.service", "")
        m = re.search(r"--metrics-listen[ =](\S+)", unit)
        if not m or port_of_listen(m.group(1)) != port:
            err(f"deploy/systemd/infersweep-{role}.service: --metrics-listen must use port {port}")
        df = b["dockerfiles"].get(f"deploy/docker/Dockerfile.{role}", "")
        exposed = {int(x) for line in re.findall(r"^EXPOSE\s+(.*)$", df, re.M) for x in line.split()}
        if port not in exposed:
            err(f"deploy/docker/Dockerfile.{role}: does not EXPOSE the metrics port {port}")
        m = re.search(r'"--metrics-listen",\s*"([^"]+)"', df)
        if not m or port_of_listen(m.group(1)) != port:
            err(f"deploy/docker/Dockerfile.{role}: CMD must pass --metrics-listen with port {port}")
        agents_file = os.path.join(pdir, "agents", "agents.yml")
        if role == "agent" and os.path.exists(agents_file) and f":{port}" not in open(agents_file).read():
            err(f"deploy/prometheus/agents/agents.yml: the example targets must use port {port}")

    # Alert rules: the jobs they select exist, and each rule is complete and documented.
    a = b["alerts"]
    if a is None:
        return err("deploy/prometheus/alerts.yml: missing")
    seen = set()
    for g in a.get("groups") or []:
        for r in g.get("rules") or []:
            name = r.get("alert") or r.get("record")
            if not name or not r.get("expr"):
                err(f"alerts.yml: group {g.get('name')}: a rule without a name or expr")
                continue
            if name in seen:
                err(f"alerts.yml: duplicate rule {name}")
            seen.add(name)
            if r.get("alert"):
                if not (r.get("labels") or {}).get("severity"):
                    err(f"alerts.yml: {name}: no severity label")
                if not (r.get("annotations") or {}).get("summary"):
                    err(f"alerts.yml: {name}: no summary annotation")
                if name not in b["docs"]["OBSERVABILITY.md"]:
                    err(f"alerts.yml: {name} is not documented in docs/OBSERVABILITY.md")
            for job in re.findall(r'job\s*=\s*"([^"]+)"', r["expr"]):
                if job not in jobs:
                    err(f"alerts.yml: {name} selects job '{job}', which prometheus.yml does not scrape")
            for metric in set(re.findall(r"\binfersweep_[a-z0-9_]+", r["expr"])):
                if not documented_metric(b, metric):
                    err(f"alerts.yml: {name} uses {metric}, which docs/OBSERVABILITY.md does not document")


def documented_metric(b, metric):
    doc = b["docs"]["OBSERVABILITY.md"]
    base = re.sub(r"_(bucket|sum|count)$", "", metric)
    return f"`{metric}`" in doc or f"`{base}`" in doc


def check_grafana(b, err):
    ds = b["datasources"]
    uids = {}
    if ds is None:
        err("dashboards/provisioning/datasources/datasources.yaml: missing")
    else:
        for d in ds.get("datasources") or []:
            uids[d.get("uid")] = d.get("type")
    providers = (b["dashboard_providers"] or {}).get("providers") or []
    if not providers:
        err("dashboards/provisioning/dashboards/dashboards.yaml: no providers")
    graf = ((b["compose"] or {}).get("services") or {}).get("grafana")
    if graf:
        targets = {t: s for s, t in mounts(graf)}
        for p in providers:
            path = (p.get("options") or {}).get("path")
            if targets.get(path) != "../../dashboards":
                err(f"dashboards.yaml: provider path {path} is not where compose mounts dashboards/")
        for d in (ds or {}).get("datasources") or []:
            if d.get("type") == "frser-sqlite-datasource":
                db = (d.get("jsonData") or {}).get("path", "")
                vol = [s for s, t in mounts(graf) if db.startswith(t.rstrip("/") + "/")]
                coord = (b["compose"].get("services") or {}).get("coordinator") or {}
                coord_db = flag_value(coord.get("command"), "--db") or ""
                coord_vol = [s for s, t in mounts(coord) if coord_db.startswith(t.rstrip("/") + "/")]
                if not vol or vol != coord_vol or os.path.basename(db) != os.path.basename(coord_db):
                    err(f"datasources.yaml: SQLite path {db} is not the coordinator's --db {coord_db} "
                        "through a shared volume")
            if d.get("type") == "prometheus":
                host = re.sub(r"^https?://([^:/]+).*", r"\1", d.get("url", ""))
                if host not in (b["compose"].get("services") or {}):
                    err(f"datasources.yaml: Prometheus url {d.get('url')} is not a compose service")
    if not b["dashboards"]:
        err("dashboards/: no dashboards")
    seen_uids = set()
    for path, dash in b["dashboards"].items():
        for field in ("uid", "title", "panels", "schemaVersion"):
            if field not in dash:
                err(f"{path}: missing '{field}'")
        if dash.get("uid") in seen_uids:
            err(f"{path}: duplicate dashboard uid {dash.get('uid')}")
        seen_uids.add(dash.get("uid"))
        if os.path.basename(path) not in b["docs"]["OBSERVABILITY.md"]:
            err(f"{path}: not described in docs/OBSERVABILITY.md")
        ids = set()
        for var in (dash.get("templating") or {}).get("list") or []:
            uid = (var.get("datasource") or {}).get("uid")
            if var.get("type") == "query" and uid not in uids:
                err(f"{path}: variable ${var.get('name')} uses unknown data source uid {uid}")
        for panel in dash.get("panels") or []:
            title = f"{path}: panel '{panel.get('title')}'"
            if panel.get("id") in ids:
                err(f"{title}: duplicate panel id {panel.get('id')}")
            ids.add(panel.get("id"))
            if "gridPos" not in panel:
                err(f"{title}: no gridPos")
            if panel.get("type") == "row":
                continue
            if not panel.get("targets"):
                err(f"{title}: no queries")
            for t in panel.get("targets") or []:
                uid = (t.get("datasource") or panel.get("datasource") or {}).get("uid")
                kind = uids.get(uid)
                if kind is None:
                    err(f"{title}: unknown data source uid {uid}")
                elif kind == "prometheus":
                    if not (t.get("expr") or "").strip():
                        err(f"{title}: empty PromQL expr")
                    for metric in set(re.findall(r"\binfersweep_[a-z0-9_]+", t.get("expr", ""))):
                        if not documented_metric(b, metric):
                            err(f"{title}: uses {metric}, which docs/OBSERVABILITY.md does not document")
                elif kind == "frser-sqlite-datasource":
                    if not t.get("queryText") or t.get("queryText") != t.get("rawQueryText"):
                        err(f"{title}: SQLite target needs queryText == rawQueryText")


def check_units(b, err):
    if not b["units"]:
        return err("deploy/systemd: no units")
    for path, text in b["units"].items():
        for key in ("ProtectSystem=strict", "NoNewPrivileges=yes", "StateDirectory="):
            if key not in text:
                err(f"{path}: missing {key}")
        if "DynamicUser=yes" not in text and not re.search(r"^User=\S+", text, re.M):
            err(f"{path}: runs as root (set DynamicUser=yes or User=)")
    analyze = shutil.which("systemd-analyze")
    if analyze is None or b.get("skip_systemd_analyze"):
        return
    with tempfile.TemporaryDirectory() as tmp:
        for path, text in b["units"].items():
            unit = os.path.join(tmp, os.path.basename(path))
            with open(unit, "w") as f:
                f.write(text.replace("/usr/local/bin/infersweep", "/bin/true"))
            r = subprocess.run([analyze, "verify", "--man=no", unit], capture_output=True, text=True)
            lines = [l for l in (r.stdout + r.stderr).splitlines() if os.path.basename(path) in l]
            if r.returncode != 0 or lines:
                err(f"{path}: systemd-analyze verify: " + "; ".join(lines or [r.stderr.strip()]))


# The flags that turn TLS and the tokens on (docs/SECURITY.md): every coordinator and agent that
# deploy/ starts must pass them.
COORDINATOR_SECURITY = (("--tls-cert",), ("--tls-key",),
                        ("--agent-tokens-file", "--agent-token-file", "--auth-token-env"),
                        ("--user-token-file",))
AGENT_SECURITY = (("--tls-ca",), ("--token-file", "--auth-token-env"))


def unit_exec_start(text):
    """The ExecStart= command line of a unit, continuation lines joined, split into words."""
    m = re.search(r"^ExecStart=((?:.*\\\n)*.*)$", text, re.M)
    return m.group(1).replace("\\\n", " ").split() if m else []


def dockerfile_cmd(text):
    """The JSON-array CMD of a Dockerfile, as a list ([] when there is none)."""
    m = re.search(r"^CMD\s+(\[(?:.|\n)*?\])\s*$", text.replace("\\\n", " "), re.M)
    try:
        return json.loads(m.group(1)) if m else []
    except ValueError:
        return []


def has_flag(args, flag):
    return any(str(a) == flag or str(a).startswith(flag + "=") for a in args or [])


def invocations(b):
    """(where, role, argv) of every coordinator and agent deploy/ starts."""
    out = []
    for path, text in b["units"].items():
        role = "coordinator" if "coordinator" in os.path.basename(path) else "agent"
        out.append((f"{path} ExecStart", role, unit_exec_start(text)))
    for path, text in b["dockerfiles"].items():
        role = "coordinator" if path.endswith("coordinator") else "agent"
        out.append((f"{path} CMD", role, dockerfile_cmd(text)))
    for name, svc in ((b["compose"] or {}).get("services") or {}).items():
        if name == "coordinator":
            out.append((f"compose service {name} command", "coordinator", svc.get("command")))
    for path, d in b["k8s"]:
        if d.get("kind") in WORKLOAD_KINDS:
            role = "agent" if d.get("kind") == "DaemonSet" else "coordinator"
            for c in containers_of(d):
                out.append((f"{path}: {d['kind']}/{d['metadata'].get('name')} container "
                            f"{c.get('name')} args", role, c.get("args")))
    return out


def check_security(b, err):
    """TLS and both tokens on everywhere; secrets present where they are referenced, and not
    world-readable."""
    for where, role, argv in invocations(b):
        for alternatives in COORDINATOR_SECURITY if role == "coordinator" else AGENT_SECURITY:
            if not any(has_flag(argv, f) for f in alternatives):
                err(f"{where}: the {role} runs without {' or '.join(alternatives)} "
                    f"(docs/SECURITY.md: TLS and tokens on by default)")
    for path, text in b["units"].items():
        creds = set(re.findall(r"^LoadCredential=([^:\s]+):", text, re.M))
        for name in re.findall(r"%d/([\w.-]+)", " ".join(unit_exec_start(text))):
            if name not in creds:
                err(f"{path}: ExecStart uses %d/{name} but no LoadCredential={name}: provides it")
    compose = b["compose"] or {}
    declared = set((compose.get("secrets") or {}).keys())
    for name, svc in (compose.get("services") or {}).items():
        mounted = {x if isinstance(x, str) else x.get("source") for x in svc.get("secrets") or []}
        for m in mounted - declared:
            err(f"compose service {name}: secret '{m}' is not declared under secrets:")
        for arg in svc.get("command") or []:
            if str(arg).startswith("/run/secrets/") and str(arg)[len("/run/secrets/"):] not in mounted:
                err(f"compose service {name}: {arg} is not one of its secrets")
    for path, d in b["k8s"]:
        if d.get("kind") not in WORKLOAD_KINDS:
            continue
        where = f"{path}: {d['kind']}/{d['metadata'].get('name')}"
        for v in (pod_template(d).get("spec") or {}).get("volumes") or []:
            secret = v.get("secret")
            if not secret:
                continue
            if secret.get("secretName") not in b["docs"]["DEPLOYMENT.md"]:
                err(f"{where}: Secret '{secret.get('secretName')}' is not explained in "
                    f"docs/DEPLOYMENT.md")
            if int(secret.get("defaultMode", 0o644)) & 0o007:
                err(f"{where}: Secret volume '{v.get('name')}' is world-readable (defaultMode)")


def run_checks(b):
    errors = list(b["errors_parse"])
    err = errors.append
    check_k8s(b, err)
    check_compose(b, err)
    check_prometheus_and_ports(b, err)
    check_grafana(b, err)
    check_units(b, err)
    check_security(b, err)
    return errors


# ----------------------------------------------------------------------------- self-test

def find(b, kind, name):
    for _, d in b["k8s"]:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError(f"{kind}/{name}")


def mutations():
    """(description, function that breaks a bundle in place)."""
    def svc_selector(b):
        find(b, "Service", "infersweep-coordinator")["spec"]["selector"] = {"app": "nothing"}

    def no_claims(b):
        del find(b, "StatefulSet", "infersweep-coordinator")["spec"]["volumeClaimTemplates"]

    def no_gpu(b):
        for c in containers_of(find(b, "DaemonSet", "infersweep-agent")):
            c["resources"]["limits"].pop("nvidia.com/gpu", None)
            c["resources"]["requests"].pop("nvidia.com/gpu", None)

    def compose_port(b):
        cmd = b["compose"]["services"]["coordinator"]["command"]
        i = cmd.index("--metrics-listen")
        cmd[i + 1] = "0.0.0.0:9999"

    def compose_missing_file(b):
        b["compose"]["services"]["coordinator"]["build"]["dockerfile"] = "deploy/docker/Nope"

    def no_name(b):
        del find(b, "Service", "infersweep-agent")["metadata"]["name"]

    def monitor_port(b):
        find(b, "ServiceMonitor", "infersweep-agent")["spec"]["endpoints"][0]["port"] = "http"

    def unit_port(b):
        k = "deploy/systemd/infersweep-agent.service"
        b["units"][k] = b["units"][k].replace("0.0.0.0:9465", "0.0.0.0:9400")

    def dashboard_ds(b):
        dash = next(iter(b["dashboards"].values()))
        next(p for p in dash["panels"] if p["type"] != "row")["targets"][0]["datasource"] = {"uid": "nope"}

    def alert_job(b):
        b["alerts"]["groups"][0]["rules"][0]["expr"] = 'up{job="coordinator"} == 0'

    def bad_yaml(b):
        b["errors_parse"].append("simulated: YAML does not parse")

    def undocumented_metric(b):
        b["alerts"]["groups"][0]["rules"][0]["expr"] = "infersweep_no_such_metric > 0"

    def unit_no_tls(b):
        k = "deploy/systemd/infersweep-coordinator.service"
        b["units"][k] = b["units"][k].replace("--tls-cert %d/tls-cert", "")

    def k8s_no_user_token(b):
        for c in containers_of(find(b, "StatefulSet", "infersweep-coordinator")):
            c["args"] = [a for a in c["args"] if not a.startswith("--user-token-file")]

    def k8s_agent_plaintext(b):
        for c in containers_of(find(b, "DaemonSet", "infersweep-agent")):
            c["args"] = [a for a in c["args"] if not a.startswith("--tls-ca")]

    def compose_undeclared_secret(b):
        del b["compose"]["secrets"]["user.token"]

    def unit_missing_credential(b):
        k = "deploy/systemd/infersweep-agent.service"
        b["units"][k] = b["units"][k].replace("LoadCredential=tls-ca:", "LoadCredential=tls-cax:")

    def k8s_world_readable(b):
        for v in pod_template(find(b, "StatefulSet", "infersweep-coordinator"))["spec"]["volumes"]:
            if v.get("secret"):
                v["secret"]["defaultMode"] = 0o444

    def unit_hardening(b):
        k = "deploy/systemd/infersweep-coordinator.service"
        b["units"][k] = b["units"][k].replace("ProtectSystem=strict", "ProtectSystem=full")

    return [("a Service selector matching no pod", svc_selector),
            ("a StatefulSet without volumeClaimTemplates", no_claims),
            ("a DaemonSet without nvidia.com/gpu", no_gpu),
            ("compose serving metrics on another port than prometheus.yml scrapes", compose_port),
            ("compose referencing a missing Dockerfile", compose_missing_file),
            ("an object without metadata.name", no_name),
            ("a ServiceMonitor port the Service lacks", monitor_port),
            ("a systemd unit on another metrics port", unit_port),
            ("a dashboard panel with an unknown data source", dashboard_ds),
            ("an alert selecting a job Prometheus does not scrape", alert_job),
            ("a file that does not parse", bad_yaml),
            ("an alert on an undocumented metric", undocumented_metric),
            ("a unit without ProtectSystem=strict", unit_hardening),
            ("a coordinator unit without TLS", unit_no_tls),
            ("a Kubernetes coordinator without the user token", k8s_no_user_token),
            ("a Kubernetes agent without --tls-ca", k8s_agent_plaintext),
            ("compose mounting an undeclared secret", compose_undeclared_secret),
            ("a unit using %d/NAME without LoadCredential=NAME", unit_missing_credential),
            ("a world-readable Secret volume", k8s_world_readable)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    bundle = load_bundle(args.root)
    errors = run_checks(bundle)
    for e in errors:
        print(f"FAIL: {e}")
    if errors:
        print(f"# {len(errors)} problem(s) in the deployment files")
        return 1
    print(f"# deployment files OK: {len(bundle['yaml_files'])} YAML, {len(bundle['dashboards'])} "
          f"dashboards, {len(bundle['k8s'])} Kubernetes objects, {len(bundle['units'])} units, "
          f"{len(bundle['dockerfiles'])} Dockerfiles")
    if args.self_test:
        bundle["skip_kubectl"] = True  # it renders the files on disk, not the mutated bundle
        missed = 0
        for what, breaker in mutations():
            broken = copy.deepcopy(bundle)
            breaker(broken)
            found = run_checks(broken)
            print(f"# self-test: {what}: {'caught' if found else 'NOT CAUGHT'}"
                  + (f" ({found[0]})" if found else ""))
            missed += not found
        if missed:
            print(f"FAIL: the checks missed {missed} deliberate break(s)")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
