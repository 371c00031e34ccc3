//! `cargo xtask demo`: shunt as a mesh's data plane on one node, told to a person. A
//! control plane (an ADS server and a CA, in this process), `shunt node` with eBPF
//! capture, four pods built by the real CNI plugins with `shunt-cni` chained; then what
//! the mesh does between them: mTLS with SPIFFE identities, a header-based route, an
//! AuthorizationPolicy deny, a ServiceEntry name answered by the pod's DNS proxy,
//! `istio_requests_total` on each pod's 15090, and `shunt inspect`. Every step checks
//! what it shows and fails the demo when it did not happen; guards remove everything
//! (pods, the node process, its pins, the node's namespaces and cgroups) even then.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use harness::Node;
use shunt::dns::name_table::{NameInfo, NameTable};

use super::cni::{CniPod, Runtime};
use super::mesh_config::{self, DENIED_PATH, PORT, SERVICE_ENTRY, SERVICE_ENTRY_VIP, V2_HEADER};
use super::passthrough::{heading, host, print_indented};
use crate::bench::node_mesh::{ControlPlane, Scratch};
use crate::pods::{APP_UID, Bins};

/// The demo's own pin root: it never touches a real install under /sys/fs/bpf/shunt.
const PIN_ROOT: &str = "/sys/fs/bpf/shunt-demo-mesh";
/// host-local's range on the node's CNI bridge (inside the node's own namespace).
const POD_SUBNET: &str = "10.88.0.0/24";
const NDS_TYPE_URL: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
/// How many calls each routed step makes.
const CALLS: usize = 3;

pub(super) fn run() -> Result<()> {
    let bins = Bins::build(false)?;
    let started = Instant::now();

    heading(1, "A node: its control plane and `shunt node`");
    let node = Node::new()?;
    let scratch = Scratch::new("demo-mesh")?;
    let dir = scratch.0.clone();
    let cp = ControlPlane::start_unset(&node, &dir)?;
    println!("The control plane (in this process, as istiod would be):");
    println!("  ADS (LDS, CDS, NDS) on {}", dir.join("XDS").display());
    println!("  a CA issuing SPIFFE certificates at {}", cp.ca.address());
    let agent = NodeProcess::start(&bins.shunt, &node, &dir, &cp)?;
    println!("\n  host$ {}", agent.shown);
    println!(
        "  one process serves every pod of the node; capture (eBPF) attached once at {}",
        node.cgroup_path().display()
    );

    heading(2, "Four pods, enrolled by the real CNI plugins");
    let runtime = Runtime::new(
        &node.bridge_netns_path(),
        &dir,
        &bins.shunt,
        &agent.socket,
        POD_SUBNET,
    )?;
    println!("The node's network configuration (bridge + host-local, shunt-cni chained last):");
    print_indented(&serde_json::to_string_pretty(&runtime.conflist)?);
    let mut pods = Vec::new();
    for (name, namespace) in [
        ("sleep", "frontend"),
        ("reviews-v1", "shop"),
        ("reviews-v2", "shop"),
        ("ratings", "shop"),
    ] {
        let pod = runtime.add(name, namespace)?;
        println!(
            "  CNI ADD {:<11} ns {:<9} -> {:<12} enrolled: {}",
            pod.name,
            pod.namespace,
            pod.ip,
            pod.identity()
        );
        pods.push(pod);
    }
    let apps_cgroup = node.cgroup_path().join("apps");
    let mut apps = Vec::new();
    for pod in &pods[1..] {
        apps.push(App::serve(&bins.testapp, pod, &apps_cgroup)?);
    }
    println!(
        "Each shop pod runs an HTTP app on :{PORT} (testapp: `HELLO peer=<who it sees> ...`)."
    );
    let (sleep, v1, v2, ratings) = (&pods[0], &pods[1], &pods[2], &pods[3]);

    heading(3, "The control plane pushes the config");
    let up = mesh_config::Upstreams {
        reviews_v1: v1.ip,
        reviews_v2: v2.ip,
        ratings: ratings.ip,
        shop_identity: v1.identity(),
        denied_identity: sleep.identity(),
    };
    let before = ready_code(&node, sleep);
    println!("Before the push, sleep's proxy has no config: :15021/healthz/ready says {before}.");
    ensure!(
        before != "200",
        "sleep's proxy was ready before any config was pushed"
    );
    push_name_table(&cp)?;
    cp.push(&dir, "1", mesh_config::resources(&up))?;
    println!(
        "  LDS: virtualOutbound (15001: HTTP routes on :{PORT}), virtualInbound (15006: mTLS, RBAC, istio.stats)"
    );
    println!(
        "  CDS: reviews v1 and v2, {SERVICE_ENTRY}, each mTLS checking the peer's SPIFFE identity"
    );
    println!(
        "  NDS: {SERVICE_ENTRY} -> {SERVICE_ENTRY_VIP} (a ServiceEntry with no address: auto-allocated)"
    );
    for pod in &pods {
        wait_ready(&node, pod)?;
    }
    println!(
        "Every pod's proxy has its config and its certificate: /healthz/ready on :15021 says 200 for all four."
    );

    let client = Client {
        pod: sleep,
        cgroup: &apps_cgroup,
    };
    heading(4, "mTLS between pods, with SPIFFE identities");
    mtls(&client, &node, v1)?;

    heading(5, "HTTP routing: a VirtualService on reviews, by header");
    routing(&client, &node, v1, v2)?;

    heading(
        6,
        "An AuthorizationPolicy: DENY /admin to the frontend's identity",
    );
    deny(&client, ratings, v1, &apps_cgroup)?;

    heading(
        7,
        "DNS: a ServiceEntry name, answered by the pod's DNS proxy",
    );
    dns(&client, &node, ratings)?;

    heading(
        8,
        "Istio's metrics on the pod's Prometheus endpoint (15090)",
    );
    metrics(&node, sleep, v1)?;

    heading(9, "Looking inside: shunt inspect");
    let inspect = ["inspect", "--bpffs", PIN_ROOT];
    println!("  host$ shunt {}", inspect.join(" "));
    let said = host(Command::new(&bins.shunt).args(inspect))?;
    print_indented(&said);
    for pod in &pods {
        ensure!(
            said.contains(&pod.ip.to_string()),
            "shunt inspect does not show {} ({})",
            pod.name,
            pod.ip
        );
    }
    println!("Every pod's address is in the node's pinned maps.");

    heading(10, "Clean up");
    let netns: Vec<PathBuf> = pods.iter().map(|p| p.netns.clone()).collect();
    drop(apps);
    for pod in pods.drain(..).rev() {
        println!("  CNI DEL {} (shunt-cni, bridge, host-local)", pod.name);
        drop(pod);
    }
    agent.stop_and_uninstall(&bins.shunt)?;
    let leftovers: Vec<PathBuf> = netns
        .into_iter()
        .chain([
            node.cgroup_path(),
            node.bridge_netns_path(),
            PIN_ROOT.into(),
            dir.clone(),
        ])
        .collect();
    drop(cp);
    drop(node);
    drop(scratch);
    for path in &leftovers {
        ensure!(!path.exists(), "{} is still there", path.display());
        println!("  gone: {}", path.display());
    }
    println!(
        "\nThe demo is over ({} s after the build); nothing is left behind. `cargo xtask demo --passthrough` shows capture alone.",
        started.elapsed().as_secs()
    );
    Ok(())
}

/// The server's certificate as seen from outside the mesh, then a call from sleep.
fn mtls(client: &Client, node: &Node, v1: &CniPod) -> Result<()> {
    println!("From the node (no certificate), reviews-v1's inbound side presents its certificate:");
    let script = format!(
        "openssl s_client -connect {}:{PORT} </dev/null 2>/dev/null | openssl x509 -noout -ext subjectAltName",
        v1.ip
    );
    println!("  host$ {script}");
    let san = in_node(node, &["sh", "-c", &script])?;
    print_indented(&san);
    ensure!(
        san.contains(&format!("URI:{}", v1.identity())),
        "reviews-v1 did not present {}",
        v1.identity()
    );
    let plain = in_node(
        node,
        &[
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
            &format!("http://{}:{PORT}/", v1.ip),
        ],
    );
    println!(
        "  host$ curl http://{}:{PORT}/   -> {}",
        v1.ip,
        match &plain {
            Ok(code) => format!("HTTP {code}"),
            Err(_) => "refused: plain text is not accepted (PeerAuthentication STRICT)".into(),
        }
    );
    ensure!(
        plain.as_ref().map_or(true, |code| code == "000"),
        "plain HTTP reached reviews-v1's app: {plain:?}"
    );
    println!("\nsleep's app calls reviews-v1 by its address; both proxies are the node process:");
    let r = client.get(v1.ip, "/", &[])?;
    ensure!(r.status == 200, "sleep -> reviews-v1: HTTP {}", r.status);
    ensure!(
        r.body.contains("peer=127.0.0.1:"),
        "reviews-v1's app saw {:?}: not its inbound proxy",
        r.body.trim()
    );
    println!("  HTTP 200, reviews-v1's app says: {}", r.body.trim());
    println!(
        "  (the app sees its own proxy on 127.0.0.1: sleep's proxy originated mTLS as {}, reviews-v1's terminated it)",
        client.pod.identity()
    );
    Ok(())
}

fn routing(client: &Client, node: &Node, v1: &CniPod, v2: &CniPod) -> Result<()> {
    let (header, value) = V2_HEADER;
    let before = (requests(node, v1, &[])?, requests(node, v2, &[])?);
    for _ in 0..CALLS {
        let r = client.get(v1.ip, "/", &[])?;
        ensure!(r.status == 200, "HTTP {}", r.status);
    }
    println!(
        "  [pod sleep]$ curl http://{}:{PORT}/               x{CALLS}",
        v1.ip
    );
    for _ in 0..CALLS {
        let r = client.get(v1.ip, "/", &[(header, value)])?;
        ensure!(r.status == 200, "HTTP {}", r.status);
    }
    println!(
        "  [pod sleep]$ curl -H '{header}: {value}' http://{}:{PORT}/  x{CALLS}",
        v1.ip
    );
    let want = (before.0 + CALLS as f64, before.1 + CALLS as f64);
    let after = (
        settled_requests(node, v1, want.0)?,
        settled_requests(node, v2, want.1)?,
    );
    let got = (after.0 - before.0, after.1 - before.1);
    println!(
        "  requests counted by each pod's own proxy: reviews-v1 +{}, reviews-v2 +{}",
        got.0, got.1
    );
    ensure!(
        got == (CALLS as f64, CALLS as f64),
        "expected {CALLS} requests on each version, got v1 +{} v2 +{}",
        got.0,
        got.1
    );
    println!(
        "  the route sent `{header}: {value}` to v2 and the rest to v1, whatever address the app used."
    );
    Ok(())
}

fn deny(client: &Client, ratings: &CniPod, v1: &CniPod, cgroup: &Path) -> Result<()> {
    let r = client.get(v1.ip, DENIED_PATH, &[])?;
    println!(
        "  [pod sleep]$ curl http://{}:{PORT}{DENIED_PATH}   -> HTTP {} {}",
        v1.ip,
        r.status,
        r.body.trim()
    );
    ensure!(
        r.status == 403,
        "sleep got HTTP {} for {DENIED_PATH}, not 403",
        r.status
    );
    let shop = Client {
        pod: ratings,
        cgroup,
    };
    let r = shop.get(v1.ip, DENIED_PATH, &[])?;
    println!(
        "  [pod ratings]$ curl http://{}:{PORT}{DENIED_PATH} -> HTTP {}",
        v1.ip, r.status
    );
    ensure!(
        r.status == 200,
        "ratings ({}) got HTTP {}: the policy is not by identity",
        ratings.identity(),
        r.status
    );
    println!(
        "  the same request from {} passes: the rule matches the caller's certificate.",
        ratings.identity()
    );
    Ok(())
}

fn dns(client: &Client, node: &Node, ratings: &CniPod) -> Result<()> {
    println!(
        "sleep's resolver asks the node's nameserver; capture sends the query to the pod's DNS proxy (:15053):"
    );
    let answer = client.run(&["dig", "+short", "+time=2", "+tries=1", SERVICE_ENTRY])?;
    println!(
        "  [pod sleep]$ dig +short {SERVICE_ENTRY}\n    {}",
        answer.trim()
    );
    ensure!(
        answer.trim() == SERVICE_ENTRY_VIP.to_string(),
        "{SERVICE_ENTRY} resolved to {:?}, not {SERVICE_ENTRY_VIP}",
        answer.trim()
    );
    let before = requests(node, ratings, &[])?;
    let body = client.run(&[
        "curl",
        "-sS",
        "--fail",
        "--max-time",
        "10",
        &format!("http://{SERVICE_ENTRY}:{PORT}/"),
    ])?;
    println!(
        "  [pod sleep]$ curl http://{SERVICE_ENTRY}:{PORT}/\n    {}",
        body.trim()
    );
    let after = settled_requests(node, ratings, before + 1.0)?;
    ensure!(
        after - before == 1.0,
        "ratings counted {} requests for the call by name",
        after - before
    );
    println!(
        "  the connect to {SERVICE_ENTRY_VIP} was captured and routed by its Host to the ratings pod (its 15090 counted it)."
    );
    Ok(())
}

fn metrics(node: &Node, sleep: &CniPod, v1: &CniPod) -> Result<()> {
    let url = format!("http://{}:15090/stats/prometheus", v1.ip);
    println!("  host$ curl -s {url} | grep istio_requests_total");
    let text = in_node(node, &["curl", "-sS", "--max-time", "5", &url])?;
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("istio_requests_total{"))
        .collect();
    for line in &lines {
        println!("    {line}");
    }
    let identity = sleep.identity();
    let from_sleep = [
        ("reporter", "destination"),
        ("source_principal", identity.as_str()),
        ("connection_security_policy", "mutual_tls"),
    ];
    let ok = total(
        &text,
        &[&from_sleep[..], &[("response_code", "200")]].concat(),
    );
    let denied = total(
        &text,
        &[&from_sleep[..], &[("response_code", "403")]].concat(),
    );
    // sleep's calls to v1: one in step 4, CALLS in step 5; one denied in step 6.
    ensure!(
        ok == 1.0 + CALLS as f64,
        "reviews-v1 counted {ok} 200s from sleep, expected {}",
        1 + CALLS
    );
    ensure!(
        denied == 1.0,
        "reviews-v1 counted {denied} 403s from sleep, expected 1"
    );
    println!(
        "  reviews-v1 counted {ok} requests from {} over mutual_tls answered 200, and 1 denied (403).",
        sleep.identity()
    );
    Ok(())
}

/// The `istio_requests_total` of `pod` (reporter=destination) whose labels include `labels`.
fn requests(node: &Node, pod: &CniPod, labels: &[(&str, &str)]) -> Result<f64> {
    let text = in_node(
        node,
        &[
            "curl",
            "-sS",
            "--max-time",
            "5",
            &format!("http://{}:15090/stats/prometheus", pod.ip),
        ],
    )?;
    Ok(total(
        &text,
        &[&[("reporter", "destination")][..], labels].concat(),
    ))
}

/// `requests(node, pod, &[])` once it reaches `want` (a request is counted when its
/// stream ends, just after the client has its response), or after 5 s.
fn settled_requests(node: &Node, pod: &CniPod, want: f64) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = requests(node, pod, &[])?;
        if got >= want || Instant::now() > deadline {
            return Ok(got);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The sum of the `istio_requests_total` samples carrying every one of `labels`.
fn total(text: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("istio_requests_total{"))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The ServiceEntry's name with its allocated address, as istiod's NameTable carries it.
fn push_name_table(cp: &ControlPlane) -> Result<()> {
    use prost::Message;
    let mut table = NameTable::default();
    table.table.insert(
        SERVICE_ENTRY.into(),
        NameInfo {
            ips: vec![SERVICE_ENTRY_VIP.to_string()],
            registry: "External".into(),
            ..Default::default()
        },
    );
    let any = harness::ads::Any {
        type_url: NDS_TYPE_URL.into(),
        value: table.encode_to_vec(),
    };
    cp.ads().set(NDS_TYPE_URL, "1", vec![(String::new(), any)]);
    Ok(())
}

/// Waits until `pod`'s proxy says it is ready (its config and certificate are in).
fn wait_ready(node: &Node, pod: &CniPod) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let code = ready_code(node, pod);
        if code == "200" {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{} never became ready (/healthz/ready: {code})", pod.name);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The status of `pod`'s `/healthz/ready` on :15021 (`000`: no answer).
fn ready_code(node: &Node, pod: &CniPod) -> String {
    let url = format!("http://{}:15021/healthz/ready", pod.ip);
    let args = [
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "2",
        &url,
    ];
    in_node(node, &args).unwrap_or_else(|_| "000".into())
}

/// Runs a command in the node's own namespace (the DaemonSet's host network); its stdout.
fn in_node(node: &Node, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", node.bridge_netns_path().display()))
        .args(args);
    let out = cmd.output().with_context(|| format!("running {args:?}"))?;
    if !out.status.success() {
        bail!(
            "{args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// An app process in a pod (its cgroup under the node's, as uid 1000).
struct Client<'a> {
    pod: &'a CniPod,
    cgroup: &'a Path,
}

struct Response {
    status: u16,
    body: String,
}

impl Client<'_> {
    fn run(&self, args: &[&str]) -> Result<String> {
        let mut cmd = self.pod.command(self.cgroup, APP_UID, Path::new(args[0]));
        cmd.args(&args[1..]);
        let out = cmd
            .output()
            .with_context(|| format!("running {args:?} in {}", self.pod.name))?;
        if !out.status.success() {
            bail!(
                "[pod {}] {args:?} failed ({}): {}{}",
                self.pod.name,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `curl` GET `http://ip:8080path` with `headers`: the status and the body.
    fn get(
        &self,
        ip: std::net::Ipv4Addr,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<Response> {
        let url = format!("http://{ip}:{PORT}{path}");
        let mut args = vec![
            "curl".to_string(),
            "-sS".into(),
            "--max-time".into(),
            "10".into(),
            "-w".into(),
            "\n%{http_code}".into(),
        ];
        for (k, v) in headers {
            args.extend(["-H".into(), format!("{k}: {v}")]);
        }
        args.push(url);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.run(&args)?;
        let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        Ok(Response {
            status: code
                .parse()
                .with_context(|| format!("curl printed {out:?}"))?,
            body: body.to_owned(),
        })
    }
}

/// `testapp serve --mode http` in a pod, killed on drop.
struct App(Child);

impl App {
    fn serve(testapp: &Path, pod: &CniPod, cgroup: &Path) -> Result<App> {
        let child = pod
            .command(cgroup, APP_UID, testapp)
            .args(["serve", "--mode", "http", "--quiet", "yes", "--listen"])
            .arg(format!("0.0.0.0:{PORT}"))
            .stdout(Stdio::null())
            .spawn()
            .context("starting testapp")?;
        let app = App(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = Command::new("nsenter")
                .arg(format!("--net={}", pod.netns.display()))
                .args(["ss", "-Htln", &format!("sport = :{PORT}")])
                .output()?;
            if !out.stdout.is_empty() {
                return Ok(app);
            }
            ensure!(
                Instant::now() < deadline,
                "testapp never listened in {}",
                pod.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `shunt node` in the node's namespace and a cgroup under the pods' parent, with eBPF
/// capture and DNS capture, each pod's proxy from the control plane. Dropping it kills
/// it and runs `shunt node uninstall`.
struct NodeProcess {
    child: Option<Child>,
    pub socket: PathBuf,
    state: PathBuf,
    log: PathBuf,
    cgroup: PathBuf,
    shown: String,
    shunt: PathBuf,
}

impl NodeProcess {
    fn start(shunt: &Path, node: &Node, dir: &Path, cp: &ControlPlane) -> Result<NodeProcess> {
        let _ = std::fs::remove_dir_all(PIN_ROOT);
        let cgroup = node.cgroup_path().join("agent");
        std::fs::create_dir_all(&cgroup)?;
        let (socket, state, log, ready) = (
            dir.join("cni.sock"),
            dir.join("state"),
            dir.join("node.log"),
            dir.join("node.ready"),
        );
        let args: Vec<String> = [
            "node",
            "--cgroup",
            &node.cgroup_path().display().to_string(),
            "--bpffs",
            PIN_ROOT,
            "--redirect-dns",
            "--cni-socket",
            &socket.display().to_string(),
            "--state-dir",
            &state.display().to_string(),
            "--pod-bootstrap",
            &cp.template.display().to_string(),
            "--ca-addr",
            &cp.ca.address(),
            "--ca-root-cert",
            &cp.ca.root_file.display().to_string(),
            "--ca-token",
            &cp.token.display().to_string(),
            "--ready-file",
            &ready.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let file = || {
            std::fs::File::options()
                .create(true)
                .append(true)
                .open(&log)
        };
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec \"$@\"",
                cgroup.display()
            ))
            .arg("sh")
            .arg("nsenter")
            .arg(format!("--net={}", node.bridge_netns_path().display()))
            .arg(shunt)
            .args(&args)
            .stdout(file()?)
            .stderr(file()?)
            .spawn()
            .context("starting shunt node")?;
        let mut agent = NodeProcess {
            child: Some(child),
            socket,
            state,
            log,
            cgroup,
            shown: format!("shunt {}", args.join(" ")),
            shunt: shunt.to_owned(),
        };
        agent.wait_for(&ready)?;
        Ok(agent)
    }

    fn wait_for(&mut self, path: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !path.exists() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                bail!("shunt node exited ({status}):\n{}", self.log_text());
            }
            ensure!(
                Instant::now() < deadline,
                "shunt node never wrote {}:\n{}",
                path.display(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then `shunt node uninstall`: no program attached, nothing pinned.
    fn stop_and_uninstall(mut self, shunt: &Path) -> Result<()> {
        self.stop();
        let args = self.uninstall_args();
        println!(
            "  stopped shunt node; host$ {} {}",
            shunt.display(),
            args.join(" ")
        );
        let said = host(Command::new(shunt).args(&args))?;
        print_indented(&said);
        Ok(())
    }

    fn uninstall_args(&self) -> Vec<String> {
        vec![
            "node".into(),
            "uninstall".into(),
            "--bpffs".into(),
            PIN_ROOT.into(),
            "--state-dir".into(),
            self.state.display().to_string(),
            "--cni-socket".into(),
            self.socket.display().to_string(),
        ]
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.stop();
            let _ = Command::new(&self.shunt)
                .args(self.uninstall_args())
                .output();
        }
        let _ = std::fs::remove_dir_all(PIN_ROOT);
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}
