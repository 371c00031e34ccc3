//! The sidecar's place in a pod's life, the test playing the kubelet in the order each
//! injection shape (`deploy/injection/`, read here) makes it act: capture first, then
//! the agent, the app only once the agent's startupProbe passes (native) or its
//! postStart hook returns (classic); at termination the native preStop hook, SIGTERM
//! to the app, and to the agent only once the app is gone (native), or SIGTERM to every
//! container at once (classic).
//!
//! - native: the app's first call works and its in-flight outbound call outlives its
//!   SIGTERM while inbound is refused; the agent exits 0 after it;
//! - a Job (three calls, then exit) completes in both shapes: every process exits 0
//!   within the drain time (classic: the agent watches the app through the pod's
//!   shared process namespace);
//! - classic, on SIGTERM the agent serves the app's outbound until the app has exited;
//! - an app that connects before the proxy has any config waits in the backlog of the
//!   capture socket the agent bound first, and is served once the config arrives,
//!   under eBPF and iptables (before the agent's process exists nothing listens, and
//!   the connect is refused: what the probe and the hook prevent);
//! - init containers reach the network as uid 1337, to excluded ports and CIDRs, or
//!   through the native sidecar started before them, under eBPF and iptables.
//!
//! Needs root.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use harness::ads::resources::{load_assignment, named, tcp_proxy_listener};
use harness::ads::{AdsServer, type_urls};
use harness::{
    Node, Pod, PodCommand, PodProcess, shunt_bin, tcp_listeners, testapp_bin, wait_for_port,
};
use serde_json::{Value, json};
use support::xds::{bootstrap, eds_cluster, unix_server};
use support::{APP_UID, Caller, Capture, PROXY_UID, TempDir};

const STATUS: u16 = 15020;
const OUTBOUND: u16 = 15001;
const INBOUND: u16 = 15006;
/// The app's own server, reached by other pods through the inbound capture.
const APP_PORT: u16 = 8080;
/// Servers in the other pods.
const ECHO: u16 = 9001;
const ECHO_EXCLUDED: u16 = 9002;
const SLOW_ECHO: u16 = 9100;
/// Where the app calls: nothing listens there, so only the proxy (whose outbound goes
/// to its `upstream` cluster) makes such a call succeed.
const NOWHERE: u16 = 9999;
/// The agent's default TERMINATION_DRAIN_DURATION_SECONDS.
const DRAIN: Duration = Duration::from_secs(5);

// ------------------------------------------------------------ the shapes, as written

/// What the kubelet acts on in a committed injection shape.
struct Shape {
    /// istio-init's arguments after `capture`.
    capture: Vec<String>,
    /// The agent's startupProbe (path, port).
    startup_probe: Option<(String, u16)>,
    pre_stop: Option<Vec<String>>,
    post_start: Option<Vec<String>>,
}

fn shape(file: &str) -> Shape {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/injection")
        .join(file);
    let patch: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strings = |v: &Value| -> Option<Vec<String>> {
        Some(
            v.as_array()?
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
                .collect(),
        )
    };
    let init = &patch["initContainers"];
    let agent = [&init[1], &patch["containers"][0]]
        .into_iter()
        .find(|c| c["name"] == "istio-proxy")
        .expect("the agent's container");
    let capture = strings(&init[0]["args"]).unwrap();
    assert_eq!(capture[0], "capture");
    let probe = &agent["startupProbe"]["httpGet"];
    Shape {
        capture: capture[1..].to_vec(),
        startup_probe: probe["path"]
            .as_str()
            .map(|path| (path.to_owned(), probe["port"].as_u64().unwrap() as u16)),
        pre_stop: strings(&agent["lifecycle"]["preStop"]["exec"]["command"]),
        post_start: strings(&agent["lifecycle"]["postStart"]["exec"]["command"]),
    }
}

fn native() -> Shape {
    shape("shunt-sidecar-native.yaml")
}

fn classic() -> Shape {
    shape("shunt-sidecar-classic.yaml")
}

impl Shape {
    fn capture_flags(&self) -> Vec<&str> {
        self.capture.iter().map(String::as_str).collect()
    }

    /// A hook's command as written, `shunt` being the binary under test.
    fn hook(command: &[String]) -> Vec<String> {
        let mut argv = command.to_vec();
        assert_eq!(argv[0], "shunt", "{argv:?}");
        argv[0] = shunt_bin().display().to_string();
        argv
    }

    /// The kubelet's startupProbe, once: the status (0 when nothing answered).
    fn probe_once(&self, pod: &Pod) -> u16 {
        let (path, port) = self.startup_probe.clone().expect("a startupProbe");
        get(pod, local(port), &path)
    }

    /// The kubelet's startupProbe against the agent, polled until it passes (every
    /// 100 ms here; the shape says 1 s).
    fn run_startup_probe(&self, pod: &Pod, agent: &PodProcess) {
        wait_for("the startupProbe to pass", agent, || {
            self.probe_once(pod) == 200
        });
    }

    /// The preStop hook, run in the pod as the kubelet runs it.
    fn run_pre_stop(&self, pod: &Pod) {
        let argv = Shape::hook(self.pre_stop.as_ref().expect("a preStop hook"));
        let out = pod.command(&argv[0]).args(&argv[1..]).output().unwrap();
        assert!(out.status.success(), "preStop {argv:?}: {out:?}");
    }
}

// ------------------------------------------------------------------ pods and peers

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn at(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(pod.ipv4().into(), port)
}

/// One HTTP GET from inside `pod`: the status, 0 when nothing answered.
fn get(pod: &Pod, to: SocketAddr, path: &str) -> u16 {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    pod.run_in_netns(move || -> std::io::Result<u16> {
        let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(request.as_bytes())?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        Ok(raw
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0))
    })
    .unwrap()
    .unwrap_or(0)
}

fn wait_for(what: &str, process: &PodProcess, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(
            process.try_wait().is_none(),
            "{} exited while waiting for {what}:\n{}",
            process.description(),
            process.stderr_text()
        );
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{}",
            process.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A testapp echo server that sends each 256-byte piece back 100 ms after it came: a
/// call of N bytes lasts about N / 2560 seconds. Counts the connections it accepted.
fn start_slow_echo(pod: &Pod, port: u16) -> Arc<AtomicUsize> {
    let listener = pod
        .run_in_netns(move || TcpListener::bind(("0.0.0.0", port)))
        .unwrap()
        .unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || slow_echo(stream));
        }
    });
    accepted
}

fn slow_echo(mut stream: TcpStream) -> std::io::Result<()> {
    let hello = format!(
        "HELLO peer={} local={}\n",
        stream.peer_addr()?,
        stream.local_addr()?
    );
    stream.write_all(hello.as_bytes())?;
    let mut piece = [0u8; 256];
    loop {
        let n = stream.read(&mut piece)?;
        if n == 0 {
            return stream.shutdown(std::net::Shutdown::Write);
        }
        std::thread::sleep(Duration::from_millis(100));
        stream.write_all(&piece[..n])?;
    }
}

/// The agent's proxy: `virtualOutbound` (15001) to `upstream`, `virtualInbound`
/// (15006) to the app's 127.0.0.1:APP_PORT, as static listeners: ready at once.
fn static_config(dir: &TempDir, upstream: SocketAddr) -> std::path::PathBuf {
    let listener = |name: &str, port: u16, cluster: &str, direction: &str| {
        json!({
            "name": name, "traffic_direction": direction,
            "address": support::envoy::socket_address("0.0.0.0", port),
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": name, "cluster": cluster}}]}]
        })
    };
    let cluster = |name: &str, to: SocketAddr| {
        json!({"name": name, "type": "STATIC", "connect_timeout": "1s",
               "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                   "address": support::envoy::socket_address(to.ip(), to.port())}}]}]}})
    };
    let bootstrap = json!({
        "node": {"id": "sidecar~10.0.0.1~app.default~default.svc.cluster.local", "cluster": "app.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [listener("virtualOutbound", OUTBOUND, "upstream", "OUTBOUND"),
                          listener("virtualInbound", INBOUND, "app", "INBOUND")],
            "clusters": [cluster("upstream", upstream), cluster("app", local(APP_PORT))]
        }
    });
    let path = dir.0.join("bootstrap.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&bootstrap).unwrap()).unwrap();
    path
}

/// The same two listeners, pushed over ADS: the agent is ready only from then on.
fn push_config(server: &AdsServer, upstream: SocketAddr) {
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("upstream", 1), eds_cluster("app", 1)],
    );
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![
            named("upstream", &load_assignment("upstream", &[upstream])),
            named("app", &load_assignment("app", &[local(APP_PORT)])),
        ],
    );
    let any = SocketAddr::from(([0, 0, 0, 0], 0));
    let outbound = tcp_proxy_listener(
        "virtualOutbound",
        SocketAddr::new(any.ip(), OUTBOUND),
        "upstream",
    );
    let mut inbound =
        tcp_proxy_listener("virtualInbound", SocketAddr::new(any.ip(), INBOUND), "app");
    inbound.traffic_direction = TrafficDirection::Inbound as i32;
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![
            named("virtualOutbound", &outbound),
            named("virtualInbound", &inbound),
        ],
    );
}

fn agent_command(pod: &Pod, config: &Path, env: &[(&str, &str)]) -> PodCommand {
    let mut command = pod
        .command(shunt_bin())
        .args(["agent", "-c"])
        .arg(config)
        .env("INSTANCE_IP", pod.ipv4().to_string());
    for (key, value) in env {
        command = command.env(key, value);
    }
    command
}

/// `testapp call` as the app (uid 1000), its result as JSON.
fn app_call(pod: &Pod, to: SocketAddr) -> Value {
    Caller::app(pod).call_json(to)
}

fn assert_refused(call: &Value, what: &str) {
    assert_eq!(call["ok"], false, "{what}: {call}");
    let error = call["error"].as_str().unwrap_or_default();
    assert!(error.contains("refused"), "{what}: {call}");
}

/// The length of the accept queue of the socket listening on 0.0.0.0:`port` in `pod`
/// (`rx_queue` of a LISTEN line in /proc/net/tcp): connections the kernel completed
/// that nobody has accepted yet.
fn backlog(pod: &Pod, port: u16) -> Option<u32> {
    let local = format!("00000000:{port:04X}");
    pod.run_in_netns(move || {
        let table = std::fs::read_to_string("/proc/thread-self/net/tcp").ok()?;
        table.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(1) != Some(&local.as_str()) || fields.get(3) != Some(&"0A") {
                return None;
            }
            let (_, rx) = fields.get(4)?.split_once(':')?;
            u32::from_str_radix(rx, 16).ok()
        })
    })
    .unwrap()
}

/// The children of `pid` (its threads' `children` files).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a pid this test started (read from /proc).
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
}

/// A pod with `shareProcessNamespace: true`: its containers share one process
/// namespace (and a /proc showing it), whose PID 1 is the sandbox's pause process. The
/// agent's container runs in a cgroup of its own under the pod's, as a runtime gives
/// each container one; the app's processes stay in the pod's.
struct SharedPids {
    pod: Pod,
    _pause: PodProcess,
    pause_pid: u32,
}

impl SharedPids {
    fn new(pod: &Pod) -> SharedPids {
        let pause = pod
            .command("unshare")
            .args(["--pid", "--fork", "--mount-proc", "sleep", "infinity"])
            .spawn()
            .unwrap();
        let mut pause_pid = None;
        wait_for("the pause process", &pause, || {
            pause_pid = children(pause.pid()).first().copied();
            pause_pid.is_some()
        });
        SharedPids {
            pod: pod.clone(),
            _pause: pause,
            pause_pid: pause_pid.unwrap(),
        }
    }

    fn enter(&self) -> PodCommand {
        self.pod
            .command("nsenter")
            .args(["-t", &self.pause_pid.to_string(), "--pid", "--mount"])
    }

    /// `argv` in the agent's container (its cgroup `istio-proxy`), as root.
    fn agent_container(&self, argv: &[String]) -> PodCommand {
        let cgroup = self.pod.cgroup_path().join("istio-proxy");
        std::fs::create_dir_all(&cgroup).unwrap();
        let join = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cgroup.display());
        self.enter()
            .args(["--", "sh", "-c", &join, "sh"])
            .args(argv)
    }

    /// `argv` in the app's container, as the app's uid.
    fn app_container(&self, argv: &[String]) -> PodCommand {
        let uid = APP_UID.to_string();
        self.enter()
            .args(["--setuid", &uid, "--setgid", &uid, "--"])
            .args(argv)
    }
}

fn strings(argv: &[&str]) -> Vec<String> {
    argv.iter().map(|s| s.to_string()).collect()
}

fn shunt_agent_argv(config: &Path) -> Vec<String> {
    strings(&[
        &shunt_bin().display().to_string(),
        "agent",
        "-c",
        &config.display().to_string(),
    ])
}

/// A Job's container: three calls through the proxy, then exit (non-zero if one fails).
/// To the slow echo, each call lasts 100 ms: the Job runs longer than one look of the
/// agent's watch, as it must to be seen.
fn job_argv(to: SocketAddr) -> Vec<String> {
    let call = format!("{} call {to} --bytes 64", testapp_bin().display());
    strings(&[
        "sh",
        "-c",
        &format!("for i in 1 2 3; do {call} || exit 1; done"),
    ])
}

/// Everything the process printed: its exit can be seen before the reader has taken
/// the pipe's last bytes, so this waits (5 s at most) for stdout to close first.
fn output(process: &PodProcess) -> String {
    let _ = process.wait_for_stdout(|_| false, Duration::from_secs(5));
    process.stdout_text()
}

fn job_calls(job: &PodProcess) -> usize {
    output(job)
        .lines()
        .filter(|l| l.contains("\"ok\":true"))
        .count()
}

// ------------------------------------------------------------------------- native

/// Native: the kubelet starts the app only once the agent's startupProbe passes (503
/// while the proxy has no config), so the app's first call is served. Termination:
/// the preStop hook drains inbound (new inbound connections are refused), the app's
/// in-flight outbound call outlives the app's SIGTERM and completes intact, new
/// outbound calls still work, and the agent, signalled once the app is gone, exits 0.
#[test]
fn native_sidecar_is_ready_before_the_app_and_stops_after_it() {
    let shape = native();
    let (dir, socket, ads) = unix_server("lifecycle-native");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let server = node.add_pod("server").unwrap();
    let client = node.add_pod("client").unwrap();
    let accepted = start_slow_echo(&server, SLOW_ECHO);
    let capture = Capture::new("ebpf", "lifecycle-native");
    capture.install(&pod, &shape.capture_flags());

    // The sidecar init container, without config yet: its startupProbe fails.
    let config = dir.0.join("bootstrap.json");
    std::fs::write(
        &config,
        serde_json::to_vec(&bootstrap(&socket, false)).unwrap(),
    )
    .unwrap();
    let mut agent = agent_command(&pod, &config, &[]).spawn().unwrap();
    wait_for("the agent's readiness port", &agent, || {
        shape.probe_once(&pod) != 0
    });
    assert_eq!(shape.probe_once(&pod), 503, "ready before its config");
    push_config(&ads, at(&server, SLOW_ECHO));
    shape.run_startup_probe(&pod, &agent);

    // The app container: its server, and a call that lasts ~2 s and ignores SIGTERM
    // (an app finishing its work during its grace period).
    let app_server = support::start_app(&pod, &[APP_PORT]);
    let inbound = app_call(&client, at(&pod, APP_PORT));
    assert_eq!(
        inbound["ok"], true,
        "inbound through the sidecar: {inbound}"
    );
    let call = format!(
        "trap '' TERM; exec {} call {} --bytes 5120",
        testapp_bin().display(),
        at(&server, NOWHERE)
    );
    let mut app = pod
        .command("sh")
        .uid(APP_UID)
        .gid(APP_UID)
        .args(["-c", &call])
        .spawn()
        .unwrap();
    wait_for("the app's call to reach the server", &app, || {
        accepted.load(Ordering::SeqCst) == 1
    });

    // Pod termination: preStop, then SIGTERM to the app's container.
    shape.run_pre_stop(&pod);
    wait_for("inbound to be refused", &agent, || {
        app_call(&client, at(&pod, APP_PORT))["ok"] == false
    });
    assert_refused(
        &app_call(&client, at(&pod, APP_PORT)),
        "inbound once drained",
    );
    app.signal(libc::SIGTERM).unwrap();
    app_server.signal(libc::SIGTERM).unwrap();
    let outbound = Caller {
        bytes: 256,
        ..Caller::app(&pod)
    }
    .call_json(at(&server, NOWHERE));
    assert_eq!(
        outbound["ok"], true,
        "outbound while the app stops: {outbound}"
    );

    // The in-flight call completes intact, the agent still serving; only then does the
    // kubelet signal the agent, which exits 0.
    let exit = app.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(exit.success(), "the app's call: {}", output(&app));
    assert!(output(&app).contains("\"bytes\":5120"), "{}", output(&app));
    assert!(agent.try_wait().is_none(), "the agent left before the app");
    agent.signal(libc::SIGTERM).unwrap();
    let exit = agent.wait_timeout(DRAIN).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
}

/// A Job with the native sidecar: three calls through the proxy, the Job exits 0; the
/// kubelet then stops the sidecar (preStop, SIGTERM), which exits 0 within the drain
/// time, so the pod completes.
#[test]
fn a_job_pod_completes_with_the_native_sidecar() {
    let shape = native();
    let dir = TempDir::new("lifecycle-job-native");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("job").unwrap();
    let server = node.add_pod("server").unwrap();
    let _slow = start_slow_echo(&server, SLOW_ECHO);
    let capture = Capture::new("ebpf", "lifecycle-job-native");
    capture.install(&pod, &shape.capture_flags());
    let config = static_config(&dir, at(&server, SLOW_ECHO));
    let mut agent = agent_command(&pod, &config, &[]).spawn().unwrap();
    shape.run_startup_probe(&pod, &agent);

    let argv = job_argv(at(&server, NOWHERE));
    let mut job = pod
        .command(&argv[0])
        .uid(APP_UID)
        .gid(APP_UID)
        .args(&argv[1..])
        .spawn()
        .unwrap();
    let exit = job.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(exit.success(), "the job: {}", output(&job));
    assert_eq!(job_calls(&job), 3, "{}", output(&job));

    shape.run_pre_stop(&pod);
    agent.signal(libc::SIGTERM).unwrap();
    let exit = agent.wait_timeout(DRAIN).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
}

// ------------------------------------------------------------------------ classic

/// A Job with the classic sidecar in a pod sharing its process namespace, the agent
/// watching the app (SHUNT_EXIT_WHEN_APP_EXITS): the postStart hook holds the Job until
/// the proxy is ready, the Job's three calls go through it, and once the Job has
/// exited 0 the agent exits 0 by itself, within the drain time, no signal sent.
#[test]
fn a_job_pod_completes_with_the_classic_sidecar_watching_the_app() {
    let shape = classic();
    let dir = TempDir::new("lifecycle-job-classic");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("job").unwrap();
    let server = node.add_pod("server").unwrap();
    let _slow = start_slow_echo(&server, SLOW_ECHO);
    let capture = Capture::new("ebpf", "lifecycle-job-classic");
    capture.install(&pod, &shape.capture_flags());
    let pids = SharedPids::new(&pod);

    let config = static_config(&dir, at(&server, SLOW_ECHO));
    let mut agent = pids
        .agent_container(&shunt_agent_argv(&config))
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("SHUNT_EXIT_WHEN_APP_EXITS", "true")
        .spawn()
        .unwrap();
    let hook = Shape::hook(shape.post_start.as_ref().expect("a postStart hook"));
    let out = pids.agent_container(&hook).output().unwrap();
    assert!(out.status.success(), "postStart {hook:?}: {out:?}");

    let mut job = pids
        .app_container(&job_argv(at(&server, NOWHERE)))
        .spawn()
        .unwrap();
    let exit = job.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(exit.success(), "the job: {}", output(&job));
    assert_eq!(job_calls(&job), 3, "{}", output(&job));

    let exit = agent.wait_timeout(DRAIN).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    assert!(
        agent
            .stderr_text()
            .contains("the app's containers have exited"),
        "{}",
        agent.stderr_text()
    );
}

/// Classic termination: every container gets SIGTERM at once. The agent watching the
/// app closes its inbound listener and keeps serving the app's outbound (new calls
/// too) until the app has exited, well past a 1 s termination drain: the app's 3 s
/// call completes intact; then the agent exits 0.
#[test]
fn classic_sidecar_on_sigterm_serves_the_apps_outbound_until_the_app_exits() {
    let shape = classic();
    let dir = TempDir::new("lifecycle-term-classic");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let server = node.add_pod("server").unwrap();
    let accepted = start_slow_echo(&server, SLOW_ECHO);
    let capture = Capture::new("ebpf", "lifecycle-term-classic");
    capture.install(&pod, &shape.capture_flags());
    let pids = SharedPids::new(&pod);

    let config = static_config(&dir, at(&server, SLOW_ECHO));
    let mut agent = pids
        .agent_container(&shunt_agent_argv(&config))
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("SHUNT_EXIT_WHEN_APP_EXITS", "true")
        .env("TERMINATION_DRAIN_DURATION_SECONDS", "1")
        .spawn()
        .unwrap();
    let hook = Shape::hook(shape.post_start.as_ref().expect("a postStart hook"));
    let out = pids.agent_container(&hook).output().unwrap();
    assert!(out.status.success(), "postStart {hook:?}: {out:?}");
    let agent_pid = children(agent.pid())[0];

    let call = format!(
        "trap '' TERM; exec {} call {} --bytes 7680",
        testapp_bin().display(),
        at(&server, NOWHERE)
    );
    let mut app = pids
        .app_container(&strings(&["sh", "-c", &call]))
        .spawn()
        .unwrap();
    wait_for("the app's call to reach the server", &app, || {
        accepted.load(Ordering::SeqCst) == 1
    });

    // The pod is deleted: SIGTERM to the agent's and the app's containers.
    signal(agent_pid, libc::SIGTERM);
    signal(children(app.pid())[0], libc::SIGTERM);
    wait_for("the inbound listener to close", &app, || {
        !tcp_listeners(&pod)
            .unwrap()
            .iter()
            .any(|l| l.port() == INBOUND)
    });
    let outbound = Caller {
        bytes: 256,
        ..Caller::app(&pod)
    }
    .call_json(at(&server, NOWHERE));
    assert_eq!(
        outbound["ok"], true,
        "outbound while the app stops: {outbound}"
    );
    let exit = app.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(
        exit.success(),
        "the app's call was cut: {}\nthe agent: {}",
        output(&app),
        agent.stderr_text()
    );
    assert!(output(&app).contains("\"bytes\":7680"), "{}", output(&app));
    let exit = agent.wait_timeout(DRAIN).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
}

// ------------------------------------------------------------- the first request

/// Before the agent's process exists nothing listens on 15001 and the capture (eBPF or
/// iptables) resets a captured connect: the app sees ECONNREFUSED, which is what the
/// startupProbe and the postStart hook keep it from meeting. Once the agent has
/// started, its capture sockets are bound before it reads its config: an app that
/// connects in its first millisecond, while the agent has no config (15021 says 503),
/// is queued in 15001's backlog, not refused, and its call is served once the config
/// arrives.
fn an_early_connect_waits_for_the_config_instead_of_being_refused(backend: &'static str) {
    let tag = format!("lifecycle-early-{backend}");
    let (dir, socket, ads) = unix_server(&tag);
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let server = node.add_pod("server").unwrap();
    let _echo = support::start_app(&server, &[ECHO]);
    let capture = Capture::new(backend, &tag);
    capture.install(&pod, &native().capture_flags());

    assert_refused(
        &app_call(&pod, at(&server, NOWHERE)),
        "a connect before the agent",
    );

    let config = dir.0.join("bootstrap.json");
    std::fs::write(
        &config,
        serde_json::to_vec(&bootstrap(&socket, false)).unwrap(),
    )
    .unwrap();
    let agent = agent_command(&pod, &config, &[]).spawn().unwrap();
    wait_for_port(
        &pod,
        "0.0.0.0:15001".parse().unwrap(),
        Duration::from_secs(10),
    )
    .unwrap();
    wait_for("the agent's readiness port", &agent, || {
        get(&pod, local(15021), "/healthz/ready") == 503
    });

    let mut app = pod
        .command(testapp_bin())
        .uid(APP_UID)
        .gid(APP_UID)
        .args([
            "call",
            &at(&server, NOWHERE).to_string(),
            "--timeout-ms",
            "20000",
        ])
        .spawn()
        .unwrap();
    wait_for("the app's connection in the backlog", &app, || {
        backlog(&pod, OUTBOUND) == Some(1)
    });
    assert_eq!(get(&pod, local(15021), "/healthz/ready"), 503);
    push_config(&ads, at(&server, ECHO));
    let exit = app.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(
        exit.success(),
        "{}\nagent: {}",
        output(&app),
        agent.stderr_text()
    );
    // Ready once the update that served the app is accepted: that comes just after its
    // listener starts serving (the snapshot is swapped in first), so it is waited for.
    wait_for("the agent's readiness after the config", &agent, || {
        get(&pod, local(STATUS), "/healthz/ready") == 200
    });
}

#[test]
fn an_early_connect_waits_for_the_config_instead_of_being_refused_ebpf() {
    an_early_connect_waits_for_the_config_instead_of_being_refused("ebpf");
}

#[test]
fn an_early_connect_waits_for_the_config_instead_of_being_refused_iptables() {
    an_early_connect_waits_for_the_config_instead_of_being_refused("iptables");
}

// ------------------------------------------------------------- init containers

/// An init container runs after capture and, unless the native sidecar is already
/// up, without a proxy: its captured connects are refused. It reaches the network as
/// uid 1337 (the proxy's, never captured), to an excluded port (`-o`) or CIDR (`-x`),
/// or, placed after the native sidecar, through the proxy.
fn init_containers_reach_the_network_the_supported_ways(backend: &'static str) {
    let tag = format!("lifecycle-init-{backend}");
    let dir = TempDir::new(&tag);
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let server = node.add_pod("server").unwrap();
    let excluded = node.add_pod("excluded").unwrap();
    let _echo = support::start_app(&server, &[ECHO, ECHO_EXCLUDED]);
    let _other = support::start_app(&excluded, &[ECHO]);
    let shape = native();
    let mut flags = shape.capture_flags();
    let cidr = format!("{}/32", excluded.ipv4());
    let x = flags.iter().position(|f| *f == "-x").unwrap();
    flags[x + 1] = &cidr;
    let port = ECHO_EXCLUDED.to_string();
    flags.extend(["-o", port.as_str()]);
    let capture = Capture::new(backend, &tag);
    capture.install(&pod, &flags);

    let app = Caller::app(&pod);
    let proxy_uid = Caller {
        uid: PROXY_UID,
        gid: PROXY_UID,
        ..Caller::app(&pod)
    };
    assert_refused(&app.call_json(at(&server, ECHO)), "captured, no proxy yet");
    let direct = proxy_uid.call(at(&server, ECHO)).expect("as uid 1337");
    assert_eq!(direct.server_peer.ip(), pod.ipv4(), "straight from the pod");
    let port = app.call(at(&server, ECHO_EXCLUDED));
    assert!(port.is_ok(), "to an excluded port: {port:?}");
    let cidr = app.call(at(&excluded, ECHO));
    assert!(cidr.is_ok(), "to an excluded CIDR: {cidr:?}");

    // The native sidecar started first: the next init container has the mesh.
    let config = static_config(&dir, at(&server, ECHO));
    let agent = agent_command(&pod, &config, &[]).spawn().unwrap();
    shape.run_startup_probe(&pod, &agent);
    let meshed = app.call(at(&server, NOWHERE));
    assert!(
        meshed.is_ok(),
        "through the sidecar: {meshed:?}\n{}",
        agent.stderr_text()
    );
}

#[test]
fn init_containers_reach_the_network_the_supported_ways_ebpf() {
    init_containers_reach_the_network_the_supported_ways("ebpf");
}

#[test]
fn init_containers_reach_the_network_the_supported_ways_iptables() {
    init_containers_reach_the_network_the_supported_ways("iptables");
}
